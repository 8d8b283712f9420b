"""``sgrt serve`` as a child process for the tests that test the process: it binds ports the OS
picks (``--port 0 --http-port 0``), prints where it listens, and writes its log to a file the
test can read (tracebacks, incidents). Imported by the test modules that need it."""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class ServeProcess:
    """``python -m sgrt.cli serve <args>`` with both ports chosen by the OS.

    Attributes:
        ws_url: ``ws://127.0.0.1:<port>``; ``http_host`` / ``http_port``: the HTTP API.
        log_path: the process's stderr (sgrt's log).
    """

    def __init__(self, args: list[str], log_path: Path, start_timeout: float = 600.0):
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "sgrt.cli", "serve", "--port", "0", "--http-port", "0", "--quiet", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.ws_url = ""
        self.http_host, self.http_port = "127.0.0.1", 0
        deadline = time.monotonic() + start_timeout
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"sessions on (ws://\S+)", line):
                self.ws_url = m.group(1)
            if m := re.search(r"API on http://([^:]+):(\d+)/v1", line):
                self.http_host, self.http_port = m.group(1), int(m.group(2))
                break
            if time.monotonic() > deadline:
                break
        if not self.http_port:
            self.stop()
            raise RuntimeError(f"sgrt serve did not start: {self.log_path.read_text()[-2000:]}")
        # NOTE: drain stdout so that the process never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 300.0) -> tuple[int, Any]:
        """One HTTP request on a new connection: ``(status, JSON or bytes)``."""
        conn = http.client.HTTPConnection(self.http_host, self.http_port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(payload)
        except ValueError:
            return resp.status, payload

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
