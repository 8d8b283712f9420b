"""The WebSocket session server: one :class:`sgrt.engine.Engine` behind a ``websockets`` server.

Start it with :func:`serve_ws` (async; returns the running :class:`WsServer`) or
:func:`run_ws_server` (blocking; what ``sgrt serve`` calls). The protocol is documented in
:mod:`sgrt.server.ws.protocol`; sessions live in :mod:`sgrt.server.ws.chat_session` and
:mod:`sgrt.server.ws.program_session` (their base in :mod:`sgrt.server.ws.session`).

Robustness rules: a bad frame, an unknown message type, a wrong field type or a request over a
limit gets a typed ``error`` and nothing else changes; the connection and every other session
stay up. The only exceptions: an ``unauthorized`` first message (the connection closes, code
1008) and a frame larger than the transport's hard cap (``4 * max_message_bytes``, code 1009).
A client that disconnects aborts its sessions' generations, which frees their KV slots.

Connections that have not authenticated cannot lock anyone out: a connection is *admitted* by
its first valid message (``session.start`` with the auth token when the server has one) and
must send it within ``auth_timeout_s`` of its upgrade (else it closes, code 1008); only
admitted connections count against ``max_connections`` for new upgrades (503 past it), and a
new TCP connection that finds ``max_connections`` open closes the oldest one not admitted yet
(handshaking or silent) instead of waiting for it. A client that reads nothing for
``write_timeout_s`` while the server has a message for it is disconnected.

CPU work of a message runs off the event loop: opening a session (compiling its tools' schemas,
probing the chat template) on a small pool of its own, a turn's tool grammar and prompt on
worker threads.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from sgrt.engine.client import EngineClient
from sgrt.errors import InvalidRequest, SgrtError
from sgrt.server.limits import WsLimits, json_depth, origin_allowed
from sgrt.server.ws import protocol as p
from sgrt.server.ws.chat_session import ChatSession
from sgrt.server.ws.program_session import ProgramSession
from sgrt.server.ws.programs import ProgramRegistry, SessionBackend
from sgrt.server.ws.protocol import LimitExceeded
from sgrt.server.ws.session import Session, SessionContext, error_for

logger = logging.getLogger("sgrt.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


class Connection:
    """One client connection: its sessions and a way to send."""

    def __init__(self, ws: ServerConnection, server: "WsServer"):
        self.ws = ws
        self.server = server
        self.sessions: dict[str, Session] = {}
        self.authed = server.auth_token is None
        self.admitted = False  # its first valid (authenticated) message came: counts as a client
        self.refused = False  # admitted too late: the server already had max_connections clients
        self.closed = False
        self.last_active = time.monotonic()

    async def send(self, msg: Any) -> None:
        """Send one message; a closed connection drops it silently (its sessions are being
        shut down). A client that has not read for ``write_timeout_s`` while this waits for
        room in its socket is disconnected (a stalled reader must not hold its sessions)."""
        if self.closed:
            return
        timeout = self.server.limits.write_timeout_s
        try:
            async with asyncio.timeout(timeout):  # NOTE: no task per message, unlike wait_for
                await self.ws.send(p.encode(msg), text=True)
        except ConnectionClosed:
            self.closed = True
        except asyncio.TimeoutError:
            self.closed = True
            logger.warning("closed a WebSocket connection whose client read nothing for write_timeout_s (%g s)",
                           timeout)
            self.ws.transport.abort()

    async def close_session(self, session: Session, reason: str) -> None:
        """Abort the session's work, forget it and send ``done`` with ``reason``."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            self.server.num_sessions -= 1
        self.last_active = time.monotonic()  # a connection's idle time starts when its last session ends
        await session.shutdown()
        await self.send(p.Done(session=session.id, turn=session.turn, reason=reason))

    async def shutdown(self) -> None:
        """The client went away: abort every session's generation (frees the KV slots)."""
        self.closed = True
        sessions = list(self.sessions.values())
        self.server.num_sessions -= len(sessions)
        self.sessions.clear()
        await asyncio.gather(*(s.shutdown() for s in sessions), return_exceptions=True)


class WsServer:
    """A running session server. Use :func:`serve_ws` to create one.

    Attributes:
        engine: the engine every session submits to.
        limits: :class:`WsLimits`.
        registry: the :class:`ProgramRegistry` built from ``programs_dir``.
        host, port: where it listens (``port`` is the bound one when 0 was asked for).
    """

    def __init__(self, engine: EngineClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 programs_dir: str | Path | None = None, auth_token: str | None = None,
                 limits: WsLimits | None = None, registry: ProgramRegistry | None = None,
                 sock: Any = None):
        self.engine = engine
        self._sock = sock  # a listening socket bound beforehand (sgrt serve binds before loading)
        self.host = host
        self.port = port
        self.auth_token = auth_token or None
        self.limits = limits or WsLimits()
        self.registry = registry if registry is not None else ProgramRegistry.from_dir(programs_dir)
        self.connections: set[Connection] = set()
        self.num_sessions = 0
        self.admitted = 0  # connections admitted (their first valid message came), open
        # TCP connections not admitted yet, oldest first (handshaking, or upgraded and silent)
        self._pending: dict[ServerConnection, float] = {}
        self._server: Server | None = None
        self._reaper: asyncio.Task | None = None
        self._chat_template: Any = None
        # NOTE: its own pool: opening a session with large tools compiles their schemas for
        # seconds; those must not take the default pool's threads that turns' prompts need.
        self._session_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sgrt-ws-session")

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> "WsServer":
        if not _is_loopback(self.host) and self.auth_token is None:
            logger.warning("serving on %s without an auth token: anyone who can reach it can use the model",
                           self.host)
        hard_cap = max(4 * self.limits.max_message_bytes, self.limits.max_message_bytes + 65536)
        where = {"sock": self._sock} if self._sock is not None else {"host": self.host, "port": self.port}
        self._server = await serve(self._handle, **where, max_size=hard_cap,
                                   compression=None, ping_interval=20, ping_timeout=60,
                                   open_timeout=self.limits.open_timeout_s,
                                   process_request=self._check_upgrade,
                                   create_connection=self._connection_class())
        self.port = self._server.sockets[0].getsockname()[1]
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())
        logger.info("sgrt session server on ws://%s:%d (programs: %s)", self.host, self.port,
                    ", ".join(self.registry.names()) or "none")
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, close every connection and abort every session."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for conn in list(self.connections):
            await conn.shutdown()
        self._session_pool.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        await self._server.wait_closed()

    async def __aenter__(self) -> "WsServer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        return {"connections": len(self.connections), "sessions": self.num_sessions, "admitted": self.admitted,
                "pending": len(self._pending)}

    def program_backend(self, on_text: Any) -> SessionBackend:
        """A DSL backend over the engine for one program session (the chat template is derived
        once per server)."""
        if self._chat_template is None:
            from sgrt.backends.local import LocalBackend
            from sgrt.chat_template import chat_template_for

            self._chat_template = chat_template_for(LocalBackend(self.engine))
        return SessionBackend(self.engine, self._chat_template, on_text, self.limits)

    def _session_context(self, conn: "Connection") -> SessionContext:
        """What a session opened on ``conn`` gets: the engine, the limits, ``conn.send`` and
        :meth:`program_backend`."""
        return SessionContext(self.engine, self.limits, conn.send, self.program_backend)

    async def _offload(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the session pool (2 threads), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._session_pool, functools.partial(fn, *args))

    # -- connections not admitted yet -----------------------------------------------------------
    def _connection_class(self) -> type:
        """websockets' connection class, told when a TCP connection opens and closes (so that
        connections are tracked from accept, before any handshake)."""
        server = self

        class TrackedConnection(ServerConnection):
            def connection_made(self, transport: Any) -> None:
                server._on_accept(self)
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                server._pending.pop(self, None)
                super().connection_lost(exc)

        return TrackedConnection

    def _on_accept(self, ws: ServerConnection) -> None:
        """A TCP connection opened: it is pending until admitted. With ``max_connections``
        open, the oldest pending connection is closed to make room (it sent nothing that
        authenticated it, so it cannot hold a place an authenticated client needs)."""
        while self._pending and len(self._pending) + self.admitted >= self.limits.max_connections:
            victim, since = next(iter(self._pending.items()))
            del self._pending[victim]
            logger.info("max_connections (%d) open: closed a connection not authenticated after %.1f s",
                        self.limits.max_connections, time.monotonic() - since)
            if victim.transport is not None:
                victim.transport.abort()
        self._pending[ws] = time.monotonic()

    def _admit(self, conn: Connection) -> bool:
        """Count ``conn`` as a client (its first valid message came); False when the server
        already has ``max_connections`` of them."""
        if self.admitted >= self.limits.max_connections:
            return False
        self._pending.pop(conn.ws, None)
        self.admitted += 1
        conn.admitted = True
        return True

    # -- one connection ------------------------------------------------------------------------
    def _check_upgrade(self, connection: ServerConnection, request: Any) -> Any:
        """Refuse an upgrade from a browser page of a foreign ``Origin`` (403: any web page the
        user opens could otherwise drive the model) and upgrades while ``max_connections``
        connections are admitted (503). No Origin header means a non-browser client: allowed."""
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(origin, self.limits.allowed_origins):
            logger.warning("refused a WebSocket upgrade from Origin %r", origin)
            return connection.respond(403, f"Origin {origin!r} is not allowed; start the server with "
                                      f"--allowed-origin {origin} to allow it\n")
        if self.admitted >= self.limits.max_connections:
            return connection.respond(503, f"too many connections (max_connections "
                                      f"{self.limits.max_connections}); retry later\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws, self)
        self.connections.add(conn)
        deadline = time.monotonic() + self.limits.auth_timeout_s
        try:
            while True:
                if conn.admitted:
                    raw = await ws.recv()
                else:
                    try:
                        raw = await asyncio.wait_for(ws.recv(), max(deadline - time.monotonic(), 0.0))
                    except asyncio.TimeoutError:
                        # NOTE: a silent client may not answer the close handshake either: at
                        # most a second for it, then the socket goes.
                        try:
                            await asyncio.wait_for(ws.close(1008, f"no authenticated first message within "
                                                                  f"auth_timeout_s ({self.limits.auth_timeout_s:g} s)"),
                                                   1.0)
                        except asyncio.TimeoutError:
                            ws.transport.abort()
                        break
                conn.last_active = time.monotonic()
                try:
                    await self._dispatch(conn, raw)
                except ConnectionClosed:
                    raise
                except Exception as exc:  # noqa: BLE001 - never let one message kill the server
                    await conn.send(internal_error(exc))
                if not conn.authed:  # refused first message
                    await ws.close(1008, "unauthorized")
                    break
                if conn.refused:
                    await ws.close(1013, "too many connections; retry later")
                    break
        except ConnectionClosed:
            pass
        finally:
            if conn.admitted:
                self.admitted -= 1
            await conn.shutdown()
            self.connections.discard(conn)

    async def _dispatch(self, conn: Connection, raw: str | bytes) -> None:
        size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_message_bytes:
            await conn.send(p.Error(
                code="limit.message_size",
                message=f"message of {size} bytes exceeds max_message_bytes ({self.limits.max_message_bytes})"))
            return
        try:
            depth = json_depth(raw)
            if depth > self.limits.max_json_depth:
                raise p.ProtocolError("limit.json_depth", f"message nests {depth} levels deep; the limit is "
                                      f"max_json_depth ({self.limits.max_json_depth})")
            msg = p.decode_client(raw)
        except p.ProtocolError as e:
            if not conn.authed:
                await conn.send(p.Error(code="unauthorized", message="the first message must be a valid "
                                        f"session.start carrying auth_token ({e})", field="auth_token"))
                return
            await conn.send(e.to_message())
            return
        if not conn.authed:
            token = getattr(msg, "auth_token", None)
            if not isinstance(msg, p.SessionStart) or token is None or not hmac.compare_digest(
                    token.encode(), self.auth_token.encode()):
                await conn.send(p.Error(code="unauthorized", session=msg.session, field="auth_token",
                                        message="the first message must be session.start with the server's auth_token"))
                return
            conn.authed = True
        if not conn.admitted and not self._admit(conn):
            conn.refused = True
            await conn.send(p.Error(code="limit.connections", session=msg.session, field="session",
                                    message=f"the server already has max_connections "
                                            f"({self.limits.max_connections}) clients; retry later"))
            return
        if isinstance(msg, p.SessionStart):
            await self._start_session(conn, msg)
            return
        session = conn.sessions.get(msg.session)
        if session is None:
            await conn.send(p.Error(code="unknown_session", field="session", session=msg.session,
                                    message=f"no open session {msg.session!r} on this connection"))
            return
        session.touch()
        try:
            if isinstance(msg, p.User):
                await session.on_user(msg)
            elif isinstance(msg, p.ToolResult):
                await session.on_tool_result(msg)
            elif isinstance(msg, p.Cancel):
                await session.on_cancel()
            elif isinstance(msg, p.Close):
                await conn.close_session(session, "closed")
        except (p.ProtocolError, SgrtError) as exc:
            await conn.send(error_for(exc, session.id))

    async def _start_session(self, conn: Connection, msg: p.SessionStart) -> None:
        sid = msg.session
        reserved = False
        try:
            if sid in conn.sessions:
                raise p.ProtocolError("session_exists", f"session {sid!r} is already open", field="session", session=sid)
            if len(conn.sessions) >= self.limits.max_sessions_per_connection:
                raise LimitExceeded("limit.sessions", f"this connection already has max_sessions_per_connection "
                                    f"({self.limits.max_sessions_per_connection}) sessions", field="session")
            if self.num_sessions >= self.limits.max_sessions:
                raise LimitExceeded("limit.sessions", f"the server already has max_sessions "
                                    f"({self.limits.max_sessions}) sessions", field="session")
            # NOTE: the place is taken before the session is built off the loop, so that other
            # connections' session.start cannot pass max_sessions meanwhile.
            self.num_sessions += 1
            reserved = True
            ctx = self._session_context(conn)
            if msg.program is not None:
                program = self.registry.get(msg.program)
                if program is None:
                    known = ", ".join(self.registry.names()) or "none"
                    raise p.ProtocolError("unknown_program", f"no program {msg.program!r} is registered "
                                          f"(registered: {known})", field="program", session=sid)
                session: Session = await self._offload(ProgramSession, sid, ctx, msg, program)
            else:
                if msg.args:
                    raise InvalidRequest("args are for program sessions", field="args")
                # NOTE: checking and compiling the tools' schemas and probing the chat template
                # take seconds for large tools: off the loop.
                session = await self._offload(ChatSession, sid, ctx, msg)
            if conn.closed:  # the client left while the session was being built
                self.num_sessions -= 1
                return
        except (p.ProtocolError, SgrtError) as exc:
            if reserved:
                self.num_sessions -= 1
            await conn.send(error_for(exc, sid))
            return
        except BaseException:
            if reserved:
                self.num_sessions -= 1
            raise
        conn.sessions[sid] = session
        tools = [t.name for t in msg.tools]
        await conn.send(p.Ready(session=sid, program=msg.program, tools=tools, limits=self.limits.to_dict()))
        await session.on_start()

    # -- idle sessions -------------------------------------------------------------------------
    async def _reap_idle(self) -> None:
        timeout = self.limits.idle_timeout_s
        period = max(0.05, min(1.0, timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                for session in list(conn.sessions.values()):
                    if session.idle_for(now) > timeout:
                        await conn.send(p.Error(
                            code="limit.idle_timeout", session=session.id,
                            message=f"session idle for more than idle_timeout_s ({timeout:g} s); closed"))
                        await conn.close_session(session, "idle_timeout")
                if not conn.sessions and now - conn.last_active > timeout and not conn.closed:
                    conn.closed = True
                    asyncio.get_running_loop().create_task(conn.ws.close(1000, "idle timeout"))


def internal_error(exc: BaseException, session: str | None = None) -> p.Error:
    """The ``internal`` error for an unexpected exception: logged with an incident id that the
    message carries; no exception text goes to the client."""
    incident = uuid.uuid4().hex[:12]
    logger.error("error handling a message (incident %s)", incident, exc_info=exc)
    return p.Error(code="internal", session=session,
                   message=f"internal error (incident {incident}; details in the server log)")


async def serve_ws(engine: EngineClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                   programs_dir: str | Path | None = None, auth_token: str | None = None,
                   limits: WsLimits | None = None, sock: Any = None) -> WsServer:
    """Start the session server on ``host:port`` (``port=0`` picks a free one) and return it
    running; ``await server.close()`` stops it, ``await server.serve_forever()`` waits.

    Args:
        engine: the :class:`sgrt.engine.Engine` (its owner shuts it down).
        programs_dir: a folder whose modules' ``@sgrt.function`` programs clients may start.
        auth_token: when set, each connection's first message must carry it.
        limits: :class:`WsLimits` (defaults there).
        sock: a listening socket bound beforehand (then ``host``/``port`` only label it).

    Raises:
        OSError: the address is in use or cannot be bound.
        FileNotFoundError: ``programs_dir`` does not exist.
    """
    server = WsServer(engine, host=host, port=port, programs_dir=programs_dir, auth_token=auth_token,
                      limits=limits, sock=sock)
    return await server.start()


def run_ws_server(engine: EngineClient | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  programs_dir: str | Path | None = None, auth_token: str | None = None,
                  limits: WsLimits | None = None, model: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C); what ``sgrt serve`` runs.

    ``auth_token=None`` falls back to the ``SGRT_AUTH_TOKEN`` environment variable. Without an
    ``engine`` one is created for ``model`` (the default model when None) and shut down at exit.
    """
    if auth_token is None:
        auth_token = os.environ.get("SGRT_AUTH_TOKEN") or None
    own = engine is None
    if own:
        from sgrt.engine import Engine

        engine = Engine(model=model) if model else Engine()

    async def main() -> None:
        server = await serve_ws(engine, host, port, programs_dir, auth_token, limits)
        print(f"sgrt: serving sessions on {server.url}"
              f" (programs: {', '.join(server.registry.names()) or 'none'})", flush=True)
        try:
            await server.serve_forever()
        finally:
            await server.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        if own:
            engine.shutdown()


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
