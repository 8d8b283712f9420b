"""The Engine: request API in front of a background loop that batches, runs and samples.

Callers on any thread or asyncio task ``submit`` requests: :class:`sgrt.engine.intake.Intake`
checks and tokenizes them there, and the loop thread takes them from the inbox. The loop thread
alone runs :meth:`Engine.step` and touches the requests, the scheduler (which owns the KV pool's
slots and the prefix cache), the speculative planner and the output processor; callers hear
back only through each request's :class:`RequestHandle`. One step reads as its stages: intake,
schedule, plan drafts, forward, process outputs (DESIGN.md, "The path of one gen").
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from sgrt.engine.client import EngineInfo
from sgrt.engine.handle import RequestHandle
from sgrt.engine.intake import Intake
from sgrt.engine.kv_pool import KV_CACHE_DTYPES, KVPool, default_pool_tokens, kv_bytes_per_token
from sgrt.engine.metrics import EngineMetrics
from sgrt.engine.model_runner import ModelRunner
from sgrt.engine.openmp import release_caller_pool
from sgrt.engine.output_processor import OutputProcessor
from sgrt.engine.outputs import Result, StreamChunk
from sgrt.engine.prefix_cache import NoPrefixCache, PrefixCache
from sgrt.engine.radix_cache import RadixCache
from sgrt.engine.request import Req
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.scheduler import Row, Scheduler, SchedulerConfig
from sgrt.engine.speculative import SpecConfig, SpecPlanner
from sgrt.engine.threads import ThreadGovernor, decode_work, extend_work, kind_of, kv_weight, pair_weight
from sgrt.errors import GrammarError, InvalidRequest

logger = logging.getLogger("sgrt.engine")

# Engines not yet shut down. At interpreter exit a daemon loop thread still inside a torch op
# (which releases the GIL) is killed by pthread_exit when it takes the GIL back, and the unwind
# through a C++ destructor aborts the process (SIGABRT, "terminate called without an active
# exception"; pytorch/pytorch#38228). So every live engine is stopped and joined at exit,
# before finalization, and the user's exit status stands.
_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


# The heap that exists when an engine starts (the loaded model's modules and tensors, the
# tokenizer, ~340,000 tracked objects for the default model) is frozen out of the cyclic GC
# (gc.freeze) while any engine is live: a collection of the oldest generation walks every
# tracked object with the GIL held, so every thread (the loop thread's step included) waits,
# and one can start whenever any thread allocates (a server's bookkeeping). Measured on the
# 2-core machine with the default model loaded: gc.collect() 1.6-1.9 s (machine loaded) before
# the freeze, ~0 after; the young collections of a server-like allocation loop beside a decode
# up to 18 ms, 0.2 ms frozen. Objects frozen stay alive until unfrozen even if they become
# cyclic garbage, so the last engine to shut down unfreezes (unless the process had frozen
# objects of its own before, whose policy then stands).
_GC_LOCK = threading.Lock()
_GC_FROZEN_BY_US = False


def _freeze_heap() -> None:
    global _GC_FROZEN_BY_US
    with _GC_LOCK:
        if gc.get_freeze_count() == 0:
            _GC_FROZEN_BY_US = True
        gc.freeze()


def _unfreeze_heap_if_last() -> None:
    global _GC_FROZEN_BY_US
    with _GC_LOCK:
        if _GC_FROZEN_BY_US and not _LIVE_ENGINES:
            gc.unfreeze()
            _GC_FROZEN_BY_US = False


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        try:
            engine.shutdown()
        except Exception:  # exit must go on even if one engine is broken
            logger.exception("engine shutdown at exit failed")


@dataclass
class EngineConfig:
    """Engine options, validated when built (sizes in tokens, times in seconds).

    ``Engine(**options)`` and ``sgrt.Runtime(**options)`` take every option by its flat name
    (:meth:`from_options`); the scheduler's and the speculative planner's options live in their
    own configs, which are fields here and go to those components as they are.

    Attributes:
        max_total_tokens: KV pool slots (>= 1); None (the default) sizes the pool from memory:
            4 GiB of K/V or a quarter of the memory available at start, whichever is less, at
            the model's bytes a token (:func:`sgrt.engine.kv_pool.default_pool_tokens`; its pages
            are made as they are used: ``zeros_on_demand``).
        kv_cache_dtype: the KV pool's dtype: ``"auto"`` (the model's activation dtype) or
            ``"int8"`` (int8 K/V with a float32 scale per token and kv head: about half the bytes
            a token, so about twice the tokens in the same memory; opt-in, for long contexts;
            :mod:`sgrt.engine.kv_pool`). Not with ``compile``.
        enable_radix_cache: share prefixes through the radix cache (False: a cache that keeps
            nothing, :class:`sgrt.engine.prefix_cache.NoPrefixCache`).
        grammar_backend: the default grammar backend, ``"llguidance"`` or ``"outlines"``.
        log_interval: seconds between stats log lines (0: none).
        compile: ``torch.compile`` decode batches (:mod:`sgrt.engine.compiled_decode`).
        adaptive_threads: choose each forward's thread count by its measured time (up to torch's
            threads; fewer while other processes take the cores: :mod:`sgrt.engine.threads`).
            False keeps torch's thread count.
        scheduler: ``max_running_requests``, ``max_prefill_tokens``, ``chunked_prefill_size``,
            ``schedule_policy`` (:class:`sgrt.engine.scheduler.SchedulerConfig`).
        spec: ``speculative``, ``num_draft_tokens``, ``draft_model``,
            ``draft_max_total_tokens``, ``speculative_cost``, ``max_jump_forward_tokens``
            (:class:`sgrt.engine.speculative.SpecConfig`).

    Raises:
        InvalidRequest: an option out of its range (named); ``GrammarError`` for an unknown
            ``grammar_backend``.
    """

    max_total_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    enable_radix_cache: bool = True
    grammar_backend: str = "llguidance"
    # Grammar compile limits (sgrt.constrained.limits.GrammarLimits or a dict of its fields;
    # None = its defaults) and how long one compilation may take.
    grammar_limits: Any = None
    grammar_compile_timeout_s: float = 10.0
    log_interval: float = 0.0
    compile: bool = False
    adaptive_threads: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        from sgrt.constrained.options import BACKENDS

        if self.max_total_tokens is not None and (
                isinstance(self.max_total_tokens, bool) or not isinstance(self.max_total_tokens, int)
                or self.max_total_tokens < 1):
            raise InvalidRequest(f"max_total_tokens must be an int >= 1 or None (from memory), got "
                                 f"{self.max_total_tokens!r}", field="max_total_tokens")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                 f"{self.kv_cache_dtype!r}", field="kv_cache_dtype")
        if self.kv_cache_dtype != "auto" and self.compile:
            raise InvalidRequest(f"kv_cache_dtype={self.kv_cache_dtype!r} does not run with compile=True (the "
                                 "compiled decode reads the pool in the model's dtype)", field="kv_cache_dtype")
        if self.grammar_backend not in BACKENDS:
            raise GrammarError(f"grammar_backend must be one of {BACKENDS}, got {self.grammar_backend!r}",
                               field="grammar_backend")
        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, (int, float)) \
                or not 0 <= self.log_interval < float("inf"):
            raise InvalidRequest(f"log_interval must be a number of seconds >= 0, got {self.log_interval!r}",
                                 field="log_interval")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """The config of flat options (``max_running_requests=8, speculative="ngram"``, ...),
        each routed to the config that declares it.

        Raises:
            TypeError: an unknown option.
            InvalidRequest: an option out of its range (named).
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"scheduler", "spec"}
        groups: dict[str, dict[str, Any]] = {"scheduler": {}, "spec": {}, "own": {}}
        sub_fields = {
            "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
            "spec": {f.name for f in dataclasses.fields(SpecConfig)},
        }
        for name, value in options.items():
            if name in own:
                groups["own"][name] = value
            elif name in sub_fields["scheduler"]:
                groups["scheduler"][name] = value
            elif name in sub_fields["spec"]:
                groups["spec"][name] = value
            else:
                raise TypeError(f"unknown engine option {name!r}")
        return cls(scheduler=SchedulerConfig(**groups["scheduler"]), spec=SpecConfig(**groups["spec"]),
                   **groups["own"])


class Engine:
    """A serving engine for one model on one device.

    Args:
        model: a model spec for :func:`sgrt.models.load_model` (the default model's name, a GGUF
            path or an HF folder) or an already loaded :class:`sgrt.models.LoadedModel`.
        dtype: ``"float32"`` or ``"bfloat16"`` (ignored for a LoadedModel).
        device: ``"cpu"`` or ``"cuda"`` (ignored for a LoadedModel).
        quantization: ``"none"``, ``"int8"`` or ``"int4"`` weight-only linear layers (see
            :mod:`sgrt.models.quant`; ignored for a LoadedModel).
        int4_activations: with ``quantization="int4"`` on the AVX2 kernel, the int4 projections'
            activations: ``"int16"`` (default), ``"int8"`` (llama.cpp's Q8 blocks: faster prefill,
            less accurate) or ``"int8-prefill"`` (int8 for calls of >= 32 rows only: prefill and
            extend chunks; decode keeps 16 bits); see :func:`sgrt.models.load_model` (ignored for
            a LoadedModel).
        **options: the options of :class:`EngineConfig`, by their flat names.

    Raises:
        ModelLoadError: the model could not be loaded.
        TypeError: an unknown option.
        InvalidRequest: an option out of its range (named, before the model loads).
    """

    def __init__(self, model: Any = "smollm2-135m-instruct", dtype: str = "float32", device: str = "cpu",
                 quantization: str = "none", int4_activations: str = "int16", **options: Any):
        from sgrt.models import LoadedModel, load_model

        self.config = config = EngineConfig.from_options(**options)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=dtype, device=device, quantization=quantization, int4_activations=int4_activations)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        cfg = self.loaded.config
        self.context_length = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.eos_ids: set[int] = set(self.tokenizer.eos_token_ids)
        slots = config.max_total_tokens or default_pool_tokens(kv_bytes_per_token(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.model.dtype, config.kv_cache_dtype))
        self.pool = KVPool(
            slots, cfg.num_hidden_layers, cfg.num_key_value_heads,
            cfg.head_dim, self.model.dtype, self.model.device, kv_cache_dtype=config.kv_cache_dtype,
        )
        self.cache: PrefixCache = RadixCache(self.pool) if config.enable_radix_cache else NoPrefixCache(self.pool)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.cache)
        self.runner = ModelRunner(self.model, self.pool, compile=config.compile)
        draft_slots = config.spec.draft_max_total_tokens or (
            slots + 16 * config.scheduler.max_running_requests)
        self.spec = SpecPlanner(config.spec, self.scheduler, self.loaded, self.eos_ids, self.context_length,
                                draft_slots)
        self.metrics = EngineMetrics()
        self.intake = Intake(self.tokenizer, self.vocab_size, self.context_length, self.pool.num_slots,
                             self.model.device, config.grammar_backend, self.spec.drafter is not None,
                             config.grammar_limits, config.grammar_compile_timeout_s,
                             compile_times=self.metrics.grammar_compile)
        self.outputs = OutputProcessor(self.scheduler, self.spec, self.metrics, self.eos_ids, self.context_length)
        self._inbox: queue.Queue = queue.Queue()
        self._reqs: dict[str, Req] = {}
        self._stopped = False
        self._last_log = time.monotonic()
        self._cpu = self.model.device.type == "cpu"
        if self._cpu:
            # NOTE: the loop thread runs every forward; the caller's idle OpenMP pool would
            # throttle its workers' spinning (see sgrt/engine/openmp.py).
            release_caller_pool()
        # (threads per forward: all torch's while the process has its cores, fewer under other load)
        self.threads = ThreadGovernor(torch.get_num_threads(), adaptive=config.adaptive_threads and self._cpu)
        self._threads_now = self.threads.max_threads
        self._pair_weight = pair_weight(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                        cfg.head_dim, cfg.intermediate_size)
        self._kv_weight = kv_weight(self.pool.bytes_per_token(), self.loaded.nbytes)
        self._thread = threading.Thread(target=self._loop, name="sgrt-engine", daemon=True)
        logger.info("engine: %s", self.describe())
        _LIVE_ENGINES.add(self)
        _freeze_heap()
        self._thread.start()

    # ==== public API (any thread) ============================================================
    @functools.cached_property
    def info(self) -> EngineInfo:
        """The served model and this engine's limits (:class:`~sgrt.engine.client.EngineInfo`),
        the one view of them that servers read."""
        loaded, cfg = self.loaded, self.loaded.config
        path = str(loaded.path or "")
        # NOTE: the id reported when the operator names none: the spec it resolved to, else the
        # store's name (what the HTTP server always reported).
        name = str(loaded.source or "") or path.rstrip("/").rsplit("/", 1)[-1]
        return EngineInfo(
            model_name=name or "sgrt-model", context_length=self.context_length, vocab_size=self.vocab_size,
            max_total_tokens=self.pool.num_slots, tokenizer=self.tokenizer,
            max_running_requests=self.config.scheduler.max_running_requests, model_path=path,
            tokenizer_path=str(loaded.tokenizer_path or path), source=str(loaded.source or ""),
            model_type=getattr(cfg, "model_type", None),
            architectures=tuple(a for a in [getattr(cfg, "architecture", None)] if a),
            dtype=str(self.model.dtype).replace("torch.", ""), device=str(self.model.device))

    def describe(self) -> str:
        """What runs: the model's dtype, quantization and weight bytes (:meth:`sgrt.models.
        LoadedModel.describe`), the KV pool's tokens, dtype and bytes (a token's and the whole
        pool's), the context length and the threads a step uses."""
        pool = self.pool
        return (f"{self.loaded.describe()}; KV pool {pool.num_slots} tokens of {pool.describe()} K/V, "
                f"{pool.bytes_per_token()} bytes a token, {pool.total_bytes() / 1e9:.2f} GB; "
                f"context {self.context_length}; {self.threads.max_threads} threads"
                + (" (fewer while other work takes the cores)" if self.threads.adaptive else ""))

    def submit(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request; return its handle at once.

        Raises:
            InvalidRequest: a bad sampling field (named), an empty prompt.
            ContextLengthExceeded: the prompt does not fit the context window (unless
                ``truncate="left"``).
            CapacityError: prompt plus ``max_tokens`` exceeds the whole KV pool.
        """
        req = self.intake.make_request(prompt, params, request_id, self.abort)
        if self._cpu and threading.current_thread() is not self._thread:
            # NOTE: torch work this thread did since the engine started (a tensor op with 2+
            # threads) left it an idle OpenMP pool again, which throttles the loop thread's
            # workers (sgrt/engine/openmp.py); ~1 us when it holds none.
            release_caller_pool()
        self._inbox.put(("add", req))
        return req.channel

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

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint now, on the calling thread, so that a request with the
        same constraint finds it compiled (the compiler caches it). A request compiles its own
        constraint on a worker anyway; this is for a caller that shows its own progress (the
        CLI's "compiling the constraint").

        Raises:
            GrammarError: the constraint does not compile (naming the field and the limit).
        """
        if params.is_constrained():
            self.intake.compile_grammar(params)

    def abort(self, request_id: str) -> None:
        """Abort a request: it finishes with ``finish_reason="abort"`` and frees its KV slots."""
        self._inbox.put(("abort", request_id))

    def flush_cache(self) -> None:
        """Drop every unlocked prefix-cache entry (blocks until done)."""
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
        """Every KV slot is free, held by a live request, or in the prefix cache, exactly once,
        and so is every draft-model KV slot (DESIGN.md invariant). Runs on the loop thread;
        raises ``AssertionError``."""
        result: list[BaseException | None] = []
        done = threading.Event()
        self._inbox.put(("check", (result, done)))
        done.wait()
        if result and result[0] is not None:
            raise result[0]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread (after the step in progress) and wait for it, then for the
        grammar compilations in flight; pending requests are aborted. Idempotent; also run for
        every live engine at interpreter exit. ``timeout``: seconds to wait for each."""
        if self._stopped:
            return
        self._stopped = True
        _LIVE_ENGINES.discard(self)
        self._inbox.put(("stop", None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        self.intake.shutdown(timeout)
        _unfreeze_heap_if_last()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ==== the loop (engine thread) ===========================================================
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        torch.set_num_threads(self._threads_now)
        while True:
            block = not self.scheduler.has_work()
            if block and self._cpu:
                # NOTE: an idle engine gives its OpenMP pool back, so that it does not throttle
                # another engine's loop thread, or the caller's own torch work, in this process
                # (sgrt/engine/openmp.py); the next request's first op builds a new one. ~1 us
                # when it holds none (every 0.5 s while idle).
                release_caller_pool()
            try:
                if not self._drain_inbox(block):
                    break
                self.step()
                self._maybe_log()
            except Exception as exc:  # a bug must not kill the loop or strand callers
                logger.exception("engine step failed")
                self._finish_all(exc)
        self._finish_all(RuntimeError("engine shut down"))

    def step(self) -> None:
        """One engine iteration, on the loop thread only: intake -> schedule -> plan drafts ->
        forward -> process outputs (DESIGN.md, "The path of one gen")."""
        self._take_in()  # intake: compiled grammars join their requests; failed ones finish
        self.outputs.append_forced(self.spec.plan_text_jumps(self.scheduler.running))  # text jump-forward
        rows = self.scheduler.schedule()  # schedule: rows of one ragged batch, KV slots allocated
        if not rows:
            return self._idle()
        drafts = self.spec.plan(rows)  # plan drafts: some rows become verify rows
        logits = self._forward(rows)  # forward
        self.outputs.process(rows, logits, drafts)  # process outputs: sample / verify, append, finish
        self._retire()

    def _take_in(self) -> None:
        for req, error in self.intake.collect_grammars(self.scheduler.waiting):
            self.outputs.finish(req, "abort", error=error)

    def _forward(self, rows: list[Row]) -> list[torch.Tensor]:
        offsets = [self.outputs.logit_offsets(row) for row in rows]
        kind = kind_of(len(rows) if all(r.n == 1 for r in rows) else None, sum(r.n for r in rows))
        if kind[0] == "prefill":
            work = extend_work([(r.start, r.n) for r in rows], self._pair_weight)
        elif kind[0] == "decode":
            work = decode_work([r.start + 1 for r in rows], self._kv_weight)
        else:
            work = 1.0
        threads = self.threads.choose(kind)
        if threads != self._threads_now:  # (the loop thread's own OpenMP team size; ~1 us)
            torch.set_num_threads(threads)
            self._threads_now = threads
        t0 = time.monotonic()
        logits = self.runner.forward(rows, offsets)
        seconds = time.monotonic() - t0
        self.threads.record(kind, threads, seconds, work)
        self.metrics.record_forward(rows, seconds)
        return logits

    def _idle(self) -> None:
        self._retire()
        if self.scheduler.waiting and not self.scheduler.running:
            time.sleep(0.002)  # waiting only on grammar compilation

    def _retire(self) -> None:
        """Forget the requests finished since the last call (abort lookups, planner state)."""
        for req in self.outputs.take_finished():
            self._reqs.pop(req.request_id, None)
            self.spec.forget(req)

    def _finish_all(self, error: BaseException) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.outputs.finish(req, "abort", error=error)
        self._retire()

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
                    self.outputs.finish(req, "abort", error=None)
                    self._retire()
            elif kind == "flush":
                self.scheduler.flush_cache()
                payload.set()
            elif kind == "check":
                out, done = payload
                try:
                    self.scheduler.check_integrity()
                    self.spec.check_integrity()
                    out.append(None)
                except AssertionError as exc:
                    out.append(exc)
                done.set()
            elif kind == "stop":
                return False

    def _maybe_log(self) -> None:
        interval = self.config.log_interval
        if interval and time.monotonic() - self._last_log >= interval:
            self._last_log = time.monotonic()
            logger.info("stats %s", self.stats())

