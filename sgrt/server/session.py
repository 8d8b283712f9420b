"""One agent session: a plain chat with optional client-side tools, or one run of a registered
program. The connection (``sgrt.server.ws_server``) routes protocol messages here and hands each
session a :class:`SessionContext`: the engine, the limits, how to send, and how to make a program
backend. Everything a session sends goes back through ``ctx.send``; it never reaches into the
server.

Chat turns re-submit the whole conversation, as token ids that extend the previous turn's ids
exactly (prompt + generated tokens + the new messages' tokens), so the radix cache matches
everything before the new messages and turn N prefills only its new tokens. Between turns the
conversation is unlocked in the cache: under memory pressure it is evicted (LRU) like any other
entry and recomputed on the next turn, so idle sessions never block new requests.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from sgrt.engine import SamplingParams
from sgrt.errors import CapacityError, ContextLengthExceeded, GrammarError, InvalidRequest, RequestAborted
from sgrt.server import protocol as p
from sgrt.server.limits import check_sampling_ranges
from sgrt.server.protocol import LimitExceeded
from sgrt.server.tools import (
    check_tool_choice,
    check_tools,
    parse_tool_call,
    template_renders_tools,
    template_tools,
    tool_grammar,
    tool_results_as_user,
    tools_system_prompt,
    validate_tool_grammar,
)

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


def sampling_dict(base: dict[str, Any], override: p.Sampling | None, limits: Any,
                  field_prefix: str = "sampling") -> dict[str, Any]:
    """Merge a turn's sampling override into the session's, apply the server's default
    ``max_tokens`` and check every field (``SamplingParams.validate``).

    Raises:
        LimitExceeded: ``limit.max_tokens`` when max_tokens > ``limits.max_tokens_per_turn``.
        InvalidRequest: a bad value; the field is ``sampling.<name>``.
    """
    merged = dict(base)
    if override is not None:
        merged.update(override.fields_set())
    merged.setdefault("max_tokens", min(limits.default_max_tokens, limits.max_tokens_per_turn))
    if isinstance(merged["max_tokens"], int) and merged["max_tokens"] > limits.max_tokens_per_turn:
        raise LimitExceeded(
            "limit.max_tokens",
            f"max_tokens {merged['max_tokens']} exceeds max_tokens_per_turn ({limits.max_tokens_per_turn})",
            field=f"{field_prefix}.max_tokens")
    try:
        check_sampling_ranges(merged)
        SamplingParams.from_dict(merged)
    except InvalidRequest as e:
        e.field = f"{field_prefix}.{e.field}" if e.field else field_prefix
        raise
    return merged


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

    engine: Any
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


@dataclass
class _Conversation:
    """The token ids and the exact text they stand for, as fed to the engine so far."""

    ids: list[int]
    text: str


class ChatSession(Session):
    """Plain chat: ``user`` -> one assistant turn (streamed), possibly a tool call that the
    client answers with ``tool_result``, after which the turn continues."""

    kind = "chat"

    def __init__(self, sid: str, ctx: SessionContext, start: p.SessionStart):
        super().__init__(sid, ctx, start)
        limits = self.limits
        self.tools = list(start.tools)
        check_tools(self.tools, limits.max_tools)
        if self.tools:
            validate_tool_grammar(self.tools)
        sampling_dict({}, start.sampling, limits)  # refuse bad sampling at session.start
        self.sampling_base = start.sampling.fields_set() if start.sampling else {}
        check_tool_choice(start.tool_choice, self.tools)
        self.tool_choice = start.tool_choice
        self._grammars: dict[str, str | None] = {}
        self.tokenizer = self.engine.tokenizer
        self.messages: list[dict[str, Any]] = []
        self._template_tools: list[dict] | None = None
        system = start.system
        if self.tools:
            tmpl = template_tools(self.tools)
            if template_renders_tools(self.tokenizer, tmpl):
                self._template_tools = tmpl
            else:
                desc = tools_system_prompt(self.tools)
                system = f"{system}\n\n{desc}" if system else desc
        if system:
            self.messages.append({"role": "system", "content": system})
        self.conv: _Conversation | None = None
        self.handle: Any = None
        self.open_calls: dict[str, str] = {}
        self.tool_rounds = 0
        self._call_ids = itertools.count(1)
        self._tool_role = "tool"

    # -- prompt ----------------------------------------------------------------------------------
    def _render(self) -> str:
        messages = self.messages
        if self._tool_role != "tool":
            messages = tool_results_as_user(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tools=self._template_tools)
        except InvalidRequest:
            raise
        except Exception:  # noqa: BLE001 - e.g. a template that refuses the "tool" role
            if self._tool_role == "tool" and any(m["role"] == "tool" for m in messages):
                self._tool_role = "user"
                return self._render()
            raise

    def _prompt(self) -> tuple[list[int], str]:
        """Token ids of the conversation with the generation prompt; they extend the previous
        turn's ids exactly when the rendered text extends its text (the usual case)."""
        text = self._render()
        conv = self.conv
        if conv is not None and text.startswith(conv.text):
            return conv.ids + self.tokenizer.encode(text[len(conv.text):]), text
        # NOTE: the template re-rendered earlier text differently (e.g. a stop string cut the
        # reply): tokenize everything; the cache still matches whatever prefix is equal.
        return self.tokenizer.encode(text), text

    # -- messages --------------------------------------------------------------------------------
    async def on_user(self, msg: p.User) -> None:
        if self.busy:
            raise LimitExceeded("limit.generations", "a chat session runs one generation at a time and one is "
                                "running; wait for done or send cancel", field="type")
        if self.open_calls:
            raise p.ProtocolError(
                "bad_state", f"tool call {next(iter(self.open_calls))!r} is open; send its tool_result first",
                field="type", session=self.id)
        sampling = sampling_dict(self.sampling_base, msg.sampling, self.limits)
        choice = msg.tool_choice or self.tool_choice
        check_tool_choice(choice, self.tools)
        self.messages.append({"role": "user", "content": msg.content})
        self.tool_rounds = 0
        self._cancel_requested = False
        self._spawn(self._generate(sampling, choice))

    async def on_tool_result(self, msg: p.ToolResult) -> None:
        if msg.call_id not in self.open_calls:
            raise p.ProtocolError("unknown_call", f"no open tool call {msg.call_id!r}", field="call_id",
                                  session=self.id)
        choice = msg.tool_choice or "auto"
        check_tool_choice(choice, self.tools)
        name = self.open_calls.pop(msg.call_id)
        self.messages.append({"role": "tool", "name": name, "content": msg.content})
        if self.open_calls:
            return
        self.tool_rounds += 1
        if self.tool_rounds > self.limits.max_tool_rounds:
            await self.send_error(LimitExceeded(
                "limit.tools", f"more than max_tool_rounds ({self.limits.max_tool_rounds}) tool calls in one user turn",
                field="tool_result"))
            await self.send(p.Done(session=self.id, turn=self.turn, reason="error"))
            return
        self._cancel_requested = False
        self._spawn(self._generate(sampling_dict(self.sampling_base, None, self.limits), choice))

    async def on_cancel(self) -> None:
        if self.busy:
            self._cancel_requested = True
            self._abort_running()  # the turn then sends message + done("cancelled")
            return
        self.open_calls.clear()
        await self.send(p.Done(session=self.id, turn=self.turn, reason="cancelled"))

    def _abort_running(self) -> None:
        handle = self.handle
        if handle is not None:
            self.engine.abort(handle.request_id)

    # -- one generation --------------------------------------------------------------------------
    def _grammar(self, choice: str) -> str | None:
        if choice not in self._grammars:
            self._grammars[choice] = tool_grammar(self.tools, choice)
        return self._grammars[choice]

    async def _generate(self, sampling: dict[str, Any], choice: str) -> None:
        self.turn += 1
        turn = self.turn
        # NOTE: rendering + tokenizing a long conversation is CPU work: off the event loop.
        ids, text = await asyncio.to_thread(self._prompt)
        params = dict(sampling)
        grammar = self._grammar(choice)
        if grammar is not None:
            params["grammar"] = grammar
        try:
            handle = self.engine.submit(ids, SamplingParams.from_dict(params))
        except (InvalidRequest, CapacityError) as exc:
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()  # the turn never ran; the client may retry shorter
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        self.handle = handle
        if self._cancel_requested:
            self.engine.abort(handle.request_id)
        result = None
        is_call: bool | None = None if grammar is not None else False
        try:
            async for chunk in handle.astream():
                if chunk.text:
                    if is_call is None:
                        is_call = chunk.text[0] == "{"
                    if not is_call:
                        await self.send(p.Token(session=self.id, turn=turn, text=chunk.text))
                if chunk.finished:
                    result = chunk.result
        except InvalidRequest as exc:  # refused before it ran, e.g. a grammar that fails to compile
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        finally:
            self.handle = None
            if result is None:  # cancelled task (disconnect, close) or a send that failed
                self.engine.abort(handle.request_id)
        await self._finish_turn(turn, ids, text, result, bool(is_call))

    async def _finish_turn(self, turn: int, ids: list[int], text: str, result: Any, is_call: bool) -> None:
        out_ids = list(result.token_ids)
        self.conv = _Conversation(ids + out_ids, text + self.tokenizer.decode(out_ids, skip_special_tokens=False))
        self.messages.append({"role": "assistant", "content": result.text})
        call = None
        if is_call and result.finish_reason == "stop":
            parsed = parse_tool_call(result.text, self.tools)
            if parsed is not None:
                call = p.ToolCallInfo(call_id=f"call-{next(self._call_ids)}", name=parsed[0], arguments=parsed[1])
        await self.send(p.Message(
            session=self.id, turn=turn, content=result.text, finish_reason=result.finish_reason,
            tool_call=call, ttft=result.ttft, prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens, cached_tokens=result.cached_tokens))
        if result.finish_reason == "abort" and result.error and not self._cancel_requested:
            incident = uuid.uuid4().hex[:12]
            logger.error("session %s: generation failed (incident %s): %s", self.id, incident, result.error)
            await self.send(p.Error(code="generation_failed", session=self.id,
                                    message=f"the engine failed the generation (incident {incident}; details "
                                            "in the server log)"))
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        if call is not None and not self._cancel_requested:
            self.open_calls[call.call_id] = call.name
            await self.send(p.ToolCall(session=self.id, turn=turn, call_id=call.call_id, name=call.name,
                                       arguments=call.arguments))
            return
        reason = "cancelled" if self._cancel_requested else "turn"
        await self.send(p.Done(session=self.id, turn=turn, reason=reason))


class ProgramSession(Session):
    """One run of a program registered on the server, with the session's arguments."""

    kind = "program"

    def __init__(self, sid: str, ctx: SessionContext, start: p.SessionStart, program: Any):
        super().__init__(sid, ctx, start)
        if start.tools:
            raise InvalidRequest("tools are for chat sessions; a program defines its own", field="tools")
        self.program = program
        self.sampling = sampling_dict({}, start.sampling, self.limits)
        if start.sampling is None or start.sampling.max_tokens is None:
            self.sampling.pop("max_tokens")  # each gen keeps its own max_tokens (checked per call)
        self.run: Any = None

    async def on_start(self) -> None:
        self._spawn(self._run())

    async def on_cancel(self) -> None:
        if self.busy:
            self._cancel_requested = True
            self._abort_running()
            return
        await self.send(p.Done(session=self.id, turn=self.turn, reason="cancelled"))

    def _abort_running(self) -> None:
        if self.run is not None:
            self.run.abort()

    async def _run(self) -> None:
        from sgrt.server.programs import ProgramRun

        self.turn = 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_text(text: str) -> None:  # called on the program's threads
            loop.call_soon_threadsafe(queue.put_nowait, text)

        self.run = ProgramRun(self.ctx.program_backend(on_text),
                              self.program, self.start_msg.args, self.sampling)
        self.run.start()
        if self._cancel_requested:
            self.run.abort()
        done = _in_thread(self.run.wait, name=f"sgrt-program-wait-{self.id}")
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = loop.create_task(queue.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    await self.send(p.Token(session=self.id, turn=1, text=getter.result()))
                    continue
                while not queue.empty():
                    await self.send(p.Token(session=self.id, turn=1, text=queue.get_nowait()))
                break
        except BaseException:
            self.run.abort()  # disconnect or close: stop the program's requests
            raise
        finally:
            if getter is not None:
                getter.cancel()
        report = done.result()
        await self.send(p.Message(
            session=self.id, turn=1, content=report.text, finish_reason=report.finish_reason,
            ttft=report.ttft, prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens,
            cached_tokens=report.cached_tokens, outputs=report.outputs))
        if report.error is not None and not isinstance(report.error, RequestAborted):
            if isinstance(report.error, (InvalidRequest, CapacityError)):
                await self.send_error(report.error)
            elif type(report.error) is ValueError:
                # NOTE: how registered programs refuse their arguments ("n must be in 2..9"): the
                # program's own words, shown; any other exception's text stays in the log.
                await self.send(p.Error(code="invalid_request", session=self.id, field="args",
                                        message=f"the program refused its arguments: {str(report.error)[:300]}"))
            else:
                incident = uuid.uuid4().hex[:12]
                logger.error("session %s: program failed (incident %s)", self.id, incident, exc_info=report.error)
                await self.send(p.Error(code="program_failed", session=self.id,
                                        message=f"the program raised {type(report.error).__name__} (incident "
                                                f"{incident}; details in the server log)"))
            await self.send(p.Done(session=self.id, turn=1, reason="error"))
            return
        reason = "cancelled" if self._cancel_requested else "program"
        await self.send(p.Done(session=self.id, turn=1, reason=reason))


def _in_thread(fn: Any, name: str) -> asyncio.Future:
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
