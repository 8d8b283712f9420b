"""Servers in front of one engine: WebSocket agent sessions (``serve_ws`` / ``run_ws_server``;
protocol in :mod:`sgrt.server.protocol`).

Names are imported on first use, so ``import sgrt.server`` stays cheap.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "WsLimits": "sgrt.server.ws_server",
    "WsServer": "sgrt.server.ws_server",
    "serve_ws": "sgrt.server.ws_server",
    "run_ws_server": "sgrt.server.ws_server",
    "ProgramRegistry": "sgrt.server.programs",
    "PROTOCOL_VERSION": "sgrt.server.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sgrt.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
