"""Replacing and deleting folders of sgrt's model cache: a damaged or stale entry is renamed aside
(processes that have its files open or mapped keep them) and then deleted. Standard library only,
so the converter, the loader and the tokenizer snapshot share it without importing each other.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from sgrt.errors import ModelLoadError

# errno values of a write to a cache that has no room or is read-only
CACHE_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def set_aside(path: Path, spec: str, why: str = "") -> None:
    """Rename ``path`` (a damaged cache folder or file) to a ``.stale-`` sibling and delete it: a
    process that has its files open or mapped keeps them. ``why``: what is wrong with it, for the
    error.

    Raises:
        ModelLoadError: it cannot be renamed (a read-only cache; names it, ``why`` and the fix).
    """
    stale = path.with_name(f".stale-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, stale)
    except FileNotFoundError:
        return  # (another process set it aside first)
    except OSError as e:
        raise ModelLoadError(f"model {spec!r}: {why + '; ' if why else ''}cannot replace {path} in the cache "
                             f"({e}): delete it, or set SGRT_CACHE_DIR to a writable folder") from e
    delete_path(stale)


def delete_path(path: Path) -> None:
    """Delete a file or a folder tree; what cannot be deleted is left (never an error)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass
