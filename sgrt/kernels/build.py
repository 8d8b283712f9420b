"""Compile-on-first-use loading of sgrt's native CPU operator libraries.

Each library is one C++ file, or several, that registers its operators with ``TORCH_LIBRARY``
(no Python module, so compilation is quick: 10-40 s on 2 cores), compiled with
:data:`INCLUDE_DIR` on the include path (``sgrt/bf16.h``, ``sgrt/raw_calls.h``: what the
libraries share). :func:`load_library` builds it with ``torch.utils.cpp_extension.load`` into
``$SGRT_CACHE_DIR/kernels/<hash>`` (default ``~/.cache/sgrt/kernels/<hash>``); the hash covers
the sources, the headers they may include (:data:`INCLUDE_DIR`'s and the library's own),
torch's version, the flags and the CPU's feature flags (the flags may target this CPU), so a
later process, or another checkout of the same sources, loads the cached ``.so`` in
milliseconds, and a changed header rebuilds every library. A lock file holding the
builder's PID makes concurrent first uses build once (a lock whose process died is taken over),
and a checksum written after each successful build keeps a truncated ``.so`` from being loaded.

``SGRT_NATIVE_KERNELS=0`` in the environment disables every library (the callers then use their
plain-PyTorch paths).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sgrt.paths import cache_root

logger = logging.getLogger("sgrt.kernels")

# at::parallel_for's OpenMP body is inline in torch's headers: -fopenmp compiles it, and since the
# library links no OpenMP runtime of its own, the symbols resolve to the libgomp that torch has
# already loaded (the same thread pool as torch's own ops).
BASE_CFLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fopenmp-simd"]

# The headers every library may include (#include "sgrt/...").
INCLUDE_DIR = Path(__file__).with_name("include")

BUILD_WAIT_S = 600.0  # the longest a process waits for another one's build (then PyTorch ops)

_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # library name -> None (loaded) or the reason it is not
_warned: set[tuple[str, str]] = set()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where that cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    """Where compiled libraries live: ``kernels/`` under sgrt's cache root
    (:func:`sgrt.paths.cache_root`: ``$SGRT_CACHE_DIR`` or ``~/.cache/sgrt``)."""
    return cache_root() / "kernels"


def operator_entry(overload: Any) -> Callable:
    """The C++ entry behind a registered operator overload (``torch.ops.<lib>.<op>.default``),
    where torch exposes it: two Python frames less a call than ``torch.ops.<lib>.<op>(...)``,
    for operators called many times a decode step. Falls back to the overload itself."""
    return getattr(overload, "_op", overload)


def disabled() -> bool:
    """Whether ``SGRT_NATIVE_KERNELS=0`` turns the native libraries off."""
    return os.environ.get("SGRT_NATIVE_KERNELS", "").strip() == "0"


def load_library(name: str, sources: Path | Sequence[Path], cflags: list[str],
                 required_cpu_flags: tuple[str, ...] = (), headers: Sequence[Path] = (),
                 include_dir: Path = INCLUDE_DIR) -> str | None:
    """Compile (or reuse) ``sources`` (one file or several) as library ``name`` and load it into
    this process. ``headers``: the library's own headers beside its sources, which its cache key
    covers as it does ``include_dir``'s (:data:`INCLUDE_DIR`, or another tree's for a bench that
    builds an older commit's sources).

    Returns None once the library's operators are registered, else the reason they are not
    (disabled, a missing CPU feature, or the build / load error), logged once as a warning.
    Never raises. The outcome is cached per process, except that ``SGRT_NATIVE_KERNELS=0`` is
    looked up on every call.
    """
    if disabled():  # checked on every call, so that setting it later turns the libraries off too
        _warn_once(name, "disabled by SGRT_NATIVE_KERNELS=0")
        return "disabled by SGRT_NATIVE_KERNELS=0"
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            files = [sources] if isinstance(sources, Path) else list(sources)
            _loaded[name] = _try_load(name, files, list(headers), include_dir, cflags, required_cpu_flags)
            if _loaded[name] is not None:
                _warn_once(name, _loaded[name])
        return _loaded[name]


def _warn_once(name: str, reason: str) -> None:
    if (name, reason) not in _warned:
        _warned.add((name, reason))
        logger.warning("native library %s unavailable: %s", name, reason)


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` package installs it beside this
    interpreter, which is not on PATH when the virtualenv is not activated."""
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bindir):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _digest(files: list[Path], include_dir: Path, cflags: list[str], flags: set[str]) -> str:
    """The build's cache key: every input file's name and bytes (and ``include_dir``'s headers'),
    torch's version, the flags, the CPU's flags."""
    h = hashlib.sha256()
    for file in files + sorted(include_dir.rglob("*.h")):
        h.update(file.name.encode() + b"\0")
        h.update(hashlib.sha256(file.read_bytes()).digest())
    for part in (torch.__version__, " ".join(BASE_CFLAGS + cflags), " ".join(sorted(flags))):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _try_load(name: str, sources: list[Path], headers: list[Path], include_dir: Path, cflags: list[str],
              required: tuple[str, ...]) -> str | None:
    flags = cpu_flags()
    missing = [f for f in required if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    what = sources[0].name if len(sources) == 1 else f"{sources[0].parent.name}/ ({len(sources)} files)"
    try:
        digest = _digest(sources + headers, include_dir, cflags, flags)
    except OSError as e:
        return f"reading the sources of {what} failed: {e}"
    ext = f"{name}_{digest}"
    build_dir = cache_dir() / digest
    so = build_dir / f"{ext}.so"
    t0 = time.perf_counter()
    try:
        # A complete build loads without the lock (nothing is written: a read-only cache serves it).
        if not _verified(so):
            build_dir.mkdir(parents=True, exist_ok=True)
            with _BuildLock(build_dir / "sgrt-build.lock"):
                if not _verified(so):
                    from sgrt.progress import progress

                    with progress(f"building native kernel {what} (once; cached)"):
                        _build(ext, sources, include_dir, cflags, build_dir, so)
                    logger.info("compiled %s in %.1f s (%s)", what, time.perf_counter() - t0, build_dir)
        torch.ops.load_library(str(so))
    except Exception as e:  # noqa: BLE001 - any build or load failure leaves the plain-PyTorch path
        return f"building or loading {what} failed: {type(e).__name__}: {e}"
    return None


def _verified(so: Path) -> bool:
    """Whether ``so`` is a complete build: its checksum file, written after a build succeeded,
    matches it. A ``.so`` cut short (a build killed while linking) would crash the process on
    loading (SIGBUS), so it is never loaded unchecked."""
    marker = so.with_suffix(".sha256")
    try:
        return marker.read_text().strip() == hashlib.sha256(so.read_bytes()).hexdigest()
    except OSError:
        return False


def _build(ext: str, sources: list[Path], include_dir: Path, cflags: list[str], build_dir: Path, so: Path) -> None:
    """Compile and link with torch's builder (ninja), then write the checksum file."""
    for leftover in (so, so.with_suffix(".sha256"), build_dir / "lock"):
        # torch's own lock is only ever taken under ours, so one here was left by a killed build.
        leftover.unlink(missing_ok=True)
    _put_ninja_on_path()
    from torch.utils import cpp_extension

    cpp_extension.load(name=ext, sources=[str(s) for s in sources], extra_cflags=BASE_CFLAGS + cflags,
                       extra_include_paths=[str(include_dir)], build_directory=str(build_dir),
                       is_python_module=False, verbose=False)
    # NOTE: cpp_extension.load also loaded the library into this process; loading it again
    # below is a no-op.
    so.with_suffix(".sha256").write_text(hashlib.sha256(so.read_bytes()).hexdigest())


class _BuildLock:
    """An exclusive lock file holding the owner's PID, so that one process builds a library at a
    time. A lock whose process is gone (killed mid-build) is taken over; a live owner is waited
    for, at most :data:`BUILD_WAIT_S` seconds (then :class:`TimeoutError`, and the caller keeps
    its PyTorch path), never forever."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_BuildLock":
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if not _owner_alive(self.path):
                    self.path.unlink(missing_ok=True)
                    logger.info("removed the build lock %s of a process that is gone", self.path)
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building for over {BUILD_WAIT_S} s "
                                       f"(lock {self.path})") from None
                time.sleep(0.5)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def _owner_alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return True  # being written right now, or unreadable: treat as held
    if pid <= 0:
        # An empty lock: its owner is between creating and writing it, or died there; give it
        # the benefit of the doubt while it is young.
        try:
            return time.time() - lock.stat().st_mtime < 5
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
