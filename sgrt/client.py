"""An async client for the session server (``sgrt serve``), on ``websockets``.

    import asyncio
    from sgrt.client import AgentSession, Tool

    def calculator(expression: str) -> str: ...

    async def main():
        tools = [Tool("calculator", "Evaluate arithmetic", {"type": "object",
                      "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                      handler=calculator)]
        async with await AgentSession.connect("ws://127.0.0.1:8765", tools=tools) as s:
            reply = await s.send("What is 17 * 23?")       # tool calls answered by the handlers
            print(reply.text)
            async for event in s.stream("And 18 * 23?"):  # or stream: token / tool_call / message
                ...

One :class:`Client` (one connection) may hold many sessions (``await client.session(...)``);
:meth:`AgentSession.connect` opens a connection for a single session. Tools run here, on the
client: the server only says which tool to call with which arguments. Errors the server reports
raise :class:`ServerError` (``code``, ``field``).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from sgrt.server.ws import protocol as p

__all__ = ["AgentSession", "Client", "Reply", "ServerError", "Tool"]


class ServerError(Exception):
    """An ``error`` from the server: ``code`` (see ``sgrt.server.ws.protocol.ERROR_CODES``),
    ``field`` (the offending field or None) and the message."""

    def __init__(self, code: str, message: str, field: str | None = None, session: str | None = None):
        super().__init__(f"[{code}] {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.field = field
        self.session = session

    @classmethod
    def from_message(cls, msg: p.Error) -> "ServerError":
        return cls(msg.code, msg.message, msg.field, msg.session)


@dataclass
class Tool:
    """A client-side tool: ``parameters`` is the JSON Schema of its arguments; ``handler`` (a
    function or coroutine function taking the arguments as keywords) answers its calls. Its
    return value is sent as text (non-strings as JSON)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    handler: Callable[..., Any] | None = None

    def spec(self) -> p.ToolSpec:
        return p.ToolSpec(name=self.name, description=self.description, parameters=self.parameters)


@dataclass
class Reply:
    """The outcome of one ``send`` (a user message and every tool round it caused).

    ``text`` is the last assistant message; ``messages`` every ``message`` the server sent in
    this exchange (one per generation), ``reasoning`` the reasoning streamed on the way (a
    thinking model's ``<think>`` blocks), ``tool_calls`` the calls answered on the way, ``reason``
    the ``done`` reason. ``ttft`` is the server's time to first token of the first generation
    (seconds); ``client_ttft`` the client's, from sending to the first token or message.
    """

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    reason: str | None = None
    messages: list[p.Message] = field(default_factory=list)
    tool_calls: list[p.ToolCall] = field(default_factory=list)
    ttft: float | None = None
    client_ttft: float | None = None
    outputs: dict[str, Any] | None = None

    @property
    def cached_tokens(self) -> int:
        return self.messages[0].cached_tokens if self.messages else 0

    @property
    def completion_tokens(self) -> int:
        return sum(m.completion_tokens for m in self.messages)


class Client:
    """One WebSocket connection to the session server; sessions are multiplexed over it."""

    def __init__(self, ws: ClientConnection, auth_token: str | None = None):
        self.ws = ws
        self.auth_token = auth_token
        self.sessions: dict[str, AgentSession] = {}
        self.errors: list[ServerError] = []  # errors that name no session
        self._sent_start = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, url: str, auth_token: str | None = None, open_timeout: float = 10.0,
                      max_size: int | None = 16 << 20) -> "Client":
        ws = await connect(url, open_timeout=open_timeout, max_size=max_size, compression=None)
        return cls(ws, auth_token)

    async def session(self, *, session_id: str | None = None, system: str | None = None,
                      tools: list[Tool | dict] | None = None, sampling: dict[str, Any] | None = None,
                      program: str | None = None, args: dict[str, Any] | None = None,
                      tool_choice: str = "auto", parallel_tool_calls: bool = False,
                      timeout: float = 30.0) -> "AgentSession":
        """Open a session and wait for ``ready``.

        Raises:
            ServerError: the server refused it (unknown program, bad tool schema, a limit...).
        """
        sid = session_id or uuid.uuid4().hex[:12]
        tool_objs = [t if isinstance(t, Tool) else Tool(**t) for t in (tools or [])]
        s = AgentSession(self, sid, tool_objs, program)
        self.sessions[sid] = s
        msg = p.SessionStart(session=sid, program=program, args=args or {}, system=system,
                             sampling=msgspec.convert(sampling, p.Sampling) if sampling else None,
                             tools=[t.spec() for t in tool_objs], tool_choice=tool_choice,
                             parallel_tool_calls=parallel_tool_calls)
        if not self._sent_start:
            msg.auth_token = self.auth_token
            self._sent_start = True
        await self.send(msg)
        try:
            first = await asyncio.wait_for(s._next(), timeout)
        except BaseException:
            self.sessions.pop(sid, None)
            raise
        if isinstance(first, p.Error):
            self.sessions.pop(sid, None)
            raise ServerError.from_message(first)
        if not isinstance(first, p.Ready):
            raise ServerError("bad_message", f"expected ready, got {type(first).__name__}")
        s.ready = first
        return s

    async def send(self, msg: msgspec.Struct) -> None:
        await self.ws.send(p.encode(msg), text=True)

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (for tests of the server's error handling)."""
        await self.ws.send(data)

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                try:
                    msg = p.decode_server(raw)
                except msgspec.DecodeError:
                    continue
                sid = getattr(msg, "session", None)
                target = self.sessions.get(sid) if sid is not None else None
                if target is None and isinstance(msg, p.Error) and len(self.sessions) == 1 and sid is None:
                    target = next(iter(self.sessions.values()))
                if target is not None:
                    target._inbox.put_nowait(msg)
                elif isinstance(msg, p.Error):
                    self.errors.append(ServerError.from_message(msg))
        except ConnectionClosed:
            pass
        finally:
            for s in self.sessions.values():
                s._inbox.put_nowait(None)  # wake readers: the connection is gone


class AgentSession:
    """A session on the server: chat (with tools) or one program run."""

    def __init__(self, client: Client, sid: str, tools: list[Tool], program: str | None):
        self.client = client
        self.id = sid
        self.tools = {t.name: t for t in tools}
        self.program = program
        self.ready: p.Ready | None = None
        self.closed = False
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._own_client = False

    @classmethod
    async def connect(cls, url: str, *, auth_token: str | None = None, **session_kw: Any) -> "AgentSession":
        """Open a connection with a single session on it (closed by :meth:`close`)."""
        client = await Client.connect(url, auth_token=auth_token)
        try:
            s = await client.session(**session_kw)
        except BaseException:
            await client.close()
            raise
        s._own_client = True
        return s

    async def __aenter__(self) -> "AgentSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- receiving -------------------------------------------------------------------------------
    async def _next(self) -> Any:
        msg = await self._inbox.get()
        if msg is None:
            self._inbox.put_nowait(None)
            raise ConnectionError("the server closed the connection")
        return msg

    def _drain(self) -> None:
        """Drop messages left from an earlier exchange (e.g. the done after an error)."""
        while not self._inbox.empty():
            if self._inbox.get_nowait() is None:
                self._inbox.put_nowait(None)
                return

    # -- chat ------------------------------------------------------------------------------------
    async def stream(self, content: str, sampling: dict[str, Any] | None = None,
                     answer_tools: bool = True, tool_choice: str | None = None,
                     ) -> AsyncIterator[p.Token | p.ToolCall | p.Message | p.Done]:
        """Send a user message and yield what comes back until ``done``: ``token`` deltas,
        ``message`` per finished generation, ``tool_call`` (answered by the tool's handler after
        it is yielded, when it has one and ``answer_tools``; otherwise call :meth:`answer`).
        ``tool_choice`` overrides the session's for this turn's first generation.

        Raises:
            ServerError: the server reported an error for this turn.
        """
        self._drain()
        await self.client.send(p.User(session=self.id, content=content, tool_choice=tool_choice,
                                      sampling=msgspec.convert(sampling, p.Sampling) if sampling else None))
        async for event in self._events(answer_tools):
            yield event

    async def _events(self, answer_tools: bool) -> AsyncIterator[Any]:
        while True:
            msg = await self._next()
            if isinstance(msg, p.Error):
                raise ServerError.from_message(msg)
            yield msg
            if isinstance(msg, p.Done):
                return
            if isinstance(msg, p.ToolCall) and answer_tools:
                tool = self.tools.get(msg.name)
                if tool is not None and tool.handler is not None:
                    await self.answer(msg.call_id, await _call_tool(tool, msg.arguments))

    async def send(self, content: str, sampling: dict[str, Any] | None = None,
                   on_token: Callable[[str], Any] | None = None, tool_choice: str | None = None) -> Reply:
        """Send a user message; answer tool calls with the tools' handlers; return the
        :class:`Reply` once the server says ``done``.

        Raises:
            ServerError: the server reported an error, or called a tool that has no handler.
        """
        reply = Reply()
        t0 = time.perf_counter()
        async for event in self.stream(content, sampling, tool_choice=tool_choice):
            self._collect(reply, event, t0, on_token)
        return reply

    def _collect(self, reply: Reply, event: Any, t0: float, on_token: Callable[[str], Any] | None) -> None:
        if isinstance(event, p.Token):
            if reply.client_ttft is None:
                reply.client_ttft = time.perf_counter() - t0
            if on_token is not None:
                on_token(event.text)
        elif isinstance(event, p.Reasoning):
            reply.reasoning += event.text
        elif isinstance(event, p.Message):
            if reply.client_ttft is None:
                reply.client_ttft = time.perf_counter() - t0
            if reply.ttft is None:
                reply.ttft = event.ttft
            reply.messages.append(event)
            reply.text = event.content
            reply.finish_reason = event.finish_reason
            if event.outputs is not None:
                reply.outputs = event.outputs
        elif isinstance(event, p.ToolCall):
            reply.tool_calls.append(event)
            tool = self.tools.get(event.name)
            if tool is None or tool.handler is None:
                raise ServerError("unknown_call", f"the model called {event.name!r}, which has no handler here")
        elif isinstance(event, p.Done):
            reply.reason = event.reason

    async def answer(self, call_id: str, result: Any, tool_choice: str | None = None) -> None:
        """Send a tool's result (text; other values are sent as JSON). ``tool_choice`` applies
        to the generation that continues the turn (the server's default: ``"auto"``)."""
        content = result if isinstance(result, str) else json.dumps(result)
        await self.client.send(p.ToolResult(session=self.id, call_id=call_id, content=content,
                                            tool_choice=tool_choice))

    # -- programs --------------------------------------------------------------------------------
    async def result(self, on_token: Callable[[str], Any] | None = None) -> Reply:
        """For a program session: wait for the program to finish; ``Reply.outputs`` holds its
        variables and ``Reply.text`` its transcript.

        Raises:
            ServerError: the program failed or was refused.
        """
        reply = Reply()
        t0 = time.perf_counter()
        async for event in self._events(answer_tools=False):
            self._collect(reply, event, t0, on_token)
        return reply

    # -- control ---------------------------------------------------------------------------------
    async def cancel(self) -> None:
        """Abort the running generation (the stream then ends with ``done`` "cancelled")."""
        await self.client.send(p.Cancel(session=self.id))

    async def close(self, timeout: float = 10.0) -> None:
        """Close the session (and the connection, if :meth:`connect` opened it)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.client.send(p.Close(session=self.id))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = await asyncio.wait_for(self._next(), deadline - time.monotonic())
                if isinstance(msg, p.Done) and msg.reason == "closed":
                    break
        except (ConnectionError, ConnectionClosed, asyncio.TimeoutError):
            pass
        finally:
            self.client.sessions.pop(self.id, None)
            if self._own_client:
                await self.client.close()


async def _call_tool(tool: Tool, arguments: dict[str, Any]) -> Any:
    """Run a tool's handler; its exception becomes the result text (the model sees it)."""
    try:
        out = tool.handler(**arguments)
        if inspect.isawaitable(out):
            out = await out
        return out
    except Exception as e:  # noqa: BLE001 - reported to the model, as tool frameworks do
        return f"error: {type(e).__name__}: {e}"
