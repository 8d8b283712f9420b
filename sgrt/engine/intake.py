"""Intake: a request's way in, from the caller's arguments to a queued :class:`Req`.

On the caller's thread (``Engine.submit``), :meth:`Intake.make_request` checks the sampling
parameters, tokenizes the prompt, fits it to the context window (``truncate="left"`` keeps its
end), checks it against the KV pool, builds the ``Req`` with its handle, detokenizer and seeded
generator, and hands a constrained request's grammar to a compile worker. On the loop thread,
:meth:`Intake.collect_grammars` attaches finished compilations to their waiting requests (the
scheduler admits a constrained request only once its grammar is there) and returns the
requests whose compilation failed, for the output processor to finish.
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from sgrt.engine.handle import RequestHandle
from sgrt.engine.request import Req
from sgrt.engine.sampling_params import SamplingParams, check_speculative
from sgrt.engine.stop_matcher import StopMatcher
from sgrt.errors import CapacityError, ContextLengthExceeded, InvalidRequest


class Intake:
    """Turns ``submit`` arguments into requests, and compiles their grammars.

    Args:
        tokenizer: the model's ``sgrt.models.Tokenizer``.
        vocab_size: the model's logits width (token ids must be below it).
        context_length: the model's context window, in tokens.
        pool_slots: KV pool size, in tokens (prompt + ``max_tokens`` must fit it).
        device: where a seeded request's ``torch.Generator`` lives.
        grammar_backend: the default grammar backend (``EngineConfig.grammar_backend``).
        has_draft_model: whether the engine has a draft model (``speculative="draft"``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, context_length: int, pool_slots: int,
                 device: torch.device, grammar_backend: str, has_draft_model: bool,
                 grammar_limits: Any = None, grammar_compile_timeout_s: float = 10.0,
                 compile_times: Any = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.pool_slots = pool_slots
        self.device = device
        self.grammar_backend = grammar_backend
        self.has_draft_model = has_draft_model
        self.grammar_limits = grammar_limits
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.compile_times = compile_times  # a metrics Histogram of compile seconds, or None
        self._ids = itertools.count()
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sgrt-grammar")

    # -- caller thread -----------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | dict | None,
                     request_id: str | None, abort: Callable[[str], None]) -> Req:
        """A checked request whose ``channel`` is its :class:`RequestHandle` (``abort`` is what
        the handle calls to cancel it); a constrained one has its grammar compiling.

        Raises:
            InvalidRequest: a bad sampling field (named), an empty prompt, a token id out of
                the vocabulary.
            ContextLengthExceeded: the prompt does not fit the context window (unless
                ``truncate="left"``).
            CapacityError: prompt plus ``max_tokens`` exceeds the whole KV pool.
        """
        params = self.check_params(params)
        ids = self.fit_context(self.tokenize(prompt), params)
        if len(ids) + params.max_tokens > self.pool_slots:
            raise CapacityError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV pool "
                f"({self.pool_slots} tokens, max_total_tokens)"
            )
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Req(request_id=rid, prompt_ids=ids, params=params)
        req.channel = RequestHandle(rid, abort)
        if params.logprob_start_len == 0:
            # The first prompt token has no logits before it.
            req.prompt_logprobs.append(None)
            if params.top_logprobs_num:
                req.prompt_top_logprobs.append([])
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        from sgrt.models import IncrementalDetokenizer

        req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.stop:
            # NOTE: built here, on the caller's thread: the engine loop only steps it.
            req.stop_matcher = StopMatcher(params.stop)
        if params.is_constrained():
            req.grammar_future = self._compile_pool.submit(self.compile_grammar, params)
        return req

    def check_params(self, params: SamplingParams | dict | None) -> SamplingParams:
        """``params`` as a :class:`SamplingParams` (None: the defaults; a dict is built, so
        checked, here), plus the checks that need this engine: ``stop_token_ids`` inside the
        vocabulary, ``speculative="draft"`` with a draft model, no ``stop_regex``. A
        ``SamplingParams`` was checked when it was built and is not checked again.

        Raises:
            InvalidRequest: a bad field (named), a stop token id past the vocabulary,
                ``speculative="draft"`` on an engine without a draft model, or a
                ``stop_regex`` (the DSL's backends apply it; the engine has no such stop).
        """
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams or dict, got {type(params).__name__}", field="params")
        params.check_vocab(self.vocab_size)
        check_speculative(params.speculative, None, has_draft_model=self.has_draft_model)
        if params.stop_regex:
            raise InvalidRequest("stop_regex is applied by the DSL's backends (sgrt.backends), not by the "
                                 "engine: use stop or stop_token_ids", field="stop_regex")
        return params

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt, or a checked copy of a token-id prompt.

        Raises:
            InvalidRequest: (field ``prompt``) neither str nor list of ints, a str with a lone
                surrogate (not UTF-8 encodable), an id outside ``[0, vocab_size)``, or empty.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt)  # BOS where the model's tokenizer adds one
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

    def fit_context(self, ids: list[int], params: SamplingParams) -> list[int]:
        """``ids`` if prompt + ``max_tokens`` fit the context window; with ``truncate="left"``
        its last ``context_length - max_tokens`` tokens (at least one).

        Raises:
            ContextLengthExceeded: (field ``prompt``) it does not fit and may not be cut.
        """
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

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params``' constraint (the compiler caches it, so a request
        with the same constraint finds it compiled). Runs on a compile worker for requests; the
        CLI calls it first to show its own progress. The compiler is built once, on first use:
        building its vocabulary costs seconds, which an engine that never sees a constraint
        should not pay.

        Raises:
            GrammarError: the constraint does not compile (naming the field and the limit).
        """
        t0 = time.perf_counter()
        try:
            with self._compiler_lock:
                if self._compiler is None:
                    from sgrt.constrained import GrammarCompiler

                    self._compiler = GrammarCompiler(
                        self.tokenizer, self.vocab_size, backend=self.grammar_backend,
                        compile_timeout_s=self.grammar_compile_timeout_s, limits=self.grammar_limits)
            return self._compiler.compile(params)
        finally:
            if self.compile_times is not None:
                self.compile_times.observe(time.perf_counter() - t0)

    # -- loop thread -------------------------------------------------------------------------
    def collect_grammars(self, waiting: list[Req]) -> list[tuple[Req, BaseException]]:
        """Attach compiled grammars to the ``waiting`` requests whose compilation finished;
        return ``(request, error)`` for those whose compilation failed (still waiting: the
        caller finishes them)."""
        failed: list[tuple[Req, BaseException]] = []
        for req in waiting:
            fut = req.grammar_future
            if fut is None or not fut.done() or req.grammar is not None:
                continue
            exc = fut.exception()
            if exc is not None:
                failed.append((req, exc))
                continue
            req.grammar = fut.result()
            if req.grammar is not None:
                req.warnings.extend(getattr(req.grammar, "warnings", []))
                # Re-feed output kept across a retraction so the grammar state matches.
                for t in req.output_ids:
                    req.grammar.accept_token(t)
        return failed

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the compile workers: queued compilations are cancelled, and the ones in flight
        waited for, at most ``timeout`` seconds (a native compile cannot be interrupted; one
        killed mid-call at interpreter finalization aborts the process)."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.wait_idle(timeout)
