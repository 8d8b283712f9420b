"""The Engine: request API in front of a background loop that batches, runs and samples.

Callers on any thread or asyncio task ``submit`` requests; the loop thread owns every piece of
mutable state (scheduler, KV pool, radix cache) and talks back only through each request's
:class:`RequestHandle`. One step = schedule a ragged batch, one forward, sample, finish what
finished (DESIGN.md, "The path of one gen").
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from sgrt.engine.handle import RequestHandle
from sgrt.engine.kv_pool import KVPool
from sgrt.engine.metrics import EngineMetrics
from sgrt.engine.model_runner import ModelRunner
from sgrt.engine.openmp import release_caller_pool
from sgrt.engine.outputs import Result, StreamChunk
from sgrt.engine.prefix_cache import NoPrefixCache
from sgrt.engine.radix_cache import RadixCache
from sgrt.engine.request import Req, ReqStatus
from sgrt.engine.sampler import sample, top_logprobs
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.scheduler import Row, Scheduler, SchedulerConfig
from sgrt.engine.speculative import SpecDecoder
from sgrt.errors import CapacityError, ContextLengthExceeded, InvalidRequest

logger = logging.getLogger("sgrt.engine")


@dataclass
class EngineConfig:
    """Engine options (sizes in tokens, times in seconds)."""

    max_total_tokens: int = 16384  # KV pool slots
    enable_radix_cache: bool = True
    max_running_requests: int = 64
    max_prefill_tokens: int = 1024
    chunked_prefill_size: int = 512
    schedule_policy: str = "lpm"
    grammar_backend: str = "llguidance"
    log_interval: float = 0.0  # 0 = no periodic stats log
    compile: bool = False  # torch.compile decode batches (sgrt/engine/compiled_decode.py)
    # Speculative decoding and jump-forward (sgrt/engine/speculative.py): the drafter for
    # requests that set none ("ngram", "draft" or None), the most draft tokens per request and
    # step, the draft model (a spec for load_model or a LoadedModel with the same tokenizer)
    # and its KV pool size (default max_total_tokens + 16 * max_running_requests), the forward
    # cost model (switch, per_token) that sets draft lengths and turns speculation off as the
    # batch grows (None: measured CPU figures, or a CUDA estimate), and the longest forced run
    # one jump-forward takes.
    speculative: str | None = None
    num_draft_tokens: int = 8
    draft_model: Any = None
    draft_max_total_tokens: int | None = None
    speculative_cost: tuple[float, float] | None = None
    max_jump_forward_tokens: int = 16
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """A serving engine for one model on one device.

    Args:
        model: a model spec for :func:`sgrt.models.load_model` (the default model's name, a GGUF
            path or an HF folder) or an already loaded :class:`sgrt.models.LoadedModel`.
        dtype: ``"float32"`` or ``"bfloat16"`` (ignored for a LoadedModel).
        device: ``"cpu"`` or ``"cuda"`` (ignored for a LoadedModel).
        quantization: ``"none"``, ``"int8"`` or ``"int4"`` weight-only linear layers (see
            :mod:`sgrt.models.quant`; ignored for a LoadedModel).
        **options: fields of :class:`EngineConfig`.

    Raises:
        ModelLoadError: the model could not be loaded.
        TypeError: an unknown option.
    """

    def __init__(self, model: Any = "smollm2-135m-instruct", dtype: str = "float32", device: str = "cpu",
                 quantization: str = "none", **options: Any):
        from sgrt.models import LoadedModel, load_model

        self.config = EngineConfig(**options)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=dtype, device=device, quantization=quantization)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        cfg = self.loaded.config
        self.context_length = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.pool = KVPool(
            self.config.max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads,
            cfg.head_dim, self.model.dtype, self.model.device,
        )
        self.cache = RadixCache(self.pool) if self.config.enable_radix_cache else NoPrefixCache(self.pool)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running_requests=self.config.max_running_requests,
                max_prefill_tokens=self.config.max_prefill_tokens,
                chunked_prefill_size=self.config.chunked_prefill_size,
                policy=self.config.schedule_policy,
            ),
            self.pool,
            self.cache,
        )
        self.runner = ModelRunner(self.model, self.pool, compile=self.config.compile)
        self.spec = SpecDecoder(self.config, self.pool, self.cache, self.loaded, set(self.tokenizer.eos_token_ids),
                                self.context_length, self._append_token)
        self.metrics = EngineMetrics()
        self.eos_ids: set[int] = set(self.tokenizer.eos_token_ids)
        self._grammar_compiler = None
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sgrt-grammar")
        self._inbox: queue.Queue = queue.Queue()
        self._reqs: dict[str, Req] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._last_log = time.monotonic()
        if self.model.device.type == "cpu":
            # NOTE: the loop thread runs every forward; the caller's idle OpenMP pool would
            # throttle its workers' spinning (see sgrt/engine/openmp.py).
            release_caller_pool()
        self._thread = threading.Thread(target=self._loop, name="sgrt-engine", daemon=True)
        self._thread.start()

    # ==== public API (any thread) ============================================================
    def submit(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request; return its handle at once.

        Raises:
            InvalidRequest: a bad sampling field (named), an empty prompt.
            ContextLengthExceeded: the prompt does not fit the context window (unless
                ``truncate="left"``).
            CapacityError: prompt plus ``max_tokens`` exceeds the whole KV pool.
        """
        params = self._params(params)
        ids = self._tokenize(prompt)
        ids = self._fit_context(ids, params)
        if len(ids) + params.max_tokens > self.pool.num_slots:
            raise CapacityError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV pool "
                f"({self.pool.num_slots} tokens, max_total_tokens)"
            )
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        handle = RequestHandle(rid, self.abort)
        req = Req(request_id=rid, prompt_ids=ids, params=params)
        req.channel = handle
        if params.logprob_start_len == 0:
            req.prompt_logprobs.append(None)
            if params.top_logprobs_num:
                req.prompt_top_logprobs.append([])
        if params.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        from sgrt.models import IncrementalDetokenizer

        req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.is_constrained():
            req.grammar_future = self._compile_pool.submit(self._compile_grammar, params)
        self._inbox.put(("add", req))
        return handle

    def generate(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> Result:
        """Run one request to completion (blocking)."""
        return self.submit(prompt, params).result()

    def generate_batch(self, prompts: list[str | list[int]], params: SamplingParams | dict | None = None) -> list[Result]:
        """Submit all prompts at once (they batch together) and wait for every result."""
        handles = [self.submit(p, params) for p in prompts]
        return [h.result() for h in handles]

    def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> Iterator[StreamChunk]:
        """Submit and iterate over the request's chunks."""
        return iter(self.submit(prompt, params))

    async def agenerate(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> Result:
        """Async :meth:`generate`."""
        return await self.submit(prompt, params).aresult()

    def abort(self, request_id: str) -> None:
        """Abort a request: it finishes with ``finish_reason="abort"`` and frees its KV slots."""
        self._inbox.put(("abort", request_id))

    def flush_cache(self) -> None:
        """Drop every unlocked radix-cache entry (blocks until done)."""
        done = threading.Event()
        self._inbox.put(("flush", done))
        done.wait()

    def is_alive(self) -> bool:
        """True while the loop thread runs and :meth:`shutdown` has not been called."""
        return not self._stopped and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """Engine-wide metrics: throughput, queue sizes, KV pool usage, cache hit rate."""
        return self.metrics.snapshot(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pool_total=self.pool.num_slots,
            pool_free=self.pool.num_free,
            cache_tokens=self.cache.total_size,
            retracted=self.scheduler.num_retracted,
        )

    def check_integrity(self) -> None:
        """Every KV slot is free, held by a live request, or in the radix cache, exactly once
        (DESIGN.md invariant). Runs on the loop thread; raises ``AssertionError``."""
        result: list[BaseException | None] = []
        done = threading.Event()
        self._inbox.put(("check", (result, done)))
        done.wait()
        if result and result[0] is not None:
            raise result[0]

    def shutdown(self) -> None:
        """Stop the loop thread; pending requests are aborted."""
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ==== request preparation (caller thread) ================================================
    def _params(self, params: SamplingParams | dict | None) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams or dict, got {type(params).__name__}", field="params")
        params.validate(self.vocab_size)
        self.spec.check_params(params)
        return params

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequest(f"prompt token ids must be ints in [0, {self.vocab_size}), got {t!r}", field="prompt")
        else:
            raise InvalidRequest(f"prompt must be str or list[int], got {type(prompt).__name__}", field="prompt")
        if not ids:
            raise InvalidRequest("prompt is empty", field="prompt")
        return ids

    def _fit_context(self, ids: list[int], params: SamplingParams) -> list[int]:
        limit = self.context_length
        if len(ids) + params.max_tokens <= limit:
            return ids
        if params.truncate == "left":
            keep = max(limit - params.max_tokens, 1)
            return ids[-keep:]
        raise ContextLengthExceeded(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"window ({limit} tokens); shorten it or pass truncate='left'",
            field="prompt",
        )

    def _compile_grammar(self, params: SamplingParams):
        if self._grammar_compiler is None:
            from sgrt.constrained import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, backend=self.config.grammar_backend
            )
        return self._grammar_compiler.compile(params)

    # ==== the loop (engine thread) ===========================================================
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            block = not self.scheduler.has_work()
            try:
                if not self._drain_inbox(block):
                    break
                self._step()
                self._maybe_log()
            except Exception as exc:  # a bug must not kill the loop or strand callers
                logger.exception("engine step failed")
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(req, "abort", error=exc)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(req, "abort", error=RuntimeError("engine shut down"))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; return False when asked to stop."""
        while True:
            try:
                if block:
                    # Wake up now and then even when idle, so a stuck compile can't hang us.
                    kind, payload = self._inbox.get(timeout=0.5)
                    block = False
                else:
                    kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if kind == "add":
                self._reqs[payload.request_id] = payload
                self.scheduler.add(payload)
            elif kind == "abort":
                req = self._reqs.get(payload)
                if req is not None:
                    self._finish(req, "abort", error=None)
            elif kind == "flush":
                self.cache.reset()
                payload.set()
            elif kind == "check":
                out, done = payload
                try:
                    self._check_integrity()
                    out.append(None)
                except AssertionError as exc:
                    out.append(exc)
                done.set()
            elif kind == "stop":
                return False

    def _step(self) -> None:
        self._collect_compiled_grammars()
        self.spec.jump_forward_text(self.scheduler.running)
        rows = self.scheduler.schedule()
        self.spec.prepare(rows)  # rows about to sample may become verify rows (drafts)
        if not rows:
            if self.scheduler.waiting and not self.scheduler.running:
                time.sleep(0.002)  # waiting only on grammar compilation
            return
        offsets = [self._logit_offsets(row) for row in rows]
        t0 = time.monotonic()
        logits = self.runner.forward(rows, offsets)
        self.metrics.record_forward(rows, time.monotonic() - t0)
        sample_rows: list[tuple[Row, torch.Tensor]] = []
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
                self._finish(req, "length")
                continue
            sample_rows.append((row, row_logits[n_prompt_lp:]))
        if sample_rows:
            self._sample_and_append(sample_rows)
        for req in cache_after:
            if not req.finished:
                self.scheduler.cache_prefix(req)

    def _logit_offsets(self, row: Row) -> list[int]:
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

    def _record_prompt_logprobs(self, row: Row, row_logits: torch.Tensor) -> int:
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

    def _sample_and_append(self, sample_rows: list[tuple[Row, torch.Tensor]]) -> None:
        verify_rows = [(row, lg) for row, lg in sample_rows if row.draft]
        if verify_rows:
            self.spec.verify_rows(verify_rows)
            sample_rows = [(row, lg) for row, lg in sample_rows if not row.draft]
            if not sample_rows:
                return
        reqs = [row.req for row, _ in sample_rows]
        logits = torch.cat([lg[-1:] for _, lg in sample_rows], dim=0)
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
            self._append_token(req, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], now)

    def _append_token(self, req: Req, token: int, logprob: float, top: list[tuple[int, float]], now: float) -> None:
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
            self._finish(req, "abort", error=RuntimeError(f"grammar rejected token {token} that its mask allowed"))
            return
        new_text = req.detokenizer.add([token])
        old_len = len(req.text)
        req.text += new_text
        accepting = req.grammar is None or req.grammar.is_accepting()
        min_reached = len(req.output_ids) >= params.min_tokens
        if min_reached and accepting:
            if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
                self._finish(req, "stop", matched=token)
                return
            if params.stop:
                hit = _find_stop(req.text, params.stop, old_len)
                if hit is not None:
                    idx, s = hit
                    req.text = req.text[:idx]
                    self._finish(req, "stop", matched=s)
                    return
        if req.grammar is not None and req.grammar.is_terminated():
            self._finish(req, "stop", matched="grammar")
            return
        if len(req.output_ids) >= params.max_tokens or req.num_fill >= self.context_length:
            req.incomplete = req.grammar is not None and not req.grammar.is_accepting()
            self._finish(req, "length")
            return
        self._stream(req, final=False)

    def _next_chunk(self, req: Req, final: bool) -> StreamChunk:
        """The text and tokens not yet sent. Unless ``final``, hold back the last characters
        that could still become a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in req.params.stop), default=0)
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

    def _finish(self, req: Req, reason: str, matched: int | str | None = None, error: BaseException | None = None) -> None:
        if req.finished:
            return
        self.scheduler.finish(req)
        self.spec.release(req)
        self._reqs.pop(req.request_id, None)
        req.finish_reason = reason
        req.matched = matched
        req.error = error
        if reason != "stop" or not isinstance(matched, str) or matched == "grammar":
            req.text += req.detokenizer.flush()
        chunk = self._next_chunk(req, final=True)
        result = req.to_result(req.text)
        self.metrics.record_finish(result)
        chunk.finished = True
        chunk.result = result
        if error is not None and req.first_token_time is None and isinstance(error, InvalidRequest):
            req.channel.fail(error, result)
        else:
            req.channel.push(chunk)

    def _collect_compiled_grammars(self) -> None:
        for req in list(self.scheduler.waiting):
            fut = req.grammar_future
            if fut is None or not fut.done() or req.grammar is not None:
                continue
            exc = fut.exception()
            if exc is not None:
                self._finish(req, "abort", error=exc)
                continue
            req.grammar = fut.result()
            if req.grammar is not None:
                req.warnings.extend(getattr(req.grammar, "warnings", []))
                # Re-feed output kept across a retraction so the grammar state matches.
                for t in req.output_ids:
                    req.grammar.accept_token(t)

    def _check_integrity(self) -> None:
        self.cache.check_integrity()
        free = self.pool.free_slot_set()
        assert len(free) == self.pool.num_free, "a slot is on the free list twice"
        owned: list[int] = []
        for req in self.scheduler.running:
            owned.extend(req.slots[req.cached_len:])
        tree = self.cache.all_slots()
        everything = list(free) + owned + tree
        assert len(everything) == len(set(everything)), "a KV slot is in two places"
        assert len(everything) == self.pool.num_slots, (
            f"{self.pool.num_slots - len(everything)} KV slots are lost"
        )
        self.spec.check_integrity()

    def _maybe_log(self) -> None:
        interval = self.config.log_interval
        if interval and time.monotonic() - self._last_log >= interval:
            self._last_log = time.monotonic()
            logger.info("stats %s", self.stats())


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the new part of ``text`` (found across token
    boundaries); returns (index, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, old_len - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
