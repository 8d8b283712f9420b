"""Where a program's calls go: ``BaseBackend`` and its implementations.

``LocalBackend`` / ``Runtime`` (the in-process engine) import torch and the engine, so they are
loaded on first use: ``from sgrt.backends import Runtime`` works, ``import sgrt.backends`` stays
light.
"""
from __future__ import annotations

from typing import Any

from sgrt.backends.base import BaseBackend, ChoiceScore, GenChunk, GenOutput

__all__ = ["BaseBackend", "ChoiceScore", "GenChunk", "GenOutput", "LocalBackend", "Runtime", "RuntimeEndpoint"]


def __getattr__(name: str) -> Any:
    if name in ("LocalBackend", "Runtime"):
        from sgrt.backends import local

        return getattr(local, name)
    if name == "RuntimeEndpoint":
        from sgrt.backends.http import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'sgrt.backends' has no attribute {name!r}")
