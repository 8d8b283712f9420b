"""Speculative decoding and jump-forward inside the continuous batch.

The engine calls four hooks (DESIGN.md, "Draft / verify" and "Jump-forward"):

* :meth:`SpecDecoder.jump_forward_text` before scheduling: requests in *text* jump-forward mode
  get the grammar's forced tokens appended without verification (all but a last token that a
  longer allowed token could extend); their KV is computed by the next forward like a prefill
  chunk.
* :meth:`SpecDecoder.prepare` after scheduling: a row that is about to sample becomes a *verify
  row* of ``k + 1`` tokens: the grammar's forced text, tokenized (*exact* jump-forward,
  constrained requests; also before the first output token, when the prompt's last prefill
  chunk verifies it), or a drafter's proposal (``speculative="ngram" | "draft"``, from the
  second output token), cut at the first token the grammar forbids, with ``k`` KV slots
  allocated for it.
* :meth:`SpecDecoder.verify_rows` after the forward: :func:`sgrt.engine.verify.verify` keeps the
  accepted prefix plus one target token; rejected drafts give back their KV slots; the tokens go
  through ``Engine._append_token`` one by one, so stop strings, EOS, ``max_tokens`` and grammar
  termination are checked exactly as without speculation.
* :meth:`SpecDecoder.release` when a request finishes.

Draft length and turning off under load, one rule (the cost model of Leviathan et al.,
arXiv:2211.17192, section 3.4, applied to a whole batch). In units of a batch-1 one-token
forward, a forward over ``T`` tokens costs ``1 + gamma * (T - 1)``, plus ``switch`` when drafts
turn a one-token forward into a longer one (a matrix-vector product becomes a matrix product;
attention needs a mask). ``speculative_cost = (switch, gamma)``: on CPU (0.37, 0.055), measured
for the default model in float32 (CPU time of one thread: 4 tokens cost 1.45 one-token forwards,
8 tokens 1.75, 16 tokens 2.2, 32 tokens 3.1; oddly, 2 and 3 tokens cost 1.8 and 2.2 there); on
CUDA (0, 0.005), an estimate.

Each request keeps ``alpha``, a smoothed estimate of the chance that its next draft token is
accepted (accepted draft tokens / (accepted + rejections), decayed, prior 0.5), one per draft
source: the draft model, or the order (3, 2, 1) of the n-gram match. The ``j``-th draft token is
accepted with probability about ``alpha ** j``; granting it raises the step's expected yield
``Y`` by that and its cost ``C`` by ``gamma``, so it pays when ``alpha ** j * C > gamma * Y``.
:func:`plan_draft_lengths` grants draft tokens greedily, best first, up to ``num_draft_tokens``
per request, then drops them all if ``Y / C`` does not beat the step without drafts (the switch
cost). So drafts grow while they are accepted, shrink when they are not, and stop as the batch
grows: with ``B`` decode rows the first draft token must beat ``gamma * B / (1 + gamma * (B -
1))``, which for ``gamma = 0.055`` passes 0.6 above 25 rows and 0.8 above 68. A request that
drafts nothing drifts back to the prior and probes again. Exact jump-forward is exempt: a forced
run is nearly always accepted.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sgrt.engine.drafters import DraftModelDrafter, NgramIndex
from sgrt.engine.request import Req
from sgrt.engine.scheduler import Row
from sgrt.engine.verify import Draft, VerifyOutput, token_allowed, verify, walk_grammar
from sgrt.errors import InvalidRequest

# Forward cost model (module docstring): (switch, per token), in units of a batch-1 one-token
# forward. CPU: measured (default model, float32, one thread, CPU time of 1..32-token forwards).
CPU_COST = (0.37, 0.055)
CUDA_COST = (0.0, 0.005)  # NOTE: an estimate (a small model's GPU forward is launch-bound), not measured here
PRIOR_ACCEPTED, PRIOR_REJECTED = 0.5, 0.5  # pseudo-counts: alpha starts at 0.5
DECAY = 0.9  # weight of past verifications at each new one
# NOTE: per step without a draft, drift back towards the prior. At batch 1 on CPU a draft needs
# alpha > ~0.36 to pay for the switch cost; a request whose drafts are always rejected then
# probes again about every 23 steps (after a long bad run, after ~60).
IDLE_DECAY = 0.95
MODEL_SOURCE = 0  # acceptance statistics of draft-model drafts; n-gram drafts use their match order


@dataclass
class SpecState:
    """Per-request acceptance statistics, one pair per draft source (the draft model, or the
    order 1..3 of the n-gram match that proposed the draft), and the n-gram index."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * 4)  # decayed accepted draft tokens
    rejected: list[float] = field(default_factory=lambda: [0.0] * 4)  # decayed drafts cut short
    ngram: NgramIndex = field(default_factory=NgramIndex)

    def alpha(self, source: int) -> float:
        """Estimated probability that the next draft token from ``source`` is accepted."""
        a, r = self.accepted[source], self.rejected[source]
        return (a + PRIOR_ACCEPTED) / (a + r + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def update(self, source: int, drafted: int, accepted: int) -> None:
        """Record a verification: ``accepted`` of ``drafted`` tokens from ``source`` kept."""
        self.accepted[source] = DECAY * self.accepted[source] + accepted
        self.rejected[source] = DECAY * self.rejected[source] + (accepted < drafted)

    def idle(self) -> None:
        """A step without a draft: every estimate drifts back towards the prior."""
        self.accepted = [a * IDLE_DECAY for a in self.accepted]
        self.rejected = [r * IDLE_DECAY for r in self.rejected]


def plan_draft_lengths(alphas: list[float], caps: list[int], num_sampling: int, num_tokens: int,
                       cost: tuple[float, float]) -> list[int]:
    """Draft length per request for one step (see the module docstring).

    Args:
        alphas: per candidate request, the estimated acceptance probability of a draft token.
        caps: per candidate, the most draft tokens it may take.
        num_sampling: rows that sample this step (each yields at least one token).
        num_tokens: tokens the forward feeds before any draft (prefill chunks included).
        cost: ``(switch, per_token)``: a forward over ``T`` tokens costs ``1 + per_token *
            (T - 1)``, plus ``switch`` when drafts turn a one-token forward into a longer one.
    """
    switch, gamma = cost
    lengths = [0] * len(alphas)
    base = 1.0 + gamma * (num_tokens - 1)
    y = float(num_sampling)
    c = base + (switch if num_tokens == 1 else 0.0)
    heap = [(-a, i) for i, a in enumerate(alphas) if caps[i] > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain * c <= gamma * y:
            break  # (y + gain) / (c + gamma) <= y / c: the best remaining token does not pay
        lengths[i] += 1
        y += gain
        c += gamma
        if lengths[i] < caps[i]:
            heapq.heappush(heap, (-(gain * alphas[i]), i))
    if any(lengths) and y / c <= num_sampling / base:
        return [0] * len(alphas)  # the drafts do not pay for the switch to a longer forward
    return lengths


class SpecDecoder:
    """Drafting, verification and jump-forward for one engine (runs on the loop thread).

    Args:
        config: the :class:`sgrt.engine.engine.EngineConfig` (``speculative``,
            ``num_draft_tokens``, ``draft_model``, ``draft_max_total_tokens``,
            ``speculative_cost``, ``max_jump_forward_tokens``).
        pool, cache: the target's KV pool and radix cache (draft slots come from the pool;
            the cache is evicted for them, requests are never retracted for them).
        loaded: the target :class:`sgrt.models.LoadedModel` (a draft model given by spec is
            loaded with its dtype and device).
        eos_ids: the tokenizer's end ids.
        context_length: the target's context window.
        append: ``Engine._append_token``.

    Raises:
        InvalidRequest: a bad ``speculative`` / ``num_draft_tokens`` / ``speculative_cost``,
            or ``"draft"`` without a ``draft_model``.
    """

    def __init__(self, config: Any, pool: Any, cache: Any, loaded: Any, eos_ids: set[int],
                 context_length: int, append: Callable[..., None]):
        from sgrt.engine.sampling_params import SPECULATIVE_MODES

        if config.speculative not in SPECULATIVE_MODES:
            raise InvalidRequest(f"speculative must be one of {SPECULATIVE_MODES}, got {config.speculative!r}",
                                 field="speculative")
        if isinstance(config.num_draft_tokens, bool) or not isinstance(config.num_draft_tokens, int) \
                or not 1 <= config.num_draft_tokens <= 16:
            raise InvalidRequest(f"num_draft_tokens must be an int in [1, 16], got {config.num_draft_tokens!r}",
                                 field="num_draft_tokens")
        if config.speculative == "draft" and config.draft_model is None:
            raise InvalidRequest("speculative='draft' needs a draft_model", field="draft_model")
        cost = config.speculative_cost
        if cost is None:
            cost = CUDA_COST if loaded.model.device.type == "cuda" else CPU_COST
        if not isinstance(cost, (tuple, list)) or len(cost) != 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x < float("inf") for x in cost):
            raise InvalidRequest(
                f"speculative_cost must be (switch, per_token), two numbers >= 0, got {cost!r}",
                field="speculative_cost",
            )
        self.cost = (float(cost[0]), float(cost[1]))
        self.config = config
        self.pool = pool
        self.cache = cache
        self.vocab_size = loaded.config.vocab_size
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.append = append
        self.drafter: DraftModelDrafter | None = None
        if config.draft_model is not None:
            self.drafter = self._load_drafter(config, loaded)
            self.context_length = min(context_length, self.drafter.context_length)
        self.tokenizer = loaded.tokenizer
        self._longer: dict[int, list[int]] = {}  # token -> ids whose bytes strictly extend it
        self._states: dict[str, SpecState] = {}
        self._pending: dict[str, Draft] = {}

    def _load_drafter(self, config: Any, loaded: Any) -> DraftModelDrafter:
        from sgrt.models import LoadedModel, load_model

        draft = config.draft_model
        if not isinstance(draft, LoadedModel):
            draft = load_model(draft, dtype=loaded.model.dtype, device=loaded.model.device)
        if len(draft.tokenizer) != len(loaded.tokenizer):
            raise InvalidRequest(
                f"draft_model's tokenizer has {len(draft.tokenizer)} tokens, the target's "
                f"{len(loaded.tokenizer)}: a draft model must share the target's tokenizer",
                field="draft_model",
            )
        slots = config.draft_max_total_tokens or config.max_total_tokens + 16 * config.max_running_requests
        return DraftModelDrafter(draft, slots, loaded.config.vocab_size)

    # -- per-request options -----------------------------------------------------------------
    def check_params(self, params: Any) -> None:
        """Refuse what this engine cannot do (``InvalidRequest`` naming the field)."""
        if params.speculative == "draft" and self.drafter is None:
            raise InvalidRequest("speculative='draft' needs an engine started with a draft_model",
                                 field="speculative")

    def mode(self, req: Req) -> str | None:
        return req.params.speculative or self.config.speculative

    def max_draft(self, req: Req) -> int:
        return req.params.num_draft_tokens or self.config.num_draft_tokens

    @staticmethod
    def jump_forward_mode(req: Req) -> str | None:
        """``exact`` / ``text`` / None for a constrained request (text needs no logprobs:
        unverified tokens have none, so a request that asks for logprobs gets exact)."""
        mode = req.params.jump_forward
        if req.grammar is None or mode is None:
            return None
        if mode == "text" and req.params.return_logprob:
            return "exact"
        return mode

    def _room(self, req: Req) -> int:
        """Most tokens that may still be appended after the pending last one."""
        return min(req.params.max_tokens - len(req.output_ids) - 1, self.context_length - req.num_fill)

    # -- hook 1: text jump-forward -----------------------------------------------------------
    def jump_forward_text(self, running: list[Req]) -> None:
        """Append forced tokens, unverified, to decoding requests in text mode. The run never
        ends where a longer token could continue it: at the end of the forced text, its last
        token is dropped when the grammar (before it) allows a token whose bytes strictly
        extend it; a run that terminates the grammar is kept whole."""
        now = time.monotonic()
        for req in list(running):
            if req.finished or self.jump_forward_mode(req) != "text" or not req.output_ids \
                    or req.remaining_prefill != 1:
                continue
            room = min(req.params.max_tokens - len(req.output_ids), self.context_length - req.num_fill)
            full = req.grammar.forced_tokens()
            forced = full[: min(room, self.config.max_jump_forward_tokens)]
            if not forced:
                continue
            grammar = req.grammar
            n = 0
            for t in forced:
                if not grammar.accept_token(t):
                    break
                n += 1
            keep = n
            if 0 < n == len(full) and n < room and not grammar.is_terminated():
                # The run's end: drop its last token if a longer token could continue it.
                grammar.rollback(1)
                if self._extendable(grammar, forced[n - 1]):
                    keep = n - 1
                n -= 1
            if n:
                grammar.rollback(n)
            for t in forced[:keep]:
                req.forced_tokens += 1
                self.append(req, t, 0.0, [], now)
                if req.finished:
                    break

    def _exact_forced_draft(self, grammar: Any) -> list[int]:
        """The draft of exact jump-forward: the forced tokens, or, when the grammar forces more
        bytes than they cover (``compute_ff_tokens`` stops before a token that a longer one
        could extend, such as '":"' before a string value), the tokenizer's encoding of all
        the forced bytes. Verification keeps this exact: where the model prefers another
        token, the draft is cut there and the model's token is taken."""
        forced = grammar.forced_bytes()
        if not forced:  # the common case inside free text: one grammar query, not two
            return []
        tokens = grammar.forced_tokens()
        token_bytes = self.tokenizer.all_token_bytes()  # computed once, cached by the tokenizer
        if len(forced) <= sum(len(token_bytes[t]) for t in tokens):
            return tokens
        try:
            text = forced.decode("utf-8")
        except UnicodeDecodeError:  # ends inside a character: keep the safe tokens
            return tokens
        ids = self.tokenizer.encode(text)
        if b"".join(token_bytes[t] for t in ids) != forced:
            return tokens
        return ids

    def _extendable(self, grammar: Any, token: int) -> bool:
        """Whether the grammar, in its current state, allows a token whose bytes strictly
        extend ``token``'s bytes."""
        longer = self._longer.get(token)
        if longer is None:
            token_bytes = self.tokenizer.all_token_bytes()
            prefix = token_bytes[token]
            longer = [i for i, b in enumerate(token_bytes) if len(b) > len(prefix) and b.startswith(prefix)]
            self._longer[token] = longer
        if not longer:
            return False
        from sgrt.constrained import allocate_token_bitmask

        mask = allocate_token_bitmask(1, self.vocab_size)
        grammar.fill_vocab_mask(mask, 0)
        return any(token_allowed(mask, 0, t) for t in longer if t < self.vocab_size)

    # -- hook 2: drafting --------------------------------------------------------------------
    def prepare(self, rows: list[Row]) -> None:
        """Turn rows that sample this step into verify rows where a draft is worth it."""
        self._pending.clear()
        sampling = [r for r in rows if r.completes_fill and r.req.params.max_tokens > 0]
        # NOTE: exact jump-forward also drafts the first output tokens, verified by the prefill
        # forward itself (e.g. '{"name":"' of a JSON object); speculation waits for one output.
        candidates = [r for r in sampling if not r.draft and self._room(r.req) > 0
                      and (r.req.output_ids or self.jump_forward_mode(r.req) == "exact")]
        if not candidates:
            return
        drafts: list[tuple[Row, Draft]] = []
        speculative: list[tuple[Row, SpecState]] = []
        for row in candidates:
            req = row.req
            if self.jump_forward_mode(req) == "exact":
                forced = self._exact_forced_draft(req.grammar)[: self.config.max_jump_forward_tokens]
                if forced:
                    drafts.append((row, Draft(tokens=forced, num_forced=len(forced))))
                    continue
            if self.mode(req) is None or not req.output_ids:
                continue
            state = self._states.get(req.request_id)
            if state is None:
                state = self._states[req.request_id] = SpecState()
            speculative.append((row, state))
        if not speculative and not drafts:
            return
        # n-gram proposals first (cheap): their match order tells which estimate applies.
        alphas: list[float] = []
        caps: list[int] = []
        proposed: list[tuple[list[int], int]] = []
        for row, state in speculative:
            cap = min(self.max_draft(row.req), self._room(row.req))
            if self.mode(row.req) == "draft":
                tokens, source = [], MODEL_SOURCE
            else:
                tokens, source = state.ngram.propose(row.req.fill_ids, cap)
                cap = len(tokens)
            proposed.append((tokens, source))
            alphas.append(state.alpha(source))
            caps.append(cap)
        fed = sum(r.n for r in rows) + sum(len(d.tokens) for _, d in drafts)
        lengths = plan_draft_lengths(alphas, caps, len(sampling), fed, self.cost)
        model_rows: list[tuple[Row, int]] = []
        for (row, state), k, (tokens, source) in zip(speculative, lengths, proposed):
            if k <= 0:
                state.idle()
            elif self.mode(row.req) == "draft":
                model_rows.append((row, k))
            else:
                drafts.append((row, Draft(tokens=tokens[:k], source=source)))
        if model_rows:
            proposals = self.drafter.propose([r.req for r, _ in model_rows], [k for _, k in model_rows])
            for (row, _), (tokens, probs) in zip(model_rows, proposals):
                if tokens:
                    drafts.append((row, Draft(tokens=tokens, probs=probs, source=MODEL_SOURCE)))
        for row, draft in drafts:
            self._attach(row, draft)

    def _attach(self, row: Row, draft: Draft) -> None:
        """Check ``draft`` against the grammar, allocate its KV slots, extend the row."""
        req = row.req
        draft.tokens = draft.tokens[: self._room(req)]
        params = req.params
        for i, t in enumerate(draft.tokens):
            if t in params.stop_token_ids or (t in self.eos_ids and not params.ignore_eos):
                draft.tokens = draft.tokens[: i + 1]  # nothing after an end token can be kept
                break
        if req.grammar is not None:
            walked = walk_grammar(req.grammar, draft.tokens, self.vocab_size)
            draft.tokens, draft.masks, draft.terminal = walked.tokens, walked.masks, walked.terminal
        k = len(draft.tokens)
        if k == 0:
            return
        draft.num_forced = min(draft.num_forced, k)
        if draft.probs is not None:
            draft.probs = draft.probs[:k]
        if self.pool.num_free < k:
            self.cache.evict(k - self.pool.num_free)
            if self.pool.num_free < k:
                return
        draft.slots = self.pool.alloc(k)
        req.slots.extend(draft.slots)
        row.draft = list(draft.tokens)
        row.n += k
        self._pending[req.request_id] = draft

    # -- hook 3: verification ----------------------------------------------------------------
    def verify_rows(self, pairs: list[tuple[Row, torch.Tensor]]) -> None:
        """Verify each verify row's draft against its logits ``[k + 1, V]`` and append the
        kept tokens."""
        now = time.monotonic()
        for row, logits in pairs:
            req = row.req
            draft = self._pending.pop(req.request_id)
            out = verify(logits, req, draft, self.eos_ids)
            drafted = len(draft.tokens) - draft.num_forced
            if drafted:
                req.spec_drafted += drafted
                accepted = max(out.num_accepted - draft.num_forced, 0)
                state = self._states.get(req.request_id)
                if state is not None:
                    state.update(draft.source, drafted, accepted)
            self._commit(req, draft, out, now)

    def _commit(self, req: Req, draft: Draft, out: VerifyOutput, now: float) -> None:
        """Keep the accepted drafts' KV, free the rejected ones', append the tokens."""
        slots = draft.slots
        m = out.num_accepted
        del req.slots[len(req.slots) - len(slots):]
        self.pool.free(slots[m:])
        pushed = 0
        for i, token in enumerate(out.tokens):
            if i < m:
                # The KV of an accepted draft token is computed: it joins the request's slots
                # just before the token joins its output (they stay the same length).
                req.slots.append(slots[i])
                pushed += 1
                if i < draft.num_forced:
                    req.forced_tokens += 1
                else:
                    req.spec_accepted += 1
            lp = out.logprobs[i] if out.logprobs else 0.0
            top = out.top_logprobs[i] if out.top_logprobs else []
            self.append(req, token, lp, top, now)
            if req.finished:
                break
        self.pool.free(slots[pushed:m])

    # -- hook 4 ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every draft-model KV slot is free or held by exactly one request (``AssertionError``)."""
        if self.drafter is None:
            return
        pool = self.drafter.pool
        held = [s for seq in self.drafter._seqs.values() for s in seq.slots]
        everything = list(pool.free_slot_set()) + held
        assert len(everything) == len(set(everything)) == pool.num_slots, "draft KV slots lost or shared"

    def release(self, req: Req) -> None:
        """Forget a finished request (its draft-model KV is freed)."""
        self._states.pop(req.request_id, None)
        self._pending.pop(req.request_id, None)
        if self.drafter is not None:
            self.drafter.release(req.request_id)
