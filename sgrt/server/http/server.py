"""The OpenAI-compatible HTTP API in front of one :class:`sgrt.engine.Engine` (Starlette + uvicorn).

Endpoints (all but ``/health`` need the token when the server has one, as ``Authorization:
Bearer <token>`` or ``x-api-key: <token>``, the header the ``anthropic`` SDK sends):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI's fields (``stream`` as
  server-sent events, ``n``, ``stop``, ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``logprobs`` / ``top_logprobs``, ``response_format``,
  ``tools`` + ``tool_choice``, ``stream_options.include_usage``) and the extras of
  :mod:`sgrt.server.openai.protocol` (``regex``, ``json_schema``, ``grammar``, ``top_k``,
  ``min_p``, ``min_tokens``, ...). Defaults are OpenAI's (``temperature=1``), not the engine's.
- ``GET /v1/models``: the one model; its card has ``owned_by: "sgrt"`` and an ``sgrt`` object
  (version, native endpoints, context length), which is how clients detect an sgrt server.
  Every response also carries an ``x-sgrt-version`` header.
- ``GET /health``: 200 ``{"status": "ok", ...}`` while the engine runs, else 503.
- Native (:mod:`sgrt.server.sglang.endpoints`): ``POST /generate`` (text or token ids, one or a
  batch; prompt log-probabilities; ``max_tokens=0`` is prefill-only), ``/tokenize``,
  ``/detokenize``, ``/apply_chat_template``, ``/flush_cache``, ``/abort_request``; ``GET
  /model_info`` and ``/server_info`` (and their ``/get_*`` names), SGLang's keys, which an SGLang
  router reads.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 (``param``
names the field), 401 (bad or missing token), 404, 413 (body over ``max_body_bytes``), 429
(more than ``max_queue`` engine requests in flight; ``Retry-After: 1``), 500, 503 (the engine
is not running or the server is closing); ``/v1/messages`` answers the same statuses in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``. A stream answers errors that happen before its first
token with the same status codes; later ones arrive as a ``data: {"error": ...}`` event before
``data: [DONE]``.

A client that disconnects (from a stream or while waiting for a plain response) aborts its
engine requests, which frees their KV slots.

Serving: :func:`serve_http` (async; returns a running :class:`HttpServer`), or
:class:`HttpServerThread` (uvicorn on a background thread, for tests and benchmarks). Loopback
(``127.0.0.1``) and port :data:`DEFAULT_PORT` (8000) by default.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, fields
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sgrt.engine.client import EngineClient
from sgrt.server.anthropic import messages as anthropic
from sgrt.server.http import metrics
from sgrt.server.http.core import HttpApi, HttpLimits
from sgrt.server.http.errors import ApiError, ClientGone, api_error_from
from sgrt.server.openai import chat, completions, responses
from sgrt.server.sglang import endpoints as native

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "HttpApi", "HttpLimits", "HttpServer", "HttpServerThread", "create_app",
           "serve_http"]

logger = logging.getLogger("sgrt.server.http")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


# ==== the app =====================================================================================


def create_app(engine: EngineClient, *, model_name: str, auth_token: str | None = None,
               limits: HttpLimits | None = None, model_aliases: Sequence[str] = (), **limit_fields: Any) -> Starlette:
    """The Starlette app of the HTTP API over ``engine``.

    Args:
        engine: a running :class:`~sgrt.engine.client.EngineClient` (not owned: the caller shuts it down).
        model_name: the model id to report; a request's ``model`` must be it or one of
            ``model_aliases`` (or absent), else 404 ``model_not_found`` (SGLang's native
            ``/generate`` excepted: it ignores ``model``, as SGLang does).
        model_aliases: other names the API answers to (``sgrt serve --served-model-name``).
        auth_token: when set, every endpoint but ``/health`` needs it (``Authorization: Bearer`` or ``x-api-key``).
        limits: an :class:`HttpLimits`; or pass its fields as keywords (``max_queue=32``).

    Raises:
        TypeError: an unknown limit keyword.

    ``app.state.api`` is the :class:`HttpApi` (in-flight counts, ``closing``).
    """
    if limit_fields:
        known = {f.name for f in fields(HttpLimits)}
        unknown = sorted(set(limit_fields) - known)
        if unknown:
            raise TypeError(f"create_app() got unknown limit(s) {unknown}; known: {sorted(known)}")
        base = asdict(limits or HttpLimits())
        base.update(limit_fields)
        limits = HttpLimits(**base)
    api = HttpApi(engine, model_name=model_name, auth_token=auth_token, limits=limits, model_aliases=model_aliases)

    def route(handler: Callable[[HttpApi, Request], Any], prompt_field: str) -> Callable[[Request], Any]:
        # Anthropic's Messages API answers errors in its own shape (the anthropic SDK reads it).
        shape = anthropic.error_response if handler is anthropic.create_message else ApiError.response

        async def endpoint(request: Request) -> Any:
            try:
                return await handler(api, request)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the requests were aborted
            except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI- (or Anthropic-) style body
                return shape(api_error_from(exc, prompt_field))
        return endpoint

    table = [  # path, methods, handler(api, request), the field a context-length error names
        ("/v1/chat/completions", ["POST"], chat.chat_completions, "messages"),
        ("/v1/completions", ["POST"], completions.completions, "prompt"),
        ("/v1/responses", ["POST"], responses.create_response, "input"),
        ("/v1/responses/{response_id}", ["GET"], responses.get_response, "input"),
        ("/v1/responses/{response_id}", ["DELETE"], responses.delete_response, "input"),
        ("/v1/messages", ["POST"], anthropic.create_message, "messages"),
        ("/v1/models", ["GET"], HttpApi.models, "prompt"),
        ("/v1/models/{model_id:path}", ["GET"], HttpApi.model_by_id, "prompt"),
        ("/metrics", ["GET"], metrics.metrics_endpoint, "prompt"),
        ("/health", ["GET"], HttpApi.health, "prompt"),
        ("/generate", ["POST"], native.generate, "prompt"),
        ("/tokenize", ["POST"], native.tokenize, "prompt"),
        ("/detokenize", ["POST"], native.detokenize, "prompt"),
        ("/apply_chat_template", ["POST"], native.apply_chat_template, "messages"),
        ("/flush_cache", ["POST"], native.flush_cache, "prompt"),  # a state change: POST only
        ("/abort_request", ["POST"], native.abort_request, "prompt"),
        ("/model_info", ["GET"], native.model_info, "prompt"),
        ("/get_model_info", ["GET"], native.model_info, "prompt"),
        ("/server_info", ["GET"], native.server_info, "prompt"),
        ("/get_server_info", ["GET"], native.server_info, "prompt"),
    ]
    routes = [Route(path, route(handler, field), methods=methods) for path, methods, handler, field in table]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = f"no route {request.method} {request.url.path}" if status == 404 else \
            f"method {request.method} not allowed on {request.url.path}"
        return ApiError(status, message, code="not_found" if status == 404 else "method_not_allowed").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.add_middleware(metrics.RequestCounter, metrics=metrics.metrics_of(api))
    app.add_middleware(FramingGuard)
    app.state.api = api
    return app


# ==== serving =====================================================================================


def guarded_protocol(limits: HttpLimits) -> type:
    """uvicorn's HTTP protocol class with the guards uvicorn lacks:

    - a header timeout: a connection that has not sent a request's complete headers
      ``header_timeout_s`` after it opened, or after its last response, is closed (half-open
      and slow-header clients cannot hold sockets);
    - a connection cap that cannot lock clients out: past ``max_connections`` open connections
      a new one closes the connection that has waited longest for a request's headers (a
      half-open, slow-header or idle keep-alive connection: nothing it sent was authenticated
      yet); only when every connection is busy with a request is the new one refused;
    - a write timeout: a response the client does not read for ``write_timeout_s`` (the
      transport's buffer stays above its high-water mark) ends with the connection, which
      aborts the request's engine work (a stream sees the disconnect).
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None
        _armed_at: float = 0.0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._evict_one():
                logger.warning("refused an HTTP connection: max_connections (%d) open, all busy",
                               limits.max_connections)
                transport.abort()
                return
            super().connection_made(transport)
            self._arm_header_timer()

        # -- waiting for a request's headers ---------------------------------------------------
        def waiting_for_headers(self) -> bool:
            """Whether this connection is between requests (or before its first): it has not
            sent a complete request head since its timer was armed."""
            return (self._header_timer is not None and self.cycle is self._armed_cycle
                    and not self.transport.is_closing())

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest for a request's headers; False
            when every open connection is serving a request."""
            waiting = [c for c in self.connections if isinstance(c, GuardedHTTPProtocol) and c.waiting_for_headers()]
            if not waiting:
                return False
            victim = min(waiting, key=lambda c: c._armed_at)
            victim._disarm_header_timer()
            victim.transport.abort()
            self.connections.discard(victim)  # NOTE: connection_lost comes later (call_soon)
            logger.info("max_connections (%d) open: closed a connection waiting for headers since %.1f s",
                        limits.max_connections, self.loop.time() - victim._armed_at)
            return True

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._armed_cycle = self.cycle
            self._armed_at = self.loop.time()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._armed_cycle and not self.transport.is_closing():
                self.transport.close()  # no new request's headers since armed

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        # -- a client that does not read -------------------------------------------------------
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.write_timeout_s, self._write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timeout(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                logger.warning("closed an HTTP connection whose client read nothing for write_timeout_s (%g s)",
                               limits.write_timeout_s)
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            if getattr(self, "transport", None) is None:  # refused in connection_made
                return
            super().connection_lost(exc)

    return GuardedHTTPProtocol


class FramingGuard:
    """ASGI middleware: a request with both ``Content-Length`` and ``Transfer-Encoding`` is
    answered 400 and its connection closed, unread (RFC 9112, section 6.1: such a message may be
    an attempt at request smuggling; a server that answers it must close the connection). A
    proxy in front that took the other header's framing would otherwise see a different body
    than this server does."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                err = ApiError(400, "the request has both Content-Length and Transfer-Encoding; send one "
                               "(RFC 9112 section 6.1)", param="content-length", code="ambiguous_framing",
                               headers={"connection": "close"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _UvicornServer(uvicorn.Server):
    """uvicorn's server without its signal handling (the host program owns the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield


class HttpServer:
    """A running HTTP API (from :func:`serve_http`): ``url``, ``port``, ``serve_forever()``,
    ``close()``."""

    def __init__(self, app: Starlette, uv_server: Any, task: asyncio.Task, host: str, port: int):
        self.app = app
        self.api: HttpApi = app.state.api
        self._server = uv_server
        self._task = task
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve_forever(self) -> None:
        """Wait until the server stops (``close()`` or a failure)."""
        await asyncio.shield(self._task)

    async def close(self) -> None:
        """Stop accepting requests (503 meanwhile), abort the requests still running (their
        streams end with finish reason ``abort``) and stop (about a second at most)."""
        self.api.closing = True
        self.api.abort_all()
        await asyncio.sleep(0.05)  # let the streams send their last chunks
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await self._task
        self.api.shutdown_workers()


async def serve_http(engine: EngineClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                     auth_token: str | None = None, *, model_name: str | None = None,
                     model_aliases: Sequence[str] = (),
                     log_level: str = "warning", limits: HttpLimits | None = None,
                     sock: socket.socket | None = None, **limit_fields: Any) -> HttpServer:
    """Start the HTTP API on ``host:port`` (``port=0`` picks a free one) and return it running:
    ``await server.serve_forever()`` waits, ``await server.close()`` stops it.

    Args:
        engine: the :class:`sgrt.engine.Engine` (its owner shuts it down).
        auth_token: when set, requests need it (``Authorization: Bearer`` or ``x-api-key``).
        model_name: the model id to report (default: ``engine.info.model_name``).
        model_aliases: other names a request's ``model`` may give (others: 404).
        limits, **limit_fields: :class:`HttpLimits` or its fields (``max_queue=...``).
        sock: a listening socket bound beforehand (``sgrt serve`` binds before loading the model).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    if not _is_loopback(host) and not auth_token:
        logger.warning("serving HTTP on %s without an auth token: anyone who can reach it can use the model",
                       host)
    app = create_app(engine, model_name=model_name or engine.info.model_name, auth_token=auth_token,
                     model_aliases=model_aliases,
                     limits=limits, **limit_fields)
    if sock is None:
        from sgrt.server.sockets import bind_socket

        sock = bind_socket(host, port)
    api: HttpApi = app.state.api
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False,
                            timeout_graceful_shutdown=1, timeout_keep_alive=30,
                            http=guarded_protocol(api.limits), ws="none")
    server = _UvicornServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what failed
            raise OSError(f"the HTTP server on {host}:{port} stopped at start")
        await asyncio.sleep(0.01)
    return HttpServer(app, server, task, host, sock.getsockname()[1])


class HttpServerThread:
    """The HTTP API on a background thread with its own event loop (tests, benchmarks,
    notebooks). ``start()`` returns once it listens; ``stop()`` shuts it down.

    Args: as :func:`serve_http` (``port=0`` picks a free loopback port).
    """

    def __init__(self, engine: EngineClient, host: str = DEFAULT_HOST, port: int = 0, **options: Any):
        self.engine = engine
        self.host = host
        self.port = port
        self.options = options
        self.server: HttpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        assert self.server is not None, "not started"
        return self.server.url

    @property
    def api(self) -> HttpApi:
        assert self.server is not None, "not started"
        return self.server.api

    def start(self) -> "HttpServerThread":
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)

            async def main() -> None:
                try:
                    self.server = await serve_http(self.engine, self.host, self.port, **self.options)
                except BaseException as e:  # noqa: BLE001 - reported by start()
                    self._error = e
                    ready.set()
                    return
                ready.set()
                await self.server.serve_forever()
                # NOTE: uvicorn cancels what outlived its graceful timeout without waiting.
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            try:
                loop.run_until_complete(main())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="sgrt-http", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is None or self.server is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.close(), self._loop)
        with contextlib.suppress(Exception):
            fut.result(timeout=10)
        self._thread.join(timeout=10)

    def __enter__(self) -> "HttpServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
