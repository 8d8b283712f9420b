"""Where sgrt keeps files between runs (GGUF conversions, compiled kernels).

Below both :mod:`sgrt.models` and :mod:`sgrt.kernels`, so neither imports the other for it.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``."""
    if cache_dir is None:
        cache_dir = os.environ.get("SGRT_CACHE_DIR") or Path.home() / ".cache" / "sgrt"
    return Path(cache_dir).expanduser()
