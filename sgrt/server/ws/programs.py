"""Programs the server may run: discovery of ``@sgrt.function`` programs in a folder, and the
adapter that runs one for a session.

Only programs registered on the server run; a client names one and passes its arguments (plain
JSON values). The server never executes code that a client sent.

The adapter (:class:`ProgramRun`) is the one place that knows the DSL's API: ``fn.run(backend=...,
stream=True, **args, **sampling)``, ``state.sync()``, ``state.error()``, ``state.text()``,
``state.abort()``. The program's model calls go through a :class:`SessionBackend`, an in-process
backend over the server's engine that streams each generated piece to the session and applies
the server's limits (tokens per call, generations in flight per session).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgrt.backends.local import LocalBackend
from sgrt.engine import EngineClient, EngineInfo, RequestHandle, StreamChunk
from sgrt.errors import RequestAborted
from sgrt.server.ws.protocol import LimitExceeded

logger = logging.getLogger("sgrt.server")


def is_program(obj: Any) -> bool:
    """True for an ``@sgrt.function`` program object."""
    try:
        from sgrt.lang import Function
    except ImportError:  # pragma: no cover - the DSL is part of sgrt
        return False
    return isinstance(obj, Function)


class ProgramRegistry:
    """Name -> program. :meth:`discover` imports every ``*.py`` module of a folder (names starting
    with ``_`` are skipped) and registers each ``@sgrt.function`` found at module level under its
    function name. A module that fails to import is logged and listed in ``errors``; the others
    still load."""

    def __init__(self) -> None:
        self.programs: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path | None) -> "ProgramRegistry":
        registry = cls()
        if path is not None:
            registry.discover(path)
        return registry

    def discover(self, path: str | Path) -> None:
        """Import the folder's modules and register their programs.

        Raises:
            FileNotFoundError: ``path`` is not a folder.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"programs folder {str(folder)!r} does not exist")
        for file in sorted(folder.glob("*.py")):
            if file.name.startswith("_"):
                continue
            module_name = f"sgrt_programs.{file.stem}"
            try:
                spec = importlib.util.spec_from_file_location(module_name, file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - one broken module must not stop the others
                sys.modules.pop(module_name, None)
                self.errors[str(file)] = f"{type(e).__name__}: {e}"
                logger.warning("programs: cannot import %s: %s: %s", file, type(e).__name__, e)
                continue
            for attr, obj in vars(module).items():
                if not attr.startswith("_") and is_program(obj):
                    self.register(getattr(obj, "__name__", attr), obj, source=str(file))

    def register(self, name: str, program: Any, source: str = "<code>") -> None:
        """Register ``program`` under ``name``; a second, different program of the same name
        is refused (logged, listed in ``errors``)."""
        known = self.programs.get(name)
        if known is not None and known is not program:
            msg = f"program {name!r} from {source} clashes with the one from {self.sources[name]}; kept the first"
            self.errors[source] = msg
            logger.warning("programs: %s", msg)
            return
        self.programs[name] = program
        self.sources[name] = source

    def get(self, name: str) -> Any | None:
        return self.programs.get(name)

    def names(self) -> list[str]:
        return sorted(self.programs)


# ---- a client's arguments -----------------------------------------------------------------------

def check_program_args(program: Any, args: dict[str, Any]) -> dict[str, Any]:
    """A client's ``args`` checked against the program's signature before it runs: every name
    is one of its arguments, every argument without a default is given (or bound), and each
    value has the argument's annotated type, converted as msgspec converts JSON values
    (``list[str]``, ``dict[str, Any]``, a ``TypedDict``, ``int``: strictly, so ``"3"`` is not
    an int). An annotation msgspec cannot check (or none) lets any value through; one that no
    JSON value can satisfy (a callable) only lets its default through (``null`` for an
    optional one).

    Returns:
        The arguments, converted (a ``tuple`` annotation gets a tuple).

    Raises:
        InvalidRequest: naming ``args.<name>`` (and the path inside it).
    """
    import inspect
    import typing

    import msgspec

    from sgrt.errors import InvalidRequest

    func = getattr(program, "func", program)
    params = list(inspect.signature(func).parameters.values())[1:]  # the first is the state s
    bound = getattr(program, "bound", {}) or {}
    by_name = {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    name = getattr(program, "__name__", "program")
    for key in args:
        if key not in by_name and not takes_any:
            known = ", ".join(by_name) or "none"
            raise InvalidRequest(f"program {name!r} has no argument {key!r} (its arguments: {known})",
                                 field=f"args.{key}")
    for key, param in by_name.items():
        if param.default is param.empty and key not in args and key not in bound:
            raise InvalidRequest(f"program {name!r} needs the argument {key!r}", field=f"args.{key}")
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: names checked only
        hints = {}
    out = dict(args)
    for key, value in args.items():
        hint = hints.get(key)
        if hint is None or hint is Any:
            continue
        try:
            out[key] = msgspec.convert(value, hint, strict=True)
        except msgspec.ValidationError as e:
            text, _, where = str(e).partition(" - at `$")
            path = where.rstrip("`")
            raise InvalidRequest(f"argument {key!r} of program {name!r}: {text}", field=f"args.{key}{path}") from None
        except TypeError:  # NOTE: msgspec has no JSON form of this type at all
            if value is None and _allows_none(hint):
                continue
            raise InvalidRequest(f"argument {key!r} of program {name!r} cannot be given by a client (its type "
                                 f"{hint} has no JSON form); leave it out", field=f"args.{key}") from None
    return out


def _allows_none(hint: Any) -> bool:
    import types
    import typing

    return hint is type(None) or (typing.get_origin(hint) in (typing.Union, types.UnionType)
                                  and type(None) in typing.get_args(hint))


# ---- running one program ------------------------------------------------------------------------

@dataclass
class ProgramReport:
    """What a finished program run reports to its session."""

    text: str = ""
    outputs: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    ttft: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: BaseException | None = None


class RequestTree:
    """The engine as one program run sees it: every request the run submits (the main state's,
    each ``fork`` branch's, ``select``'s scoring and prefix-cache requests) is recorded, so that
    :meth:`abort_all` aborts the whole tree at once, children included, and refuses anything
    submitted afterwards (a branch thread that was about to start its next ``gen``).

    An :class:`~sgrt.engine.client.EngineClient` itself: ``submit`` and ``stream`` are recorded;
    ``info``, ``tokenizer``, ``abort``, ``flush_cache``, ``is_alive``, ``stats`` and ``metrics``
    are the wrapped engine's.
    """

    def __init__(self, engine: EngineClient):
        self._engine = engine
        self._lock = threading.Lock()
        self._live: dict[str, RequestHandle] = {}  # request id -> handle, pruned when done
        self.aborted = False

    # ---- the wrapped engine's -----------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def metrics(self) -> Any:
        return self._engine.metrics

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def is_alive(self) -> bool:
        return self._engine.is_alive()

    def stats(self) -> dict[str, Any]:
        return self._engine.stats()

    # ---- recorded -----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: Any = None) -> Iterator[StreamChunk]:
        """``Engine.stream``, recorded (see :meth:`submit`)."""
        return iter(self.submit(prompt, params))

    def submit(self, prompt: Any, params: Any = None, request_id: str | None = None) -> RequestHandle:
        """``Engine.submit``, recorded. Raises :class:`RequestAborted` once the tree was aborted."""
        with self._lock:
            if self.aborted:
                raise RequestAborted("the program was aborted (cancel, close or disconnect)")
            handle = self._engine.submit(prompt, params, request_id=request_id)
            for rid in [r for r, h in self._live.items() if h.done]:
                del self._live[rid]
            self._live[handle.request_id] = handle
        return handle

    def abort_all(self) -> int:
        """Abort every request of the tree still running; later submits are refused. Returns
        how many were aborted (their KV slots are freed by the engine's next step)."""
        with self._lock:
            self.aborted = True
            live = [h for h in self._live.values() if not h.done]
            self._live.clear()
        for handle in live:
            self._engine.abort(handle.request_id)
        return len(live)

    def live_count(self) -> int:
        """Requests of the tree not finished yet."""
        with self._lock:
            return sum(not h.done for h in self._live.values())


class SessionBackend(LocalBackend):
    """The server's engine as a DSL backend for one session: streams generated text to
    ``on_text`` and enforces the server's limits.

    Raises (from ``generate*``):
        LimitExceeded: ``limit.max_tokens`` (a gen asks for more than ``max_tokens_per_turn``)
            or ``limit.generations`` (more than ``max_generations_per_session`` in flight).
    """

    def __init__(self, engine: EngineClient, chat_template: Any, on_text: Callable[[str], None], limits: Any):
        super().__init__(engine, chat_template=chat_template)
        self.tree = RequestTree(engine)
        self.engine = self.tree  # NOTE: every request of the run goes through the tree (abort_all)
        self.on_text = on_text
        self.limits = limits
        self._lock = threading.Lock()
        self._in_flight = 0
        self.stats = ProgramReport()

    def _enter(self, params: Sequence[Any]) -> None:
        limit = self.limits.max_tokens_per_turn
        for sp in params:
            mt = sp.get("max_tokens") if isinstance(sp, dict) else sp.max_tokens
            if isinstance(mt, int) and mt > limit:
                raise LimitExceeded("limit.max_tokens",
                                    f"a gen asks for max_tokens {mt}, above max_tokens_per_turn ({limit})",
                                    field="max_tokens")
        with self._lock:
            cap = self.limits.max_generations_per_session
            if self._in_flight + len(params) > cap:
                raise LimitExceeded(
                    "limit.generations",
                    f"{self._in_flight + len(params)} generations in flight exceed max_generations_per_session ({cap})",
                    field="program")
            self._in_flight += len(params)

    def _exit(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n

    def _record(self, meta: dict[str, Any] | None) -> None:
        if not meta:
            return
        with self._lock:
            s = self.stats
            s.prompt_tokens += meta.get("prompt_tokens", 0) or 0
            s.completion_tokens += meta.get("completion_tokens", 0) or 0
            s.cached_tokens += meta.get("cached_tokens", 0) or 0
            s.finish_reason = meta.get("finish_reason")
            if s.ttft is None and meta.get("ttft") is not None:
                s.ttft = meta["ttft"]

    def generate(self, prompt: str, params: Any, request_id: str | None = None):
        self._enter([params])
        try:
            out = super().generate(prompt, params, request_id=request_id)
        finally:
            self._exit(1)
        self._record(out.meta_info)
        if out.text:
            self.on_text(out.text)
        return out

    def generate_batch(self, prompts: Sequence[str], params: Sequence[Any]):
        self._enter(list(params))
        try:
            outs = super().generate_batch(prompts, params)
        finally:
            self._exit(len(prompts))
        for out in outs:
            self._record(out.meta_info)
        return outs

    def generate_stream(self, prompt: str, params: Any, request_id: str | None = None) -> Iterator[Any]:
        self._enter([params])
        try:
            for chunk in super().generate_stream(prompt, params, request_id=request_id):
                if chunk.text:
                    self.on_text(chunk.text)
                if chunk.finished:
                    self._record(chunk.meta_info)
                yield chunk
        finally:
            self._exit(1)


class ProgramRun:
    """One run of ``program(**args)`` on ``backend`` with ``options`` (sampling defaults every
    gen inherits). :meth:`start` returns at once; :meth:`wait` (blocking) returns the
    :class:`ProgramReport`; :meth:`abort` stops its requests."""

    def __init__(self, backend: SessionBackend, program: Any, args: dict[str, Any], options: dict[str, Any]):
        self.backend = backend
        self.program = program
        self.args = args
        self.options = options
        self.state: Any = None
        self.error: BaseException | None = None
        self._aborted = False
        self._started = threading.Event()

    def start(self) -> None:
        try:
            bad = [k for k in self.args if k in self.options or k in ("stream", "backend")]
            if bad:
                raise TypeError(f"argument {bad[0]!r} is reserved")
            self.state = self.program.run(stream=True, backend=self.backend, **self.args, **self.options)
        except TypeError as e:  # arguments that do not fit the program's signature
            from sgrt.errors import InvalidRequest

            self.error = InvalidRequest(f"program arguments: {e}", field="args")
        except Exception as e:  # noqa: BLE001
            self.error = e
        finally:
            self._started.set()
        if self._aborted and self.state is not None:
            self.state.abort()

    def abort(self) -> None:
        """Abort the program's whole request tree (``fork`` branches included) at once."""
        self._aborted = True
        self.backend.tree.abort_all()
        if self.state is not None:
            self.state.abort()

    def wait(self) -> ProgramReport:
        self._started.wait()
        report = self.backend.stats
        if self.state is None:
            report.error = self.error
            return report
        self.state.sync()
        report.error = self.state.error()
        ex = getattr(self.state, "executor", None)
        report.text = getattr(getattr(ex, "transcript", None), "text", "") if ex is not None else ""
        variables = dict(getattr(ex, "variables", {}) or {})
        report.outputs = {str(k): _jsonable(v) for k, v in variables.items()}
        if report.error is not None and report.finish_reason is None:
            report.finish_reason = "abort"
        return report


def _jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-encodable copy of a program variable (unknown objects become their ``str``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 20:
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    return str(value)
