"""What was computed from a file's bytes, kept beside the file's ``stat`` so that a later load of
the unchanged file does not read it again (a cache entry's digest, a packaged GGUF's sha256).

A stamp is the file's resolved path, size, mtime, ctime, inode and device: any write to the file
changes its ctime (which no user call can set back), a copy or a replacement its inode. Memos
live under ``<cache root>/keys/`` as small JSON files, written by rename; a cache that cannot be
written keeps none (the work is redone every time, never an error). Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from sgrt.paths import cache_root

MEMO_DIR = "keys"


def stat_stamp(path: Path) -> list[Any]:
    """``[resolved path, size, mtime_ns, ctime_ns, inode, device]`` of ``path``.

    Raises:
        OSError: it cannot be stat'ed.
    """
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def memo_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The memo file for ``name`` (any text: a path, a package): ``<cache root>/keys/<hash>.json``."""
    return cache_root(cache_dir) / MEMO_DIR / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.json"


def read_memo(memo: Path, stamp: Any) -> Any:
    """The value kept in ``memo`` under exactly ``stamp``, or None (absent, unreadable, another
    stamp)."""
    try:
        kept = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("stamp") != stamp:
        return None
    return kept.get("value")


def write_memo(memo: Path, stamp: Any, value: Any) -> None:
    """Keep ``value`` (JSON) in ``memo`` under ``stamp``; a cache that cannot be written is left
    as it is."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".tmp-{memo.name}-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"stamp": stamp, "value": value}))
        os.replace(tmp, memo)
    except OSError:
        pass
