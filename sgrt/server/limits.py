"""The servers' limits (:class:`HttpLimits`, :class:`WsLimits`) and the checks every server
applies where a request is parsed, before the engine or any native code
sees it: the nesting depth of a JSON body or frame. The ranges of the numeric sampling fields
(a seed must fit torch's 64-bit generator; a temperature must be finite) are checked by
:class:`sgrt.sampling_params.SamplingParams` itself when a request's params are built; their
names are re-exported here.

Each check raises :class:`sgrt.errors.InvalidRequest` naming the field and the limit; the HTTP
API answers it with 400, the WebSocket server with an ``error`` (code ``invalid_request``).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable

from sgrt.errors import InvalidRequest

#: Default bound on the nesting depth of a request body or WebSocket frame (arrays and objects).
#: A JSON Schema or a chat message needs far less; deeper input only exercises recursion.
DEFAULT_MAX_JSON_DEPTH = 64
#: Default bounds on what a request may ask the engine to check on every token (stop strings and
#: stop token ids) and on the lists whose size sets the CPU cost of rendering a prompt. OpenAI
#: allows 4 stop strings; 64 leaves room for agent frameworks that send one per tool or role.
DEFAULT_MAX_STOP = 64
DEFAULT_MAX_STOP_CHARS = 8192  # the stop strings' characters together
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_LOGIT_BIAS = 1024  # entries of logit_bias (refused as unsupported after this check)
DEFAULT_MAX_MESSAGES = 4096  # messages (or input items) of one request, a stored conversation included
DEFAULT_WRITE_TIMEOUT_S = 30.0

# NOTE: the two servers' limit dataclasses live here, free of heavy imports, so that `sgrt serve`
# can build its flags (with their defaults) and bind its ports before torch and the model load.
@dataclass
class HttpLimits:
    """Per-server limits (sizes in bytes, lengths in tokens). Going over one is a 4xx that names
    the field and the limit; nothing else changes."""

    max_body_bytes: int = 4 << 20  # one request body
    max_queue: int = 256  # engine requests from HTTP in flight (running + waiting); over: 429
    max_n: int = 16  # choices per request (n times the number of prompts)
    max_tokens_limit: int | None = None  # ceiling on max_tokens (None: the context window)
    # max_tokens of an HTTP request that sets none (None: the rest of the window for the OpenAI
    # endpoints, the engine's default (128) for /generate)
    default_max_tokens: int | None = None
    max_tools: int = 64
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # nesting of a body's arrays/objects; over: 400
    header_timeout_s: float = 10.0  # from connect (or the last response) to a request's full headers
    body_timeout_s: float = 30.0  # to read a whole request body once its headers arrived; over: 408
    # open HTTP connections; past it a new one closes the oldest connection that is waiting for a
    # request's headers (idle or half-open), and only when none is waiting is the new one refused
    max_connections: int = 1024
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed besides loopback ones ("*": any)
    max_stop: int = DEFAULT_MAX_STOP  # stop strings of one request; over: 400
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS  # their characters together; over: 400
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS  # over: 400
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # logit_bias entries; over: 400
    max_messages: int = DEFAULT_MAX_MESSAGES  # messages / input items of one request; over: 400
    # a response the client does not read for this long (the socket's send buffer stays full) is
    # cut: the connection is closed and its requests aborted
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    max_store_bytes: int = 64 << 20  # the Responses API's store of responses, in (encoded) bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WsLimits:
    """Per-server limits (sizes in bytes, lengths in tokens, times in seconds). Going over any
    of them gets a typed ``error`` (code ``limit.*``); the connection stays up."""

    max_message_bytes: int = 1 << 20  # one client frame
    max_sessions: int = 256  # open sessions, whole server
    max_sessions_per_connection: int = 32
    max_generations_per_session: int = 8  # engine requests a program session has in flight
    max_tokens_per_turn: int = 1024  # sampling.max_tokens ceiling (chat turn or one gen)
    default_max_tokens: int = 256  # when the client sets no max_tokens
    max_tools: int = 32  # tools per session
    max_tool_rounds: int = 8  # tool calls answered within one user turn
    idle_timeout_s: float = 300.0  # a session (or session-less connection) without messages
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # nesting of a frame's arrays/objects
    open_timeout_s: float = 10.0  # TCP connect to a finished WebSocket handshake (request headers)
    # a finished handshake to an accepted first message (session.start with the auth token, or
    # any message when the server has no token); slower: closed (code 1008)
    auth_timeout_s: float = 5.0
    # connections, handshaking or open; past it a new connection closes the oldest one that has
    # not authenticated yet; when all have, upgrades get HTTP 503
    max_connections: int = 1024
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed besides loopback ones ("*": any)
    max_stop: int = DEFAULT_MAX_STOP  # sampling.stop strings; over: limit.stop
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS  # their characters together; over: limit.stop
    # a client that reads nothing for this long while the server has a message for it is
    # disconnected (its sessions' generations aborted)
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: linear, no per-char alternation
_OPEN = frozenset(b"[{")
_KEEP = bytes(range(256)).translate(None, b"[]{}")  # every byte but brackets: deleted below


def json_depth(data: bytes | str) -> int:
    """Deepest nesting of arrays/objects in JSON text, without parsing it (strings skipped).

    Linear in ``len(data)`` and done in C (regex, ``bytes.translate``, numpy), so a 4 MB body
    costs a few ms. Malformed text gets a best-effort figure; the parser then refuses it.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if b"[" not in raw and b"{" not in raw:
        return 0
    brackets = _STRING.sub(b"", raw).translate(None, _KEEP)
    if not brackets:
        return 0
    import numpy as np  # NOTE: imported here: `sgrt serve` reads this module before binding its ports

    arr = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((arr == ord("[")) | (arr == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def check_count(items: Any, limit: int, name: str, field: str,
                error: Callable[..., InvalidRequest] = InvalidRequest) -> None:
    """Raise ``error`` (an :class:`InvalidRequest`, or a subclass such as the WebSocket's
    ``LimitExceeded``) when the list or dict ``items`` has more than ``limit`` entries; the
    message names the field, the count and the limit (``name``, its flag's setting)."""
    if items is not None and len(items) > limit:
        raise error(f"{field} has {len(items)} entries; the limit is {name} ({limit})", field=field)


def check_stop(stop: Any, max_stop: int, max_stop_chars: int, field: str = "stop",
               error: Callable[..., InvalidRequest] = InvalidRequest) -> None:
    """Bound the stop strings of one request: at most ``max_stop`` of them and
    ``max_stop_chars`` characters together (each one is matched on every token the request
    generates). A value that is not a string or a list is left to the field's own type check.

    Raises:
        InvalidRequest: (``error``) naming ``field`` and the limit.
    """
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        return
    check_count(items, max_stop, "max_stop", field, error)
    chars = sum(len(s) for s in items if isinstance(s, str))
    if chars > max_stop_chars:
        raise error(f"{field} holds {chars} characters; the limit is max_stop_chars ({max_stop_chars})", field=field)


def check_json_depth(data: bytes | str, limit: int, what: str = "request body") -> None:
    """Raise :class:`InvalidRequest` when ``data`` nests deeper than ``limit``."""
    depth = json_depth(data)
    if depth > limit:
        raise InvalidRequest(f"{what} nests {depth} levels deep; the limit is max_json_depth ({limit})",
                             field="body")


# NOTE: the ranges of the numeric sampling fields are SamplingParams' own check (run when one is
# built); the names stay importable from here.
from sgrt.sampling_params import (  # noqa: E402
    FLOAT_FIELD_INT_MAX, INT_FIELD_MAX, SEED_MAX, SEED_MIN, check_sampling_ranges,
)


def is_loopback_origin(origin: str) -> bool:
    """Whether a browser ``Origin`` (``scheme://host[:port]``) is a page served from this machine
    (``localhost``, ``127.0.0.0/8``, ``[::1]``). ``null`` (a file or sandboxed page) is not."""
    from urllib.parse import urlsplit
    import ipaddress

    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str, allowed: tuple[str, ...] | list[str] = ()) -> bool:
    """Whether a request carrying this ``Origin`` header may proceed: loopback origins always,
    others only when listed in ``allowed`` (exact ``scheme://host[:port]``, case-insensitive,
    or ``"*"`` for any). Requests without an Origin header (non-browser clients) are not
    checked by this function's callers."""
    if is_loopback_origin(origin):
        return True
    norm = origin.strip().rstrip("/").lower()
    return any(a == "*" or a.strip().rstrip("/").lower() == norm for a in allowed)
