"""Where a program's calls go: ``BaseBackend`` and its implementations.

``LocalBackend`` (the in-process engine) imports torch and the engine, so it is loaded on first
use: ``from sgrt.backends import LocalBackend`` works, ``import sgrt.backends`` stays light.
``Runtime`` lives in :mod:`sgrt.runtime` (it starts an HTTP server, so it sits above
``sgrt.server``); its old name here is kept as an alias resolved on first use.
"""
from __future__ import annotations

from typing import Any

from sgrt.backends.base import BaseBackend, ChoiceScore, GenChunk, GenOutput

__all__ = ["BaseBackend", "ChoiceScore", "GenChunk", "GenOutput", "LocalBackend", "Runtime", "RuntimeEndpoint"]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from sgrt.backends.local import LocalBackend

        return LocalBackend
    if name == "Runtime":  # NOTE: an alias for sgrt.runtime.Runtime (above this package)
        from sgrt.runtime import Runtime

        return Runtime
    if name == "RuntimeEndpoint":
        from sgrt.backends.http import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'sgrt.backends' has no attribute {name!r}")
