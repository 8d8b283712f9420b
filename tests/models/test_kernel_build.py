"""sgrt/kernels/build.py's guards around the compiled libraries (no compilation here): a cached
library is loaded only with a matching checksum, and a build lock left by a dead process is
taken over while a live owner is waited for with a deadline, never forever."""
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
