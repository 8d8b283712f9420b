"""What every agent session shares: the base :class:`Session`, the :class:`SessionContext` it
is given, error messages and sampling checks. The two kinds are
:class:`~sgrt.server.ws.chat_session.ChatSession` (a plain chat with optional client-side tools)
and :class:`~sgrt.server.ws.program_session.ProgramSession` (one run of a registered program).

The connection (``sgrt.server.ws.server``) routes protocol messages to a session and hands it a
:class:`SessionContext`: the engine, the limits, how to send, and how to make a program backend.
Everything a session sends goes back through ``ctx.send``; it never reaches into the server.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from sgrt.engine import EngineClient, SamplingParams
from sgrt.errors import CapacityError, ContextLengthExceeded, GrammarError, InvalidRequest
from sgrt.server.limits import check_stop
from sgrt.server.ws import protocol as p
from sgrt.server.ws.protocol import LimitExceeded

logger = logging.getLogger("sgrt.server")


def error_for(exc: BaseException, session: str | None) -> p.Error:
    """The ``error`` message for an exception raised while serving a session."""
    if isinstance(exc, p.ProtocolError):
        return exc.to_message()
    field = getattr(exc, "field", None)
    if isinstance(exc, LimitExceeded):
        code = exc.code
    elif isinstance(exc, GrammarError):
        code = "grammar"
    elif isinstance(exc, ContextLengthExceeded):
        code = "context_length"
    elif isinstance(exc, InvalidRequest):
        code = "invalid_request"
    elif isinstance(exc, CapacityError):
        code = "capacity"
    else:
        # NOTE: an unexpected exception's text stays in the log (incident id in the message).
        incident = uuid.uuid4().hex[:12]
        logger.error("session %s failed (incident %s)", session, incident, exc_info=exc)
        return p.Error(code="internal", session=session,
                       message=f"internal error (incident {incident}; details in the server log)")
    return p.Error(code=code, message=str(exc) or type(exc).__name__, field=field, session=session)


def ws_sampling_params(base: dict[str, Any], override: p.Sampling | None, limits: Any,
                       field_prefix: str = "sampling", **extra: Any) -> SamplingParams:
    """The WebSocket protocol's translator: a turn's :class:`SamplingParams`, built (so checked)
    once, from the turn's ``sampling`` override over the session's ``base`` fields, the server's
    default ``max_tokens``, and ``extra`` fields the server adds (a tool grammar).

    Raises:
        LimitExceeded: ``limit.max_tokens`` when max_tokens > ``limits.max_tokens_per_turn``;
            ``limit.stop`` for more than ``max_stop`` stop strings or ``max_stop_chars``
            characters of them.
        InvalidRequest: a bad value; the field is ``sampling.<name>``.
    """
    merged = dict(base)
    if override is not None:
        merged.update(override.fields_set())
        check_stop(override.stop, limits.max_stop, limits.max_stop_chars, field=f"{field_prefix}.stop",
                   error=functools.partial(LimitExceeded, "limit.stop"))
    merged.setdefault("max_tokens", min(limits.default_max_tokens, limits.max_tokens_per_turn))
    if isinstance(merged["max_tokens"], int) and merged["max_tokens"] > limits.max_tokens_per_turn:
        raise LimitExceeded(
            "limit.max_tokens",
            f"max_tokens {merged['max_tokens']} exceeds max_tokens_per_turn ({limits.max_tokens_per_turn})",
            field=f"{field_prefix}.max_tokens")
    try:
        return SamplingParams.from_dict({**merged, **extra})
    except InvalidRequest as e:
        e.field = f"{field_prefix}.{e.field}" if e.field else field_prefix
        raise


@dataclass(frozen=True)
class SessionContext:
    """What a session needs from the connection that opened it (passed in, so the session
    module does not know the server).

    Attributes:
        engine: the :class:`~sgrt.engine.Engine` sessions submit to.
        limits: the server's :class:`~sgrt.server.limits.WsLimits`.
        send: ``await send(msg)`` sends one protocol message on the connection.
        program_backend: ``program_backend(on_text)`` -> a DSL backend for one program run
            (``on_text(str)`` is called, on the program's threads, with each streamed piece).
    """

    engine: EngineClient
    limits: Any
    send: Callable[[Any], Awaitable[None]]
    program_backend: Callable[[Callable[[str], None]], Any]


class Session:
    """Base of chat and program sessions: identity, sending, idle tracking, cancellation."""

    kind = "session"

    def __init__(self, sid: str, ctx: SessionContext, start: p.SessionStart):
        self.id = sid
        self.ctx = ctx
        self.engine = ctx.engine
        self.limits = ctx.limits
        self.start_msg = start
        self.turn = 0
        self.task: asyncio.Task | None = None
        self.last_active = time.monotonic()
        self.closed = False
        self._cancel_requested = False

    # -- plumbing ------------------------------------------------------------------------------
    async def send(self, msg: Any) -> None:
        await self.ctx.send(msg)

    async def send_error(self, exc: BaseException) -> None:
        await self.send(error_for(exc, self.id))

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def idle_for(self, now: float) -> float:
        """Seconds since the last activity (0 while a generation runs)."""
        return 0.0 if self.busy else now - self.last_active

    def _spawn(self, coro: Any) -> None:
        self.task = asyncio.get_running_loop().create_task(self._guard(coro))

    async def _guard(self, coro: Any) -> None:
        """Run a turn; an unexpected exception becomes an ``internal`` error, never a crash."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client (error_for logs it)
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=self.turn, reason="error"))
        finally:
            self.touch()

    # -- messages (overridden) -----------------------------------------------------------------
    async def on_start(self) -> None:
        """Called once after ``ready`` was sent."""

    async def on_user(self, msg: p.User) -> None:
        raise p.ProtocolError("bad_state", f"a {self.kind} session takes no user messages",
                              field="type", session=self.id)

    async def on_tool_result(self, msg: p.ToolResult) -> None:
        raise p.ProtocolError("unknown_call", f"no open tool call {msg.call_id!r}", field="call_id",
                              session=self.id)

    async def on_cancel(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Abort whatever runs and wait for it to end (close, disconnect, idle timeout)."""
        self.closed = True
        self._cancel_requested = True
        self._abort_running()
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(self.task), timeout=5.0)
            except (asyncio.CancelledError, asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass

    def _abort_running(self) -> None:
        raise NotImplementedError


def in_thread(fn: Any, name: str) -> asyncio.Future:
    """Run a blocking ``fn`` on its own daemon thread (not the loop's small default executor,
    which a few long program runs would fill); its result or exception lands in the future."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut
