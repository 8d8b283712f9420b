"""Where sgrt keeps files between runs (GGUF conversions, compiled kernels), and how a child
process runs this same sgrt.

Below both :mod:`sgrt.models` and :mod:`sgrt.kernels`, so neither imports the other for it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``."""
    if cache_dir is None:
        cache_dir = os.environ.get("SGRT_CACHE_DIR") or Path.home() / ".cache" / "sgrt"
    return Path(cache_dir).expanduser()


def python_child(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``python -m module args...`` on this sgrt (its root
    first on ``PYTHONPATH``: a checkout that is not installed too), offline from the model hub."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return [sys.executable, "-m", module, *args], env
