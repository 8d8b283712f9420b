"""Servers in front of one engine: WebSocket agent sessions (``serve_ws`` / ``run_ws_server``;
protocol in :mod:`sgrt.server.ws.protocol`), the OpenAI-compatible HTTP API (``serve_http``), and
``run_server``, which runs both (``sgrt serve``).

Names are imported on first use, so ``import sgrt.server`` stays cheap.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "WsLimits": "sgrt.server.limits",
    "WsServer": "sgrt.server.ws.server",
    "serve_ws": "sgrt.server.ws.server",
    "run_ws_server": "sgrt.server.ws.server",
    "ProgramRegistry": "sgrt.server.ws.programs",
    "PROTOCOL_VERSION": "sgrt.server.ws.protocol",
    "run_server": "sgrt.server.serve",
    "serve_http": "sgrt.server.http.server",
    "create_app": "sgrt.server.http.server",
    "HttpServer": "sgrt.server.http.server",
    "HttpServerThread": "sgrt.server.http.server",
    "HttpLimits": "sgrt.server.limits",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sgrt.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
