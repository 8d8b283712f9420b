"""Output processing: from a forward's logits to tokens appended, streamed and finished.

Everything that happens to a request after the forward is here, in one place (DESIGN.md, "The
path of one gen"):

* :meth:`OutputProcessor.logit_offsets` says which positions of each row need logits (prompt
  log-probabilities, the next token, one per draft token);
* :meth:`OutputProcessor.process` records prompt log-probabilities, inserts computed prefixes
  into the prefix cache, verifies verify rows (through the speculative planner, which returns
  the kept tokens), fills grammar masks and samples the other rows, and appends every token;
* :meth:`OutputProcessor.append_token` checks, token by token, grammar acceptance, EOS and stop
  ids, stop strings, grammar termination, ``max_tokens`` and the context window, then streams
  the new text or finishes the request;
* :meth:`OutputProcessor.finish` releases the request's KV (the scheduler does), pushes its
  :class:`Result`, and records it for the loop to retire (:meth:`take_finished`).

Runs on the engine's loop thread.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from sgrt.engine.metrics import EngineMetrics
from sgrt.engine.outputs import StreamChunk
from sgrt.engine.request import Req
from sgrt.engine.sampler import sample, top_logprobs
from sgrt.engine.scheduler import Row, Scheduler
from sgrt.engine.stop_matcher import StopMatcher
from sgrt.engine.verify import Draft
from sgrt.errors import GrammarError, InvalidRequest


class OutputProcessor:
    """Turns logits into tokens and tokens into streamed chunks and results.

    Args:
        scheduler: releases a finished request's KV and caches computed prefixes.
        spec: the speculative planner (:class:`sgrt.engine.speculative.SpecPlanner`); it
            verifies the drafts of verify rows.
        metrics: engine-wide counters.
        eos_ids: the tokenizer's end ids.
        context_length: the model's context window; a request that fills it finishes with
            ``length``.
    """

    def __init__(self, scheduler: Scheduler, spec: Any, metrics: EngineMetrics, eos_ids: set[int],
                 context_length: int):
        self.scheduler = scheduler
        self.spec = spec
        self.metrics = metrics
        self.eos_ids = eos_ids
        self.context_length = context_length
        self._finished: list[Req] = []

    # -- before the forward ------------------------------------------------------------------
    def logit_offsets(self, row: Row) -> list[int]:
        """Offsets within ``row`` (0 = its first fed token) whose logits are needed: prompt
        positions still to score for prompt log-probabilities, then, when the row completes
        its fill and the request samples, its last token's and one per draft token."""
        req = row.req
        offsets: list[int] = []
        lsl = req.params.logprob_start_len
        if lsl >= 0:
            # logits at position j score prompt token j + 1
            next_pos = lsl + len(req.prompt_logprobs)
            prompt_len = len(req.prompt_ids)
            for j in range(row.start, row.start + row.n):
                if next_pos <= j + 1 < prompt_len:
                    offsets.append(j - row.start)
        if row.completes_fill and req.params.max_tokens > 0:
            offsets.extend(range(row.n - 1 - len(row.draft), row.n))  # + one per draft token
        return offsets

    # -- after the forward -------------------------------------------------------------------
    def process(self, rows: list[Row], logits: list[torch.Tensor], drafts: dict[str, Draft]) -> None:
        """Handle one forward's results.

        Args:
            rows: the forward's rows.
            logits: per row, float32 ``[len(logit_offsets(row)), V]``.
            drafts: the draft of each verify row, by request id (``SpecPlanner.plan``).
        """
        to_sample: list[tuple[Row, torch.Tensor]] = []
        cache_after: list[Req] = []
        for row, row_logits in zip(rows, logits):
            req = row.req
            n_prompt_lp = self._record_prompt_logprobs(row, row_logits)
            if not row.completes_fill:
                self.scheduler.cache_prefix(req)
                continue
            if not req.output_ids:
                # The whole prompt is now shareable. A row that also verified a draft holds
                # slots for draft tokens not yet in fill_ids: cache once they are resolved.
                if row.draft:
                    cache_after.append(req)
                else:
                    self.scheduler.cache_prefix(req)
            if req.params.max_tokens == 0:
                self.finish(req, "length")
                continue
            to_sample.append((row, row_logits[n_prompt_lp:]))
        now = time.monotonic()
        for row, row_logits in to_sample:
            if row.draft:
                self._verify_and_append(row, drafts[row.req.request_id], row_logits, now)
        plain = [(row, lg) for row, lg in to_sample if not row.draft]
        if plain:
            self._sample_and_append(plain)
        for req in cache_after:
            if not req.finished:
                self.scheduler.cache_prefix(req)

    def _record_prompt_logprobs(self, row: Row, row_logits: torch.Tensor) -> int:
        """Append the log-probabilities of the prompt tokens this row scores; return how many
        leading logits rows they used."""
        req = row.req
        lsl = req.params.logprob_start_len
        if lsl < 0:
            return 0
        next_pos = lsl + len(req.prompt_logprobs)
        prompt_len = len(req.prompt_ids)
        positions = [j + 1 for j in range(row.start, row.start + row.n) if next_pos <= j + 1 < prompt_len]
        if not positions:
            return 0
        lp = torch.log_softmax(row_logits[: len(positions)], dim=-1)
        targets = torch.tensor([req.prompt_ids[p] for p in positions], dtype=torch.long, device=lp.device)
        values = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        req.prompt_logprobs.extend(values)
        if req.params.top_logprobs_num:
            req.prompt_top_logprobs.extend(top_logprobs(lp[i], req.params.top_logprobs_num) for i in range(len(positions)))
        return len(positions)

    def _verify_and_append(self, row: Row, draft: Draft, logits: torch.Tensor, now: float) -> None:
        """Verify a verify row's draft against its logits ``[k + 1, V]`` and append the kept
        tokens one by one (so every stop condition is checked as without a draft)."""
        req = row.req
        out = self.spec.verify(row, draft, logits)
        req.spec_drafted += len(draft.tokens) - draft.num_forced
        for i, token in enumerate(out.tokens):
            if i < out.num_accepted:
                if i < draft.num_forced:
                    req.forced_tokens += 1
                else:
                    req.spec_accepted += 1
            lp = out.logprobs[i] if out.logprobs else 0.0
            top = out.top_logprobs[i] if out.top_logprobs else []
            self.append_token(req, token, lp, top, now)
            if req.finished:
                break

    def _sample_and_append(self, rows: list[tuple[Row, torch.Tensor]]) -> None:
        """Sample one token for each row from its last logits row (grammar masks applied)."""
        reqs = [row.req for row, _ in rows]
        # (a view where possible; sample() copies before it edits a row)
        logits = last_rows_batch([lg for _, lg in rows])
        bitmask = None
        if any(r.grammar is not None for r in reqs):
            from sgrt.constrained import allocate_token_bitmask

            bitmask = allocate_token_bitmask(len(reqs), logits.shape[-1])
            for i, req in enumerate(reqs):
                if req.grammar is not None:
                    req.grammar.fill_vocab_mask(bitmask, i)
        out = sample(logits, reqs, bitmask, self.eos_ids)
        now = time.monotonic()
        for i, req in enumerate(reqs):
            self.append_token(req, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], now)

    def append_forced(self, jumps: list[tuple[Req, list[int]]]) -> None:
        """Append text jump-forward runs (``SpecPlanner.plan_text_jumps``): unverified forced
        tokens, without log-probabilities; their KV is computed by the next forward."""
        now = time.monotonic()
        for req, tokens in jumps:
            for t in tokens:
                req.forced_tokens += 1
                self.append_token(req, t, 0.0, [], now)
                if req.finished:
                    break

    # -- one token ---------------------------------------------------------------------------
    def append_token(self, req: Req, token: int, logprob: float, top: list[tuple[int, float]], now: float) -> None:
        """Append ``token`` to ``req``'s output, then finish it or stream the new text.

        Order of the checks: the grammar accepts the token (else abort: its mask allowed it);
        once ``min_tokens`` are out and the grammar accepts the text, a stop id or EOS, then a
        stop string (the text is cut before it); grammar termination; ``max_tokens`` or a full
        context window (``length``; a constrained output not accepting yet is ``incomplete``).
        """
        params = req.params
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        req.output_ids.append(token)
        if params.return_logprob:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top)
        self.metrics.generated_tokens += 1
        if req.grammar is not None and not req.grammar.accept_token(token):
            # A matcher that hit one of its per-step resource limits (GrammarLimits) stops with
            # an error after its mask allowed the token: a typed error naming it, not a crash.
            reason = req.grammar.error
            error: Exception = (GrammarError(f"the constraint hit a grammar engine limit during generation: "
                                             f"{reason.strip().splitlines()[0]}", field="grammar")
                                if reason else RuntimeError(f"grammar rejected token {token} that its mask allowed"))
            self.finish(req, "abort", error=error)
            return
        new_text = req.detokenizer.add([token])
        req.text += new_text
        hit = None
        if params.stop:
            # NOTE: fed every piece, checked or not, so that the automaton's position is the
            # text's; only a match that ends in this piece counts (as before min_tokens / a
            # grammar that does not accept yet, an earlier one is let go).
            matcher = req.stop_matcher
            if matcher is None:
                matcher = req.stop_matcher = StopMatcher(params.stop)
                matcher.feed(req.text[:-len(new_text)] if new_text else req.text)
            hit = matcher.feed(new_text)
        accepting = req.grammar is None or req.grammar.is_accepting()
        min_reached = len(req.output_ids) >= params.min_tokens
        if min_reached and accepting:
            if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
                self.finish(req, "stop", matched=token)
                return
            if hit is not None:
                idx, s = hit
                req.text = req.text[:idx + len(s)] if params.no_stop_trim else req.text[:idx]
                self.finish(req, "stop", matched=s)
                return
        if req.grammar is not None and req.grammar.is_terminated():
            self.finish(req, "stop", matched="grammar")
            return
        if len(req.output_ids) >= params.max_tokens or req.num_fill >= self.context_length:
            req.incomplete = req.grammar is not None and not req.grammar.is_accepting()
            self.finish(req, "length")
            return
        self._stream(req, final=False)

    # -- streaming and finishing -------------------------------------------------------------
    def _next_chunk(self, req: Req, final: bool) -> StreamChunk:
        """The text and tokens not yet sent. Unless ``final``, hold back the last characters
        that could still become a stop string."""
        matcher = req.stop_matcher
        hold = 0 if final or matcher is None else max(matcher.max_len - 1, 0)
        end = max(len(req.text) - hold, req.sent_len)
        text = req.text[req.sent_len:end]
        first = req.sent_tokens
        want_lp = req.params.return_logprob
        chunk = StreamChunk(
            req.request_id,
            text,
            req.output_ids[first:],
            req.output_logprobs[first:] if want_lp else None,
            req.output_top_logprobs[first:] if want_lp and req.params.top_logprobs_num else None,
        )
        req.sent_len = end
        req.sent_tokens = len(req.output_ids)
        return chunk

    def _stream(self, req: Req, final: bool) -> None:
        chunk = self._next_chunk(req, final)
        if chunk.text or chunk.token_ids:
            req.channel.push(chunk)

    def finish(self, req: Req, reason: str, matched: int | str | None = None,
               error: BaseException | None = None) -> None:
        """Finish ``req`` (once; later calls do nothing): the scheduler releases its KV (the
        computed prefix goes into the prefix cache), the rest of its text is flushed, and its
        last chunk carries the :class:`Result`. A request refused before its first token with
        an ``InvalidRequest`` (a grammar that does not compile) fails its handle instead."""
        if req.finished:
            return
        self.scheduler.finish(req)
        req.finish_reason = reason
        req.matched = matched
        req.error = error
        self._finished.append(req)
        chunk: StreamChunk | None = None
        try:
            if reason != "stop" or not isinstance(matched, str) or matched == "grammar":
                req.text += req.detokenizer.flush()
            chunk = self._next_chunk(req, final=True)
        except Exception as exc:
            # NOTE: the error that brought us here may be this same detokenizer's (the loop
            # finishes every request after a failed step): the request ends failed, without
            # its last text, rather than the exception escaping and stopping the engine loop.
            req.finish_reason, req.error = "abort", error or exc
        result = req.to_result(req.text)
        self.metrics.record_finish(result)
        if chunk is None:
            req.channel.fail(req.error, result)
        elif error is not None and req.first_token_time is None and isinstance(error, InvalidRequest):
            req.channel.fail(error, result)
        else:
            chunk.finished = True
            chunk.result = result
            req.channel.push(chunk)

    def take_finished(self) -> list[Req]:
        """The requests finished since the last call (the loop retires them)."""
        out, self._finished = self._finished, []
        return out


def last_rows_batch(logits: list[torch.Tensor]) -> torch.Tensor:
    """``[N, V]``: the last row of each of ``logits`` (``[n_i, V]``, ``n_i >= 1``).

    Without a copy where it can: one tensor's own last row, or, for a decode batch (every row
    one logits row), the runner's whole logits tensor when the rows are its consecutive rows (the
    views of ``ModelRunner.forward``): ``torch.cat`` would copy ``N x V`` float32 a step (16 MB
    at batch 16 for Gemma 3's 262k vocabulary).
    """
    if len(logits) == 1:
        lg = logits[0]
        return lg if lg.shape[0] == 1 else lg[-1:]
    base = logits[0]._base
    if base is not None and base.dim() == 2 and base.shape[0] == len(logits) and base.is_contiguous():
        start, width = base.storage_offset(), base.shape[1]
        if all(lg._base is base and lg.shape == (1, width) and lg.storage_offset() == start + i * width
               for i, lg in enumerate(logits)):
            return base
    return torch.cat([lg[-1:] for lg in logits], dim=0)
