"""Progress lines for long waits (model load, GGUF conversion, kernel builds, grammar compiles).

:func:`progress` shows a tqdm line with the elapsed time while its block runs, only where a
person watches: stderr is a terminal, and neither ``set_progress(False)`` (``sgrt --quiet``) nor
``SGRT_PROGRESS=0`` turned it off. Otherwise it prints nothing.
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

_enabled: bool | None = None  # None: decide from the environment and the terminal


def set_progress(enabled: bool | None) -> None:
    """Force progress lines on or off (None: on when stderr is a terminal)."""
    global _enabled
    _enabled = enabled


def progress_enabled() -> bool:
    """Whether :func:`progress` shows anything now."""
    if _enabled is not None:
        return _enabled
    if os.environ.get("SGRT_PROGRESS", "").strip() == "0":
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextmanager
def progress(desc: str) -> Iterator[None]:
    """Show ``desc`` and the elapsed time on stderr while the block runs (see module doc)."""
    if not progress_enabled():
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=None, desc=f"[sgrt] {desc}", bar_format="{desc}: {elapsed}", file=sys.stderr, leave=True)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.25):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="sgrt-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
