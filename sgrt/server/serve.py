"""``sgrt serve``: the WebSocket session server and the OpenAI-compatible HTTP API, side by
side on two loopback ports, in front of one engine.

The listening sockets are bound before the model loads (:func:`bind_listeners`), so a port in
use is reported at once; :func:`add_limit_args` / :func:`limits_from_args` give ``sgrt serve``
one flag per server limit (:class:`~sgrt.server.http.core.HttpLimits`,
:class:`~sgrt.server.ws.server.WsLimits`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgrt.server.sockets import bind_socket  # noqa: F401 - also re-exported

if TYPE_CHECKING:  # NOTE: the CLI binds its ports before torch (and the engine) is imported
    from sgrt.engine.client import EngineClient


@dataclass
class Listeners:
    """Sockets bound (and listening) before the model loads: ``ws`` always, ``http`` unless
    the HTTP API is off."""

    ws: socket.socket
    http: socket.socket | None = None

    def close(self) -> None:
        for s in (self.ws, self.http):
            if s is not None:
                s.close()


def bind_listeners(host: str, port: int, http_port: int | None) -> Listeners:
    """Bind the WebSocket port and (unless ``http_port`` is None) the HTTP port; on a failure
    nothing stays bound. Raises ``OSError`` naming the address."""
    ws = bind_socket(host, port)
    try:
        http = bind_socket(host, http_port) if http_port is not None else None
    except OSError:
        ws.close()
        raise
    return Listeners(ws, http)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``ArgumentTypeError`` otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def port_number(text: str) -> int:
    """argparse type of a TCP port (0-65535)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0..65535, got {value}")
    return value


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """``sgrt serve``'s server-limit flags (each help text shows its default)."""
    from sgrt.server.limits import HttpLimits, WsLimits

    h, w = HttpLimits(), WsLimits()
    g = p.add_argument_group("server limits")
    g.add_argument("--default-max-tokens", type=positive_int, default=None,
                   help="max_tokens of an HTTP request that sets none (default: the rest of the context "
                        f"window); WebSocket turns use --ws-default-max-tokens")
    g.add_argument("--max-tokens-limit", type=positive_int, default=None,
                   help="ceiling on any HTTP request's max_tokens (default: the context window)")
    g.add_argument("--ws-default-max-tokens", type=positive_int, default=w.default_max_tokens,
                   help="max_tokens of a WebSocket turn that sets none (default: %(default)s)")
    g.add_argument("--ws-max-tokens-per-turn", type=positive_int, default=w.max_tokens_per_turn,
                   help="ceiling on a WebSocket turn's (or a program gen's) max_tokens (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=positive_int, default=h.max_body_bytes,
                   help="largest HTTP request body, bytes; larger: 413 (default: %(default)s)")
    g.add_argument("--max-message-bytes", type=positive_int, default=w.max_message_bytes,
                   help="largest WebSocket frame, bytes (default: %(default)s)")
    g.add_argument("--max-json-depth", type=positive_int, default=h.max_json_depth,
                   help="deepest nesting of arrays/objects in a body or frame (default: %(default)s)")
    g.add_argument("--max-queue", type=positive_int, default=h.max_queue,
                   help="HTTP engine requests in flight; more: 429 (default: %(default)s)")
    g.add_argument("--max-sessions", type=positive_int, default=w.max_sessions,
                   help="open WebSocket sessions, whole server (default: %(default)s)")
    g.add_argument("--max-connections", type=positive_int, default=h.max_connections,
                   help="open connections per server (HTTP and WebSocket each); past it a new connection "
                        "closes the oldest one not yet authenticated (HTTP: waiting for a request's headers), "
                        "and is refused only when there is none (default: %(default)s)")
    g.add_argument("--auth-timeout", type=_positive_float, default=w.auth_timeout_s, metavar="SECONDS",
                   help="time for a WebSocket connection to send its first message (session.start with the "
                        "auth token) after the upgrade; slower: closed (default: %(default)s)")
    g.add_argument("--write-timeout", type=_positive_float, default=h.write_timeout_s, metavar="SECONDS",
                   help="a client that reads nothing this long while the server has data for it is "
                        "disconnected and its requests aborted (default: %(default)s)")
    g.add_argument("--max-stop", type=positive_int, default=h.max_stop,
                   help="stop strings of one request (default: %(default)s)")
    g.add_argument("--max-stop-chars", type=positive_int, default=h.max_stop_chars,
                   help="characters of a request's stop strings together (default: %(default)s)")
    g.add_argument("--max-stop-token-ids", type=positive_int, default=h.max_stop_token_ids,
                   help="stop_token_ids of one HTTP request (default: %(default)s)")
    g.add_argument("--max-logit-bias", type=positive_int, default=h.max_logit_bias,
                   help="logit_bias entries of one HTTP request (default: %(default)s)")
    g.add_argument("--max-messages", type=positive_int, default=h.max_messages,
                   help="messages (or Responses input items, a stored conversation included) of one HTTP "
                        "request (default: %(default)s)")
    g.add_argument("--max-tools", type=positive_int, default=None,
                   help=f"tools of one request or session (default: {h.max_tools} for HTTP, {w.max_tools} "
                        "for WebSocket sessions)")
    g.add_argument("--max-store-bytes", type=positive_int, default=h.max_store_bytes,
                   help="bytes of stored responses (the Responses API's store=true), least recently used "
                        "dropped first (default: %(default)s)")
    g.add_argument("--header-timeout", type=_positive_float, default=h.header_timeout_s, metavar="SECONDS",
                   help="time for a connection to send a request's headers (the WebSocket upgrade "
                        "included) before it is closed (default: %(default)s)")
    g.add_argument("--body-timeout", type=_positive_float, default=h.body_timeout_s, metavar="SECONDS",
                   help="time to receive a whole HTTP request body; slower: 408 (default: %(default)s)")
    g.add_argument("--idle-timeout", type=_positive_float, default=w.idle_timeout_s, metavar="SECONDS",
                   help="a WebSocket session without messages is closed after this (default: %(default)s)")
    g.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser Origin (scheme://host[:port]) allowed besides loopback pages; "
                        "repeat for more, '*' allows any (default: loopback only)")


def limits_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(HttpLimits, WsLimits)`` from :func:`add_limit_args`'s flags."""
    from sgrt.server.limits import HttpLimits, WsLimits

    origins = tuple(args.allowed_origin)
    http = HttpLimits(max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                      max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                      max_json_depth=args.max_json_depth, header_timeout_s=args.header_timeout,
                      body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                      allowed_origins=origins, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                      max_stop_token_ids=args.max_stop_token_ids, max_logit_bias=args.max_logit_bias,
                      max_messages=args.max_messages, write_timeout_s=args.write_timeout,
                      max_store_bytes=args.max_store_bytes,
                      **({"max_tools": args.max_tools} if args.max_tools is not None else {}))
    ws = WsLimits(max_message_bytes=args.max_message_bytes, max_sessions=args.max_sessions,
                  max_tokens_per_turn=args.ws_max_tokens_per_turn,
                  default_max_tokens=min(args.ws_default_max_tokens, args.ws_max_tokens_per_turn),
                  idle_timeout_s=args.idle_timeout, max_json_depth=args.max_json_depth,
                  open_timeout_s=args.header_timeout, max_connections=args.max_connections,
                  allowed_origins=origins, auth_timeout_s=args.auth_timeout, max_stop=args.max_stop,
                  max_stop_chars=args.max_stop_chars, write_timeout_s=args.write_timeout,
                  **({"max_tools": args.max_tools} if args.max_tools is not None else {}))
    return http, ws


def run_server(engine: EngineClient, host: str = "127.0.0.1", port: int = 8765, http_port: int | None = 8000,
               programs_dir: str | Path | None = None, auth_token: str | None = None,
               model_name: str | None = None, http_limits: Any = None, ws_limits: Any = None,
               model_aliases: Sequence[str] = (),
               listeners: Listeners | None = None) -> None:
    """Serve sessions on ``ws://host:port`` and, unless ``http_port`` is None, the HTTP API on
    ``http://host:http_port/v1``, until interrupted (Ctrl-C).

    ``auth_token=None`` falls back to ``SGRT_AUTH_TOKEN``; when set, WebSocket clients send it in
    their first message and HTTP clients as ``Authorization: Bearer <token>`` (or ``x-api-key: <token>``). ``listeners``:
    sockets bound beforehand (:func:`bind_listeners`); otherwise they are bound here.
    ``http_limits`` / ``ws_limits``: :class:`HttpLimits` / :class:`WsLimits` (defaults there).
    ``model_name`` / ``model_aliases``: the names the HTTP API reports and answers to (a request
    naming another model: 404 ``model_not_found``).

    Raises:
        OSError: a port is in use or cannot be bound.
    """
    from sgrt.server.http.server import serve_http
    from sgrt.server.ws.server import serve_ws

    if auth_token is None:
        auth_token = os.environ.get("SGRT_AUTH_TOKEN") or None
    if listeners is None:
        listeners = bind_listeners(host, port, http_port)

    async def main() -> None:
        ws = await serve_ws(engine, host, port, programs_dir, auth_token, ws_limits, sock=listeners.ws)
        servers = [ws]
        print(f"sgrt: sessions on {ws.url} (programs: {', '.join(ws.registry.names()) or 'none'})", flush=True)
        try:
            if listeners.http is not None:
                http = await serve_http(engine, host, http_port, auth_token=auth_token, model_name=model_name,
                                        model_aliases=model_aliases,
                                        limits=http_limits, sock=listeners.http)
                servers.append(http)
                print(f"sgrt: OpenAI-compatible API on {http.url}/v1", flush=True)
            await asyncio.gather(*(s.serve_forever() for s in servers))
        finally:
            for s in reversed(servers):
                await s.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        listeners.close()
