"""The WebSocket session protocol: every message, in one place.

Each WebSocket text frame holds one JSON object. Every object has ``"type"`` (which message it
is) and ``"v"`` (the protocol version, :data:`PROTOCOL_VERSION`; optional from clients, always
sent by the server). Messages about a session carry its id in ``"session"``; the client picks
session ids (any non-empty string up to 128 characters), so that every reply can be routed
before the server has answered. One connection may hold several sessions.

Client to server
----------------
``session.start``
    Open a session. ``session`` (id), and optionally: ``program`` (the name of a program
    registered on the server) with ``args`` (its keyword arguments), or plain chat with
    ``system`` (a system prompt); ``sampling`` (:class:`Sampling`); ``tools`` (a list of
    :class:`ToolSpec`: ``name``, ``description``, ``parameters`` = JSON Schema of the arguments);
    ``tool_choice`` (``"auto"``: the model chooses text or a call, the default; ``"required"``:
    a call of some tool; a tool's name: a call of that tool; ``"none"``: text only, not
    starting with ``{``); ``parallel_tool_calls`` (default false: at most one call per
    generation; true: one or more calls, in the model family's own separator);
    ``auth_token`` (required in the first message of a connection when the server has a token).
    Answered by ``ready``. A program session runs its program at once and ends with ``done``
    (reason ``"program"``).
``user``
    ``session``, ``content`` (the user's message), and optionally ``sampling`` (overrides the
    session's fields for this turn) and ``tool_choice`` (for this turn's first generation;
    each generation that follows a tool result uses the ``tool_result``'s). Starts an assistant
    turn.
``tool_result``
    ``session``, ``call_id`` (from the ``tool_call``) and ``content`` (a string; encode
    structured results as JSON text), and optionally ``tool_choice`` for the generation that
    continues the turn (default ``"auto"``; ``"none"`` asks for a text answer now).
``cancel``
    ``session``: abort the running generation (its KV slots are freed); answered by ``message``
    (``finish_reason: "abort"``) and ``done`` (reason ``"cancelled"``), or by ``done`` alone
    when nothing ran.
``close``
    ``session``: abort anything running and forget the session; answered by ``done``
    (reason ``"closed"``).

Server to client
----------------
``ready``
    The session exists: ``session``, ``program``, ``tools`` (names), ``limits`` (the server's
    limits, see :class:`sgrt.server.ws.server.WsLimits`).
``token``
    ``session``, ``turn``, ``text``: a streamed text delta of the assistant's answer. Reasoning
    and tool calls are not in it (they arrive as ``reasoning`` and ``tool_call.delta``).
``reasoning``
    ``session``, ``turn``, ``text``: a streamed delta of a thinking model's reasoning (its
    ``<think>`` block), ahead of the answer's tokens. (New in this version; older clients skip
    message types they do not know.)
``tool_call.delta``
    ``session``, ``turn``, ``index`` (the call's place in the turn, from 0), ``call_id``,
    ``name`` (in the first delta of a call, else empty) and ``arguments`` (a fragment of the
    arguments' JSON text): a call streamed as it is generated. The complete call still arrives
    as ``tool_call`` after ``message``.
``message``
    A finished generation: ``session``, ``turn``, ``role`` (``"assistant"``), ``content`` (the
    whole text), ``finish_reason`` (``stop`` / ``length`` / ``abort``), ``tool_call`` (or null),
    ``ttft`` (seconds, null when nothing was generated), ``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens`` (prompt tokens served from the prefix cache), and
    for program sessions ``outputs`` (the program's variables).
``tool_call``
    ``session``, ``turn``, ``call_id``, ``name``, ``arguments`` (an object that matches the
    tool's schema): one per call of the generation (several with ``parallel_tool_calls``), in
    order. The server then waits for a ``tool_result`` of every one before the turn continues.

Tool calls are generated in the model family's own format, detected from its chat template:
Hermes / Qwen ``<tool_call>{...}</tool_call>`` (text may come first), Llama 3 JSON, Mistral
``[TOOL_CALLS][...]``, else sgrt's generic ``{"name": ..., "arguments": {...}}``; ``message``'s
``content`` is the whole generated text and ``tool_call`` its first call.
``error``
    ``code`` (see :data:`ERROR_CODES`), ``message`` (human readable, names the field and the
    limit), ``field`` (dotted path of the offending field, or null), ``session`` (or null).
    An error never closes the connection, except ``unauthorized`` (close code 1008). Besides,
    a frame over 4x ``max_message_bytes`` is refused by the transport (close code 1009), and a
    connection left without sessions for ``idle_timeout_s`` is closed (code 1000).
``done``
    ``session``, ``turn``, ``reason``: ``"turn"`` (the assistant answered; send the next
    ``user``), ``"cancelled"``, ``"closed"``, ``"program"`` (the program finished),
    ``"idle_timeout"`` (the server closed an idle session) or ``"error"`` (the turn failed; an
    ``error`` came first).

Limits
------
Configurable per server (:class:`sgrt.server.ws.server.WsLimits`; defaults in brackets); going
over one gets ``error`` with code ``limit.<name>`` and changes nothing else:
``max_message_bytes`` [1 MiB] (``limit.message_size``), ``max_sessions`` [256] and
``max_sessions_per_connection`` [32] (``limit.sessions``), ``max_generations_per_session`` [8
for a program's concurrent gens; a chat session runs one generation at a time]
(``limit.generations``), ``max_tokens_per_turn`` [1024; ``default_max_tokens`` 256 when unset]
(``limit.max_tokens``), ``max_tools`` [32] and ``max_tool_rounds`` [8 tool results per user
turn] (``limit.tools``), ``idle_timeout_s`` [300 s without a message, while nothing runs]
(``limit.idle_timeout``, then ``done`` with reason ``"idle_timeout"``).
``max_json_depth`` [64 levels of arrays/objects in a frame] (``limit.json_depth``),
``max_stop`` [64] strings and ``max_stop_chars`` [8192] characters of ``sampling.stop``
(``limit.stop``). Out-of-range numbers (``sampling.seed`` outside 64 bits, ...) and program
``args`` that do not fit the program's signature get ``invalid_request`` naming the field.
Before a connection exists: an upgrade whose ``Origin`` header is neither a loopback page nor in
``allowed_origins`` is refused with HTTP 403 (no Origin header: a non-browser client, allowed);
while ``max_connections`` clients are admitted with 503; an upgrade not completed within
``open_timeout_s`` [10 s] is dropped. A connection is admitted by its first valid message
(``session.start`` with ``auth_token`` when the server has one), which must come within
``auth_timeout_s`` [5 s] of the upgrade (else close code 1008); a connection not admitted yet
may be closed to make room for a new one. A client that reads nothing for ``write_timeout_s``
[30 s] while the server has a message for it is disconnected. An ``internal`` error carries an
incident id, never exception text.

Example
-------
::

    -> {"type": "session.start", "v": 1, "session": "s1", "tools": [{"name": "calculator",
        "description": "Evaluate arithmetic", "parameters": {"type": "object",
        "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]}
    <- {"type": "ready", "v": 1, "session": "s1", "tools": ["calculator"], ...}
    -> {"type": "user", "v": 1, "session": "s1", "content": "What is 17 * 23?"}
    <- {"type": "message", "v": 1, "session": "s1", "turn": 1, "content":
        "{\\"name\\": \\"calculator\\", \\"arguments\\": {\\"expression\\": \\"17 * 23\\"}}", ...}
    <- {"type": "tool_call", "v": 1, "session": "s1", "turn": 1, "call_id": "call-1",
        "name": "calculator", "arguments": {"expression": "17 * 23"}}
    -> {"type": "tool_result", "v": 1, "session": "s1", "call_id": "call-1", "content": "391"}
    <- {"type": "token", "v": 1, "session": "s1", "turn": 2, "text": "17 * 23"} ...
    <- {"type": "message", ...}  <- {"type": "done", "v": 1, "session": "s1", "turn": 2,
        "reason": "turn"}
"""
from __future__ import annotations

import re
from typing import Any, Union

import msgspec

from sgrt.errors import InvalidRequest

PROTOCOL_VERSION = 1

#: Every ``error.code`` the server sends, with its meaning.
ERROR_CODES: dict[str, str] = {
    "bad_json": "the frame is not valid JSON (or not UTF-8)",
    "bad_message": "a field is missing, has the wrong type, or is not allowed (see field)",
    "unknown_type": "the message type is not one of the protocol's",
    "unsupported_version": "the message's v is not a protocol version this server speaks",
    "unauthorized": "the first message did not carry the server's auth token (connection closes)",
    "unknown_session": "no open session on this connection has that id",
    "session_exists": "a session with that id is already open",
    "unknown_program": "no program of that name is registered on the server",
    "unknown_call": "tool_result for a call_id that is not open",
    "bad_state": "the message does not fit the session's state (e.g. user while a tool call is open)",
    "invalid_request": "a field's value is out of range or inconsistent (see field)",
    "context_length": "the conversation plus max_tokens no longer fits the model's context",
    "capacity": "the request can never fit the engine's KV pool",
    "grammar": "the tools' schemas could not be compiled into a grammar, or the grammar hit a limit mid-turn",
    "generation_failed": "the engine failed the generation (message says why)",
    "program_failed": "the program raised an exception (message says which)",
    "limit.message_size": "the frame is larger than max_message_bytes",
    "limit.json_depth": "the frame nests arrays/objects deeper than max_json_depth",
    "limit.sessions": "too many open sessions (server-wide or on this connection)",
    "limit.generations": "too many generations running in this session (a chat session runs one at a time)",
    "limit.max_tokens": "sampling.max_tokens is above max_tokens_per_turn",
    "limit.stop": "sampling.stop has more than max_stop strings or max_stop_chars characters",
    "limit.connections": "the server already has max_connections clients (the connection closes, code 1013)",
    "limit.tools": "too many tools, or too many tool calls in one user turn",
    "limit.idle_timeout": "the session was idle longer than idle_timeout_s and was closed",
    "internal": "a server bug; the session may be unusable, the connection stays up",
}


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=False, kw_only=True):
    """Every message: ``type`` (the tag) and ``v`` (protocol version)."""

    v: int = PROTOCOL_VERSION


# ---- parts --------------------------------------------------------------------------------------

class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Sampling options a client may set (a subset of ``sgrt.engine.SamplingParams``; the
    same names and meanings). Unset fields keep the engine's defaults (greedy)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None

    def fields_set(self) -> dict[str, Any]:
        """The fields the client set, as a dict."""
        return {k: getattr(self, k) for k in self.__struct_fields__ if getattr(self, k) is not None}


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool the client offers: its ``parameters`` are the JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})


class ToolCallInfo(msgspec.Struct, kw_only=True):
    """A tool call the model made (inside ``message``)."""

    call_id: str
    name: str
    arguments: dict[str, Any]


# ---- client -> server ---------------------------------------------------------------------------

class SessionStart(_Base, tag="session.start"):
    """Open a chat or program session (see the module docstring)."""

    session: str
    program: str | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    system: str | None = None
    sampling: Sampling | None = None
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    tool_choice: str = "auto"
    parallel_tool_calls: bool = False
    auth_token: str | None = None


class User(_Base, tag="user"):
    """A user message: starts an assistant turn."""

    session: str
    content: str
    sampling: Sampling | None = None
    tool_choice: str | None = None


class ToolResult(_Base, tag="tool_result"):
    """The client's answer to a ``tool_call``."""

    session: str
    call_id: str
    content: str
    tool_choice: str | None = None


class Cancel(_Base, tag="cancel"):
    """Abort the session's running generation."""

    session: str


class Close(_Base, tag="close"):
    """Close the session."""

    session: str


ClientMessage = Union[SessionStart, User, ToolResult, Cancel, Close]
CLIENT_TYPES = ("session.start", "user", "tool_result", "cancel", "close")


# ---- server -> client ---------------------------------------------------------------------------

class Ready(_Base, tag="ready"):
    """The session is open."""

    session: str
    program: str | None = None
    tools: list[str] = msgspec.field(default_factory=list)
    limits: dict[str, Any] = msgspec.field(default_factory=dict)


class Token(_Base, tag="token"):
    """A streamed text delta of an assistant turn."""

    session: str
    turn: int
    text: str


class Reasoning(_Base, tag="reasoning"):
    """A streamed delta of the assistant's reasoning (a thinking model's ``<think>`` block)."""

    session: str
    turn: int
    text: str


class ToolCallDelta(_Base, tag="tool_call.delta"):
    """A tool call as it is generated: the first delta of call ``index`` carries its
    ``call_id`` and ``name`` (``arguments`` empty), later ones fragments of its arguments' JSON
    text (``call_id`` repeated, ``name`` empty)."""

    session: str
    turn: int
    index: int
    call_id: str
    name: str = ""
    arguments: str = ""


class ToolCall(_Base, tag="tool_call"):
    """The model called a client tool; answer with ``tool_result``."""

    session: str
    turn: int
    call_id: str
    name: str
    arguments: dict[str, Any]


class Message(_Base, tag="message"):
    """A finished generation (``ttft`` in seconds; token counts)."""

    session: str
    turn: int
    content: str
    finish_reason: str | None
    role: str = "assistant"
    tool_call: ToolCallInfo | None = None
    ttft: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    outputs: dict[str, Any] | None = None


class Error(_Base, tag="error"):
    """A refused message or a failed turn (``code`` from :data:`ERROR_CODES`)."""

    code: str
    message: str
    field: str | None = None
    session: str | None = None


class Done(_Base, tag="done"):
    """The exchange is over (``reason``: turn, cancelled, closed, program, idle_timeout, error)."""

    session: str
    reason: str
    turn: int = 0


ServerMessage = Union[Ready, Token, Reasoning, ToolCallDelta, ToolCall, Message, Error, Done]

_encoder = msgspec.json.Encoder()
_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


def encode(msg: msgspec.Struct) -> bytes:
    """JSON bytes of a message."""
    return _encoder.encode(msg)


def decode_server(data: str | bytes) -> ServerMessage:
    """Parse a server message (client side). Raises ``msgspec.DecodeError``."""
    return _server_decoder.decode(data)


def decode_client(data: str | bytes) -> ClientMessage:
    """Parse a client message; raise :class:`ProtocolError` naming the bad field."""
    try:
        msg = _client_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e), data) from None
    except msgspec.DecodeError as e:
        raise ProtocolError("bad_json", f"malformed JSON: {e}") from None
    except RecursionError:  # NOTE: the server bounds depth first (max_json_depth); belt and braces
        raise ProtocolError("limit.json_depth", "the message nests too deeply") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version", f"protocol version {msg.v} is not supported (this server speaks v{PROTOCOL_VERSION})",
            field="v", session=getattr(msg, "session", None))
    if not msg.session or len(msg.session) > 128:
        raise ProtocolError("bad_message", "session must be a non-empty string of at most 128 characters",
                            field="session")
    return msg


class ProtocolError(Exception):
    """A client message the server refuses; becomes an ``error`` message."""

    def __init__(self, code: str, message: str, field: str | None = None, session: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field
        self.session = session

    def to_message(self) -> Error:
        return Error(code=self.code, message=str(self), field=self.field, session=self.session)


class LimitExceeded(InvalidRequest):
    """A request over one of the server's limits; ``code`` is its ``limit.*`` error code."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message, field)
        self.code = code


_AT = re.compile(r" - at `\$(.*)`$")
_NAMED = re.compile(r"(?:missing required field|unknown field) `([^`]+)`")


def _validation_error(text: str, data: str | bytes) -> ProtocolError:
    """Turn msgspec's ``"Expected `int`, got `str` - at `$.sampling.max_tokens`"`` into an error
    whose field is ``sampling.max_tokens``."""
    m = _AT.search(text)
    path = m.group(1).lstrip(".") if m else ""
    named = _NAMED.search(text)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    session = _peek_session(data)
    if path == "type" and "Invalid value" in text:
        return ProtocolError("unknown_type", f"unknown message type; expected one of {', '.join(CLIENT_TYPES)}",
                             field="type", session=session)
    if "Expected `object`" in text and not path:
        return ProtocolError("bad_message", "a message must be a JSON object", session=session)
    message = _AT.sub("", text)
    return ProtocolError("bad_message", f"{path or 'message'}: {message}", field=path or None, session=session)


def _peek_session(data: str | bytes) -> str | None:
    """The ``session`` of a message that failed validation, if it has a usable one."""
    try:
        obj = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("session"), str):
        return obj["session"][:128]
    return None
