"""GrammarCompiler: SamplingParams constraint -> per-request Grammar, through an LRU cache.

Compilation is keyed by (backend, kind, spec, options); each key compiles once (concurrent
requests for the same key wait for the one in flight), results and errors are cached, and every
request gets a fresh copy. Before anything is compiled, the constraint must meet the
:class:`~sgrt.constrained.limits.GrammarLimits` (sizes, depths, ``$ref`` chains, rules, regex
repetition), checked in Python by the caller's thread. Each compile then runs on its own thread
with a large stack (``compile_stack_mb``; llguidance's compiler recurses ~3-9 KB of native stack
per level, see DESIGN.md "Grammar compile limits and isolation"), and the caller waits at most
``compile_timeout_s``: both backends release the GIL while compiling, so a slow grammar never
stalls the engine's loop, and llguidance's own parser limits (set from the same object) and the
outlines backend's killable worker process bound the work itself. A JSON Schema with no finite
instance is refused here too (:mod:`~sgrt.constrained.satisfiable`).
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from sgrt.constrained import limits as _limits
from sgrt.constrained.grammar import CompiledGrammar, Grammar
from sgrt.constrained.lark_files import GRAMMARS_DIR, grammar_files, load_grammar_text  # noqa: F401 - re-exported
from sgrt.constrained.limits import GrammarLimits
from sgrt.constrained.options import BACKENDS, GrammarOptions
from sgrt.constrained.patterns import ends_with_lone_backslash
from sgrt.constrained.schema import load_schema, normalize_loaded
from sgrt.constrained.vocab import Vocab, build_vocab
from sgrt.errors import GrammarError


class GrammarCompiler:
    """Compiles the constraint of a ``SamplingParams`` into a per-request :class:`Grammar`.

    Args:
        tokenizer: ``sgrt.models.Tokenizer`` or anything with ``.hf``, ``eos_token_ids`` and
            ``all_token_bytes()`` (a bare transformers fast tokenizer also works).
        vocab_size: the model's logits width; masks are ``[batch, ceil(vocab_size / 32)]``.
            Ids past the tokenizer are always forbidden.
        backend: default backend, ``"llguidance"`` (regex, JSON Schema, Lark) or ``"outlines"``
            (regex, JSON Schema); a request's ``grammar_backend`` overrides it.
        options: JSON generation options (:class:`GrammarOptions`); defaults apply if None.
        compile_timeout_s: how long :meth:`compile` waits for one compilation (seconds).
        cache_size: how many compiled constraints (and compile errors) to keep, LRU.
        limits: input limits and llguidance's parser limits (:class:`GrammarLimits`, or a dict
            of its fields); defaults if None.

    Thread-safe: the engine calls :meth:`compile` from a thread pool.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend: str = "llguidance",
        options: GrammarOptions | None = None,
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        limits: GrammarLimits | dict | None = None,
    ):
        if backend not in BACKENDS:
            raise GrammarError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}", field="grammar_backend")
        self.vocab: Vocab = build_vocab(tokenizer, vocab_size)
        self.backend = backend
        self.options = options or GrammarOptions()
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.limits = limits if isinstance(limits, GrammarLimits) else GrammarLimits.from_dict(limits)
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self.stats = {"hits": 0, "misses": 0, "errors": 0, "timeouts": 0}

    # ---- public ---------------------------------------------------------------------------

    def compile(self, params: Any) -> Grammar | None:
        """A fresh Grammar for ``params``' constraint (``regex``, ``json_schema`` or ``grammar``),
        or None if it has none.

        Raises:
            GrammarError: the constraint is invalid or unsupported (naming the keyword and its
                JSON pointer for schemas), the backend name is unknown, or compilation took
                longer than ``compile_timeout_s``.
        """
        kind, spec = _constraint_of(params)
        if kind is None:
            return None
        backend = getattr(params, "grammar_backend", None) or self.backend
        if backend not in BACKENDS:
            raise GrammarError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}", field="grammar_backend")
        compiled = self.compile_spec(kind, spec, backend)
        return compiled.new_grammar()

    def compile_spec(self, kind: str, spec: Any, backend: str | None = None,
                     options: GrammarOptions | None = None) -> CompiledGrammar:
        """The cached compiled form of one constraint (``kind``: "regex", "json_schema",
        "grammar"). Raises GrammarError like :meth:`compile`."""
        backend = backend or self.backend
        options = options or self.options
        lim = self.limits
        if kind == "json_schema":
            _limits.check_schema_spec(spec, lim)  # before parsing or copying: both recurse
            loaded = load_schema(spec)
            _limits.check_schema(loaded, lim, spec_checked=True)
            # repr, not JSON: it tells Decimal("0.1") (a number) from "0.1" (a string)
            key_spec = repr(loaded)
            job = lambda: self._compile_json(backend, loaded, options)  # noqa: E731
        elif kind == "regex":
            if not isinstance(spec, str):
                raise GrammarError("regex must be a str", field="regex")
            if ends_with_lone_backslash(spec):
                raise GrammarError("regex ends with a lone backslash, which escapes nothing", field="regex")
            _limits.check_regex(spec, lim)
            key_spec = spec
            job = lambda: self._get_backend(backend).compile_regex(spec)  # noqa: E731
        elif kind == "grammar":
            if not isinstance(spec, str):
                raise GrammarError("grammar must be a str", field="grammar")
            text = load_grammar_text(spec)
            _limits.check_lark(text, lim)
            key_spec = text
            job = lambda: self._get_backend(backend).compile_lark(text)  # noqa: E731
        else:
            raise GrammarError(f"unknown constraint kind {kind!r}")
        key = (backend, kind, key_spec, options if kind == "json_schema" else None)
        return self._cached(key, job, kind)

    def backend_for(self, name: str) -> Any:
        """The backend object (``LLGuidanceBackend`` / ``OutlinesBackend``), built on first use."""
        return self._get_backend(name)

    # ---- internals ------------------------------------------------------------------------

    def _compile_json(self, backend: str, schema: Any, options: GrammarOptions) -> CompiledGrammar:
        from sgrt.constrained.satisfiable import check_satisfiable

        normalized = normalize_loaded(schema, options, backend)  # loaded once, in compile_spec
        # NOTE: the user's schema met the limits above. Our rewrites (unevaluated*, object
        # const / enum, the default bounds) wrap parts of it in allOf / anyOf levels it did not
        # write, so the rewritten schema gets twice the depth: still far below what the compile
        # thread's stack takes (DESIGN.md, "Grammar compile limits and isolation").
        _limits.check_schema_depth(normalized.schema, 2 * self.limits.max_schema_depth)
        check_satisfiable(normalized.schema)
        return self._get_backend(backend).compile_json(normalized.schema, options, normalized.warnings)

    def _get_backend(self, name: str) -> Any:
        with self._backend_lock:
            b = self._backends.get(name)
            if b is None:
                if name == "llguidance":
                    from sgrt.constrained.llguidance_backend import LLGuidanceBackend

                    b = LLGuidanceBackend(self.vocab, self.limits.llguidance_limits())
                else:
                    from sgrt.constrained.outlines_backend import OutlinesBackend

                    b = OutlinesBackend(self.vocab, self.compile_timeout_s)
                self._backends[name] = b
            return b

    def _cached(self, key: tuple, job: Callable[[], CompiledGrammar], kind: str) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["hits"] += 1
                return _unwrap(hit)
            fut = self._inflight.get(key)
            if fut is None:
                self.stats["misses"] += 1
                fut = Future()
                self._inflight[key] = fut
                _start_with_stack(
                    threading.Thread(target=self._run, args=(key, job, fut), name="sgrt-compile", daemon=True),
                    self.limits.compile_stack_mb,
                )
        try:
            result = fut.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            with self._lock:
                self.stats["timeouts"] += 1
            raise GrammarError(
                f"{kind} took longer than {self.compile_timeout_s:g} s to compile (compile_timeout_s)", field=kind
            ) from None
        return _unwrap(result)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the compilations in flight; True if none is left."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._inflight.values())
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                pending[0].result(timeout=left)
            except (FutureTimeout, Exception):  # only waiting here; the caller sees errors
                pass

    def _run(self, key: tuple, job: Callable[[], CompiledGrammar], fut: Future) -> None:
        try:
            result: CompiledGrammar | GrammarError = job()
        except GrammarError as e:
            result = e
        except Exception as e:  # a backend bug must not kill the request silently
            result = GrammarError(f"{key[1]} could not be compiled ({key[0]}): {type(e).__name__}: {e}", field=key[1])
        with self._lock:
            if isinstance(result, GrammarError):
                self.stats["errors"] += 1
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._inflight.pop(key, None)
        fut.set_result(result)


_STACK_LOCK = threading.Lock()


def _start_with_stack(thread: threading.Thread, stack_mb: int) -> None:
    """Start ``thread`` with a ``stack_mb`` MiB stack (``threading.stack_size`` is process-wide,
    so it is set just for this start and put back). The stack is reserved address space;
    only the pages a compile touches are committed."""
    with _STACK_LOCK:
        previous = threading.stack_size(stack_mb << 20)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)


def _unwrap(result: CompiledGrammar | GrammarError) -> CompiledGrammar:
    if isinstance(result, GrammarError):
        raise GrammarError(str(result), field=result.field, path=result.path)
    return result


def _constraint_of(params: Any) -> tuple[str | None, Any]:
    from sgrt.sampling_params import CONSTRAINT_FIELDS, SamplingParams, the_constraint

    if isinstance(params, SamplingParams):
        return params.constraint()  # at most one: checked when the params were built
    return the_constraint({k: getattr(params, k, None) for k in CONSTRAINT_FIELDS}, GrammarError)
