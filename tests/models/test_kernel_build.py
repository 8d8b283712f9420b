"""sgrt/kernels/build.py's guards around the compiled libraries (no compilation here beyond the
session's own build of the WOQ library): a cached library is loaded only with a matching checksum,
and without the build lock (a read-only cache keeps its kernels); a build lock left by a dead
process is taken over while a live owner is waited for with a deadline, never forever."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from sgrt.kernels import build


def test_a_truncated_library_is_not_loaded(tmp_path):
    so = tmp_path / "lib_x.so"
    so.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    assert not build._verified(so)  # no checksum file: an unfinished or foreign build
    so.with_suffix(".sha256").write_text(hashlib.sha256(so.read_bytes()).hexdigest())
    assert build._verified(so)
    with open(so, "r+b") as f:
        f.truncate(100)  # a build killed while linking
    assert not build._verified(so)


def test_a_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = tmp_path / "sgrt-build.lock"
    lock.write_text(dead.stdout.strip())
    with build._BuildLock(lock):
        assert lock.read_text() == str(os.getpid())
    assert not lock.exists()


def test_a_live_owner_is_waited_for_with_a_deadline(tmp_path, monkeypatch):
    lock = tmp_path / "sgrt-build.lock"
    lock.write_text(str(os.getppid()))  # a live process that is not us
    monkeypatch.setattr(build, "BUILD_WAIT_S", 1.0)
    with pytest.raises(TimeoutError, match="another process has been building"):
        with build._BuildLock(lock):
            pass
    assert lock.exists()  # not ours to remove


def test_a_built_library_loads_where_nothing_can_be_written(tmp_path):
    """A library already built and checked loads without the build lock, so a read-only cache
    (a warm load writes nothing) keeps its native kernels: here every lock file fails as on a
    read-only file system, in a process of its own."""
    from sgrt.kernels import woq

    if not woq.available():
        pytest.skip("the native kernel does not build here")
    code = ("import errno\n"
            "from sgrt.kernels import build, woq\n"
            "def refuse(self):\n"
            "    raise OSError(errno.EROFS, 'Read-only file system', str(self.path))\n"
            "build._BuildLock.__enter__ = refuse\n"
            "print(woq.available(), woq.isa())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(woq.isa())]
