"""``@sgrt.function`` and what a program can do: run, run_batch, bind, trace, cache."""
from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgrt.chat_template import PLAIN, chat_template_for
from sgrt.lang.api import _resolve_backend
from sgrt.lang.defaults import AUTO_BATCH_THREADS, MIN_HINTED_PREFIX_CHARS, merge_run_options
from sgrt.lang.interpreter import ProgramState, StreamExecutor, run_program
from sgrt.lang.tracer import TracedProgram, TracerProgramState, trace_program


class Function:
    """A prompt program: a Python function whose first parameter is the state ``s``.

    ``fn.run(...)`` runs it once; ``fn(...)`` is the same (or, called with a program state as
    the first argument, runs the body inline on that state, so programs compose).
    """

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None,
                 num_api_spec_tokens: int | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"a program's first parameter must be the state s: {func.__name__}")
        self.func = func
        self.arg_names = [p.name for p in params[1:]
                          if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                            inspect.Parameter.VAR_KEYWORD)]
        self._signature = inspect.signature(func)
        self.bound = dict(bound or {})
        # SGLang's API speculative execution budget: kept for programs that read it, no effect
        # (see sgrt.lang.api's list of differences).
        self.num_api_spec_tokens = num_api_spec_tokens
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        self.__wrapped__ = func

    def __repr__(self) -> str:
        return f"<sgrt.function {self.__name__}>"

    # ---- arguments ------------------------------------------------------------------------

    def _split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict, dict]:
        """Separate program arguments from run options; check both.

        Raises:
            TypeError: an unknown keyword, or arguments that do not fit the signature.
        """
        prog_kwargs = {k: v for k, v in kwargs.items() if k in self.arg_names}
        options = merge_run_options({k: v for k, v in kwargs.items() if k not in self.arg_names})
        merged = {**self.bound, **prog_kwargs}
        self._signature.bind(None, *args, **merged)  # TypeError like a normal call
        return args, merged, options

    def bind(self, **kwargs: Any) -> "Function":
        """A copy of the program with some arguments fixed.

        Raises:
            TypeError: a name that is not an argument of the program.
        """
        for k in kwargs:
            if k not in self.arg_names:
                raise TypeError(f"{self.__name__}() has no argument {k!r}")
        return Function(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    # ---- running --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], (ProgramState, TracerProgramState)):
            return self.func(args[0], *args[1:], **{**self.bound, **kwargs})
        return self.run(*args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Any = None,
            **kwargs: Any) -> ProgramState:
        """Run the program once and return its state.

        ``kwargs`` are the program's arguments and the sampling options every ``gen`` inherits
        unless it sets its own (``max_tokens`` (alias ``max_new_tokens``), ``min_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``, ``stop_token_ids``,
        penalties, ``ignore_eos``, ``return_logprob``, ``top_logprobs_num``, ``seed``).

        The program's code runs now, ahead of generation; reads (``s["x"]``, ``s.text()``) wait
        for what they need. With ``stream=True`` the program runs on its own thread and the
        state comes back at once, for ``text_iter()`` / ``text_async_iter()``; an exception the
        program raises then surfaces from the state's readers. Without it, the exception
        propagates from ``run()`` itself.

        Raises:
            TypeError: an unknown keyword or missing program argument.
            InvalidRequest: no backend.
        """
        from sgrt.global_config import global_config

        args, prog_kwargs, options = self._split(args, kwargs)
        state = self._new_state(_resolve_backend(backend), options, stream)
        if not stream:
            run_program(self.func, state, args, prog_kwargs, capture=False)
            if global_config.verbosity >= 2:
                print(state.text())
            return state
        ex = state.executor
        ex.program_running = True  # before the thread starts, so readers wait for it
        threading.Thread(target=run_program, name=f"sgrt-program-{self.__name__}",
                         args=(self.func, state, args, prog_kwargs, True), daemon=True).start()
        return state

    def _new_state(self, backend: Any, options: dict[str, Any], stream: bool) -> ProgramState:
        return ProgramState(StreamExecutor(backend, options, chat_template_for(backend), stream))

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | tuple], *,
                  backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, generator_style: bool = False,
                  **options: Any) -> Any:
        """Run the program once per argument set, concurrently; states in input order.

        With ``generator_style=True`` (SGLang's flag) returns an iterator that yields the
        states in input order as they finish, instead of the list.

        ``batch_kwargs`` holds dicts of keyword arguments or tuples of positional ones.
        ``num_threads="auto"`` uses up to ``AUTO_BATCH_THREADS`` threads; ``progress_bar``
        shows a tqdm bar. Before dispatch, the constant prefix the runs share (found by
        tracing, with arguments equal across the batch filled in) is put into the prefix cache
        once (prefix hinting). A run that fails keeps its exception in its state
        (``s.error()``; ``s.text()`` raises it); the others are unaffected.

        Raises:
            TypeError: an unknown option, or an argument set that does not fit the program.
        """
        backend = _resolve_backend(backend)
        options = merge_run_options(options)
        items = []
        for item in batch_kwargs:
            if isinstance(item, dict):
                items.append(self._split((), item)[:2])
            elif isinstance(item, (tuple, list)):
                items.append(self._split(tuple(item), {})[:2])
            else:
                raise TypeError(
                    f"run_batch items must be dicts or tuples, got {type(item).__name__}")
        if not items:
            return iter([]) if generator_style else []
        from sgrt.global_config import global_config

        if len(items) > 1 and global_config.enable_precache_with_tracing:
            self._hint_prefix(backend, [kw for a, kw in items if not a])
        if num_threads == "auto":
            num_threads = min(len(items), max(AUTO_BATCH_THREADS, (os.cpu_count() or 1)))
        num_threads = max(1, min(int(num_threads), len(items)))

        def run_one(item: tuple[tuple, dict]) -> ProgramState:
            args, kw = item
            state = self._new_state(backend, options, False)
            run_program(self.func, state, args, kw, capture=True)
            state.sync()
            return state

        if generator_style:
            return self._run_batch_iter(items, run_one, num_threads, progress_bar)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(items), desc=self.__name__)
        states: list[ProgramState] = [None] * len(items)  # type: ignore[list-item]
        with ThreadPoolExecutor(num_threads) as pool:
            futures = {pool.submit(run_one, item): i for i, item in enumerate(items)}
            for fut in _as_completed(futures):
                states[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def _run_batch_iter(self, items: list, run_one: Callable, num_threads: int,
                        progress_bar: bool):
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(items), desc=self.__name__)
        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(run_one, item) for item in items]
            for fut in futures:
                yield fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    def compile(self, *, backend: Any = None) -> "CompiledFunction":
        """SGLang's ``compile()``: the program's traced graph plus ``run`` / ``run_batch``.

        SGLang's compiled mode scheduled the traced graph over one stream executor per branch;
        sgrt's interpreter already runs the program ahead of its generations, one worker per
        branch, so the compiled program runs through the same interpreter (same text).
        """
        return CompiledFunction(self, backend)

    # ---- tracing and prefix hints ---------------------------------------------------------

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TracedProgram:
        """Record the program's graph without a model (see ``sgrt.lang.tracer``).

        Arguments given in ``kwargs`` (or bound, or left at their default values) are used as
        values; the others become placeholders. The chat template comes from ``backend`` (or the
        default backend; plain role markers if there is none). As in SGLang,
        ``fn.trace().last_node.print_graph_dfs()`` is the graph as text.
        """
        return self._trace(backend, kwargs, varying=set())

    def _trace(self, backend: Any, kwargs: dict[str, Any], varying: set[str]) -> TracedProgram:
        """Trace with ``kwargs``, bound values and defaults; names in ``varying`` stay placeholders
        even if they have a default (their value differs between the items of a batch)."""
        from sgrt.lang.api import get_default_backend

        backend = backend if backend is not None else get_default_backend()
        template = chat_template_for(backend) if backend is not None else PLAIN
        for k in kwargs:
            if k not in self.arg_names:
                raise TypeError(f"{self.__name__}() has no argument {k!r}")
        defaults = {
            name: p.default for name, p in self._signature.parameters.items()
            if name in self.arg_names and p.default is not inspect.Parameter.empty and name not in varying
        }
        return trace_program(self.func, template, self.arg_names, {**defaults, **self.bound, **kwargs})

    def cache(self, backend: Any = None, **kwargs: Any) -> dict[str, Any]:
        """Put the program's constant prefix into the backend's prefix cache now.

        Returns ``{"prefix": text, **backend meta}`` (``{"prefix": ""}`` if there is none).
        """
        backend = _resolve_backend(backend)
        prefix = self.trace(backend=backend, **kwargs).prefix
        if not prefix:
            return {"prefix": ""}
        return {"prefix": prefix, **(backend.cache_prefix(prefix) or {})}

    def _hint_prefix(self, backend: Any, batch_kwargs: list[dict[str, Any]]) -> None:
        common = _common_kwargs(batch_kwargs)
        varying = {k for kw in batch_kwargs for k in kw} - set(common)
        try:
            prefix = self._trace(backend, common, varying).prefix
        except Exception:  # noqa: BLE001 - a hint must never fail the batch
            return
        if len(prefix) >= MIN_HINTED_PREFIX_CHARS:
            try:
                backend.cache_prefix(prefix)
            except Exception:  # noqa: BLE001
                pass


def _as_completed(futures: Any):
    from concurrent.futures import as_completed

    return as_completed(futures)


def _common_kwargs(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Keyword arguments whose value is the same in every item of the batch."""
    if not batch:
        return {}
    common = {}
    for key, value in batch[0].items():
        try:
            if all(key in kw and kw[key] == value for kw in batch[1:]):
                common[key] = value
        except Exception:  # noqa: BLE001 - values that cannot be compared are not shared
            continue
    return common


class CompiledFunction:
    """What :meth:`Function.compile` returns: ``run``, ``run_batch``, ``print_graph``."""

    def __init__(self, function: Function, backend: Any = None):
        self.function = function
        self.backend = backend
        self.traced = function.trace(backend=backend)

    def print_graph(self) -> None:
        """Print the traced graph (``TracedProgram.print_graph``)."""
        self.traced.print_graph()

    def run(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """As :meth:`Function.run` (the compile-time backend when ``backend`` is None)."""
        return self.function.run(*args, backend=backend or self.backend, **kwargs)

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | tuple], *, backend: Any = None,
                  **kwargs: Any) -> Any:
        """As :meth:`Function.run_batch`."""
        return self.function.run_batch(batch_kwargs, backend=backend or self.backend, **kwargs)


def function(func: Callable[..., Any] | None = None,
             num_api_spec_tokens: int | None = None) -> Any:
    """Decorator making a prompt program: ``@sgrt.function``, ``@sgrt.function()`` or SGLang's
    ``@sgrt.function(num_api_spec_tokens=64)`` (accepted; no effect, see ``sgrt.lang.api``).

    Raises:
        InvalidRequest: (field ``num_api_spec_tokens``) not ``None`` nor an int >= 0.
    """
    if num_api_spec_tokens is not None and (
            isinstance(num_api_spec_tokens, bool) or not isinstance(num_api_spec_tokens, int)
            or num_api_spec_tokens < 0):
        from sgrt.errors import InvalidRequest

        raise InvalidRequest(f"num_api_spec_tokens must be an int >= 0, got {num_api_spec_tokens!r}",
                             field="num_api_spec_tokens")
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)
