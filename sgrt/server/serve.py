"""``sgrt serve``: the WebSocket session server and the OpenAI-compatible HTTP API, side by
side on two loopback ports, in front of one engine."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any


def run_server(engine: Any, host: str = "127.0.0.1", port: int = 8765, http_port: int | None = 8000,
               programs_dir: str | Path | None = None, auth_token: str | None = None,
               model_name: str | None = None) -> None:
    """Serve sessions on ``ws://host:port`` and, unless ``http_port`` is None, the HTTP API on
    ``http://host:http_port/v1``, until interrupted (Ctrl-C).

    ``auth_token=None`` falls back to ``SGRT_AUTH_TOKEN``; when set, WebSocket clients send it in
    their first message and HTTP clients as ``Authorization: Bearer <token>``.

    Raises:
        OSError: a port is in use or cannot be bound.
    """
    from sgrt.server.http_api import serve_http
    from sgrt.server.ws_server import serve_ws

    if auth_token is None:
        auth_token = os.environ.get("SGRT_AUTH_TOKEN") or None

    async def main() -> None:
        ws = await serve_ws(engine, host, port, programs_dir, auth_token)
        servers = [ws]
        print(f"sgrt: sessions on {ws.url} (programs: {', '.join(ws.registry.names()) or 'none'})", flush=True)
        try:
            if http_port is not None:
                http = await serve_http(engine, host, http_port, auth_token=auth_token, model_name=model_name)
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
