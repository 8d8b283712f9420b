"""Build outlines-core indexes in a child process that can be killed.

outlines-core has pathological inputs: a bounded string at the top level of a schema
(``{"type": "string", "maxLength": 32}``) takes minutes and gigabytes to index with a 49k
vocabulary, and the Rust code cannot be interrupted from a thread. So the index is built by a
child Python process (``python -c``, importing only ``outlines_core``), under an address-space
limit, and killed when it runs past the compile time limit; the result comes back pickled
(``Index`` supports pickling). The child is started on first use and reused.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from sgrt.errors import GrammarError

# Address-space limit of the child, bytes.
WORKER_MEMORY_LIMIT = 4 << 30

_CHILD = r"""
import os, pickle, resource, struct, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import outlines_core
inp, out = sys.stdin.buffer, sys.stdout.buffer
def read():
    head = inp.read(8)
    if len(head) < 8:
        sys.exit(0)
    return pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
def write(obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack("<Q", len(data)) + data)
    out.flush()
eos, table = read()
vocabulary = outlines_core.Vocabulary(eos, table)
write(("ready", None))
while True:
    regex = read()
    try:
        write(("ok", outlines_core.Index(regex, vocabulary)))
    except MemoryError:
        write(("err", "ran out of memory (limit %d MiB)" % (limit >> 20)))
    except Exception as e:
        write(("err", "%s: %s" % (type(e).__name__, e)))
"""


class IndexWorker:
    """A reusable child process that turns regexes into ``outlines_core.Index`` objects."""

    def __init__(self, eos_token_id: int, table: dict[bytes, list[int]], memory_limit: int = WORKER_MEMORY_LIMIT):
        self._payload = (eos_token_id, table)
        self._memory_limit = memory_limit
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def build(self, regex: str, timeout_s: float, field: str) -> Any:
        """The index for ``regex``.

        Raises:
            GrammarError: (field ``field``) outlines-core failed, ran out of memory, or took
                longer than ``timeout_s`` (the child is then killed).
        """
        with self._lock:
            deadline = time.monotonic() + timeout_s
            proc = self._ensure(deadline)
            self._send(proc, regex)
            status, value = self._receive(proc, deadline, field)
        if status != "ok":
            raise GrammarError(f"{field} could not be compiled (outlines-core): {value}", field=field)
        return value

    def close(self) -> None:
        """Stop the child process (a later :meth:`build` starts a new one)."""
        with self._lock:
            self._kill()

    # ---- internals ------------------------------------------------------------------------

    def _ensure(self, deadline: float) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(self._memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        self._send(self._proc, self._payload)
        status, _ = self._receive(self._proc, deadline + 30.0, "regex")
        if status != "ready":
            self._kill()
            raise GrammarError("the outlines-core worker process did not start", field="regex")
        return self._proc

    @staticmethod
    def _send(proc: subprocess.Popen, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        assert proc.stdin is not None
        proc.stdin.write(struct.pack("<Q", len(data)) + data)
        proc.stdin.flush()

    def _receive(self, proc: subprocess.Popen, deadline: float, field: str) -> tuple[str, Any]:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        head = self._read_exact(proc, fd, 8, deadline, field)
        body = self._read_exact(proc, fd, struct.unpack("<Q", head)[0], deadline, field)
        return pickle.loads(body)

    def _read_exact(self, proc: subprocess.Popen, fd: int, n: int, deadline: float, field: str) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._kill()
                raise GrammarError(f"{field} took too long to compile (outlines-core); the worker was stopped", field=field)
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                code = proc.poll()
                self._kill()
                raise GrammarError(f"the outlines-core worker died (exit code {code}; out of memory?)", field=field)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
