"""Hostile clients against ``sgrt serve``, with normal sessions running beside them.

Starts ``sgrt serve`` as a process (default model, WebSocket + HTTP on free loopback ports, the
repo's ``programs/``), then runs a bounded set of hostile inputs from each class of issue 15
against HTTP and WebSocket while normal clients keep chatting:

- ``grammar``: huge / deep JSON Schemas (nesting, ``$ref`` chains, many properties) in
  ``json_schema``, ``response_format`` and tool ``parameters``; long Lark rule chains; regexes
  with nested bounded repeats; a recursive schema with no finite instance.
- ``fields``: ``seed`` outside 64 bits, every numeric sampling field out of range, JSON bodies
  and frames nested 1,000 and 100,000 levels.
- ``stall``: a ~4 MB prompt (tokenized while ``/health`` is probed), a body over the size limit.
- ``abort``: ``parallel_judge`` (a ``fork`` program) cancelled, closed and disconnected mid-run.
- ``sockets``: half-open connections (connect, send nothing), slow headers, slow bodies.
- ``web``: a foreign ``Origin`` on the WebSocket upgrade and on POSTs, ``text/plain`` POSTs,
  ``GET /flush_cache``.

Counts: attacks tried, typed 4xx (or typed WebSocket errors / refused upgrades), accepted (a
valid answer), 5xx (or ``internal`` errors), hangs (no answer within the timeout), server deaths
(the process exited; it is restarted and the run goes on), normal sessions completed with the
expected (greedy) text, KV pool free slots and server RSS before and after. Ends with one line
of JSON. Target: 0 deaths, 0 hangs, 0 5xx, every normal session correct, pool back to its start.

Usage: ``python bench/attack.py [--normal-clients 2] [--timeout 60]`` (a few minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

REPO = Path(__file__).resolve().parents[1]
ATTACK_TIMEOUT = 120.0  # seconds before an HTTP attack counts as a hang (--timeout)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """Resident set size of a process, KiB (Linux /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ==== the server process ==========================================================================

class Server:
    """``sgrt serve`` in a child process; ``restart()`` after a death."""

    def __init__(self, extra: list[str]):
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.deaths = 0
        self.start()

    def start(self) -> None:
        self.ws_port, self.http_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "sgrt.cli", "serve", "--port", str(self.ws_port), "--http-port",
               str(self.http_port), "--programs", str(REPO / "programs"), *self.extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if "OpenAI-compatible API on" in line:
                break
        else:
            raise RuntimeError(f"sgrt serve exited at start ({self.proc.wait()})")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # drain

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> bool:
        """Whether the server died since the last check (then it is restarted)."""
        if self.alive():
            return False
        self.deaths += 1
        self.start()
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def request(server: Server, method: str, path: str, body: Any = None, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float | None = None) -> tuple[int, bytes]:
    timeout = ATTACK_TIMEOUT if timeout is None else timeout
    host, port = server.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def engine_stats(server: Server) -> dict[str, Any]:
    return json.loads(request(server, "GET", "/health")[1]).get("engine", {})


def wait_idle(server: Server, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = engine_stats(server)
        if (st.get("running", 0) == 0 and st.get("waiting", 0) == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


# ==== tallies =====================================================================================

@dataclass
class Tally:
    tried: Counter = field(default_factory=Counter)
    outcome: Counter = field(default_factory=Counter)  # (class, outcome)
    examples: list[str] = field(default_factory=list)

    def add(self, cls: str, outcome: str, what: str = "") -> None:
        self.tried[cls] += 1
        self.outcome[(cls, outcome)] += 1
        if outcome in ("5xx", "hang", "death") and len(self.examples) < 20:
            self.examples.append(f"{cls}/{outcome}: {what}")

    def total(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcome.items() if o == outcome)


def classify_http(server: Server, fn: Any) -> tuple[str, str]:
    """Run one HTTP attack: ``typed4xx`` / ``accepted`` / ``5xx`` / ``hang`` / ``death`` /
    ``closed`` (the server closed the connection on purpose: a timeout or a cap)."""
    try:
        status, payload = fn()
    except socket.timeout:
        return ("death", "no answer") if server.check() else ("hang", "no answer")
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return ("death", repr(e)) if server.check() else ("closed", repr(e))
    if server.check():
        return "death", f"status {status}"
    if status >= 500:
        return "5xx", payload[:200].decode("utf-8", "replace")
    if 400 <= status < 500:
        return "typed4xx", ""
    if payload.startswith(b"data: ") and b'"server_error"' in payload:
        return "5xx", "server_error in stream"
    return "accepted", ""


# ==== attack inputs ===============================================================================

def deep(n: int) -> str:
    return "[" * n + "]" * n


def ref_chain(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_objects(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def wide_object(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{i}" for i in range(n)]}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


SCHEMA_BOMBS = [("ref_chain_2000", ref_chain(2000)), ("nested_300", nested_objects(300)),
                ("wide_5000", wide_object(5000)),
                ("no_finite_instance", {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                        "required": ["next"]}}, "$ref": "#/$defs/n"})]
REGEX_BOMBS = ["((a{1,100}){1,100}){1,100}", "(a{0,1000}){0,1000}", "(x+x+)+y", "a{99999}"]
GRAMMAR_BOMBS = [rule_chain(5000), "start: " + " | ".join(f'"{i}"' for i in range(20000))]
FIELD_ATTACKS = [("seed", 2**64), ("temperature", 2**64), ("repetition_penalty", 2**64), ("seed", -(2**63) - 1), ("seed", 10**40), ("top_k", 2**40),
                 ("max_tokens", 2**70), ("min_tokens", 2**64), ("temperature", 1e308), ("top_p", 1e308),
                 ("logprob_start_len", 2**63), ("top_logprobs_num", 2**63), ("stop_token_ids", [2**64]),
                 ("repetition_penalty", 1e308), ("num_draft_tokens", 2**63)]


def http_attacks(server: Server, timeout: float) -> list[tuple[str, str, Any]]:
    """(class, label, thunk) for every HTTP attack."""
    out: list[tuple[str, str, Any]] = []
    add = out.append
    for name, schema in SCHEMA_BOMBS:
        add(("grammar", f"generate json_schema {name}", lambda s=schema: request(
            server, "POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 4, "json_schema": s}})))
        add(("grammar", f"response_format {name}", lambda s=schema: request(server, "POST", "/v1/chat/completions", {
            **CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}})))
        add(("grammar", f"tool parameters {name}", lambda s=schema: request(server, "POST", "/v1/chat/completions", {
            **CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
            "tool_choice": "required"})))
    for rx in REGEX_BOMBS:
        add(("grammar", f"regex {rx[:20]}", lambda r=rx: request(
            server, "POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 4, "regex": r}})))
    for g in GRAMMAR_BOMBS:
        add(("grammar", "lark bomb", lambda g=g: request(
            server, "POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 4, "grammar": g}})))
    for name, value in FIELD_ATTACKS:
        add(("fields", f"generate {name}={value!r:.20}", lambda n=name, v=value: request(
            server, "POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 2, n: v}})))
    for name in ("seed", "top_logprobs", "n", "max_tokens", "temperature", "top_p", "presence_penalty"):
        add(("fields", f"chat {name}=2**64", lambda n=name: request(
            server, "POST", "/v1/chat/completions", {**CHAT, n: 2**64})))
        add(("fields", f"completions {name}=2**64", lambda n=name: request(
            server, "POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2, n: 2**64})))
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/tokenize"):
        for n in (1_000, 100_000):
            add(("fields", f"{path} nested {n}", lambda p=path, n=n: request(
                server, "POST", p, raw=f'{{"text": {deep(n)}, "messages": {deep(n)}, "prompt": {deep(n)}}}'.encode())))
    big = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB: just under max_body_bytes once in JSON
    add(("stall", "4 MB /tokenize", lambda: request(server, "POST", "/tokenize", {"prompt": big[:4_000_000]},
                                                    timeout=timeout)))
    add(("stall", "4 MB chat", lambda: request(server, "POST", "/v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": big[:4_000_000]}]}, timeout=timeout)))
    add(("stall", "8 MB body", lambda: request(server, "POST", "/tokenize", {"prompt": big + big})))
    for origin in ("https://evil.example", "null"):
        add(("web", f"POST Origin {origin}", lambda o=origin: request(
            server, "POST", "/flush_cache", headers={"origin": o})))
    add(("web", "text/plain POST", lambda: request(server, "POST", "/generate", headers={"content-type": "text/plain"},
                                                   raw=b'{"text": "x"}')))
    add(("web", "GET /flush_cache", lambda: request(server, "GET", "/flush_cache")))
    return out


async def ws_frame_attack(server: Server, frames: list[str], timeout: float) -> str:
    """Send frames on one connection; ``typed4xx`` when every error is typed, ``5xx`` on an
    ``internal`` error, ``hang`` when nothing answers."""
    try:
        async with connect(server.ws, max_size=None, open_timeout=timeout) as ws:
            outcome = "accepted"
            for frame in frames:
                await ws.send(frame)
                try:
                    while True:
                        msg = json.loads(await asyncio.wait_for(ws.recv(), timeout if outcome == "accepted" else 1))
                        if msg["type"] == "error":
                            if msg["code"] in ("internal", "generation_failed", "program_failed"):
                                return "5xx"
                            outcome = "typed4xx"
                        if msg["type"] in ("ready", "done", "error"):
                            break
                except asyncio.TimeoutError:
                    return "hang"
            return outcome
    except InvalidStatus as e:
        return "typed4xx" if e.response.status_code < 500 else "5xx"
    except (ConnectionClosed, OSError):
        return "death" if server.check() else "closed"


def ws_attacks(server: Server) -> list[tuple[str, str, list[str]]]:
    out = []

    def start(**kw: Any) -> str:
        return json.dumps({"type": "session.start", "session": "a", **kw})

    for name, schema in SCHEMA_BOMBS:
        out.append(("grammar", f"ws tool {name}", [start(tools=[{"name": "f", "parameters": schema}])]))
    for name, value in FIELD_ATTACKS[:4]:
        out.append(("fields", f"ws sampling {name}", [start(sampling={name: value})]))
    for n in (1_000, 100_000):
        out.append(("fields", f"ws nested {n}", [f'{{"type": "session.start", "session": "a", "args": {deep(n)}}}']))
    out.append(("stall", "ws 1 MB user", [start(sampling={"max_tokens": 2}),
                                          json.dumps({"type": "user", "session": "a", "content": "x " * 500_000})]))
    return out


async def abort_attack(server: Server, how: str, timeout: float) -> str:
    """parallel_judge over the WebSocket, then cancel / close / disconnect once its branches run."""
    try:
        async with connect(server.ws, open_timeout=timeout) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "j", "program": "parallel_judge",
                                      "args": {"question": "Tell a long story about the sea.", "n": 4,
                                               "max_tokens": 400, "temperature": 0.8}}))
            deadline = time.monotonic() + timeout
            while engine_stats(server).get("running", 0) < 4:
                if time.monotonic() > deadline:
                    return "hang"
                await asyncio.sleep(0.05)
            if how == "disconnect":
                return "typed4xx"
            await ws.send(json.dumps({"type": how, "session": "j"}))
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
                if msg["type"] == "error" and msg["code"] == "internal":
                    return "5xx"
                if msg["type"] == "done":
                    return "typed4xx"
    except asyncio.TimeoutError:
        return "hang"
    except (ConnectionClosed, OSError):
        return "death" if server.check() else "closed"


def socket_attacks(server: Server, n_half_open: int, timeout: float) -> list[tuple[str, str]]:
    """Half-open and slow connections: each must be closed by the server (header / body
    timeouts), never held. ``typed4xx`` = closed or answered 408 by the server in time."""
    host, port = server.http.split(":")
    results = []
    socks = []
    for i in range(n_half_open):
        s = socket.create_connection((host, int(port)), timeout=timeout)
        if i % 3 == 1:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        elif i % 3 == 2:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")  # body never finishes
        socks.append(s)
    ws_host, ws_port = "127.0.0.1", server.ws_port
    for _ in range(n_half_open // 4):
        socks.append(socket.create_connection((ws_host, ws_port), timeout=timeout))
    for s in socks:
        try:
            data = s.recv(65536)
            while data and not data.startswith(b"HTTP/1.1 408"):
                data = s.recv(65536)
            results.append(("typed4xx", ""))
        except socket.timeout:
            results.append(("hang", "connection held open"))
        except OSError:
            results.append(("typed4xx", ""))
        finally:
            s.close()
    return results


async def ws_origin_attacks(server: Server, timeout: float) -> list[str]:
    out = []
    for origin in ("https://evil.example", "null", "http://localhost.evil.example"):
        try:
            async with connect(server.ws, origin=origin, open_timeout=timeout):
                out.append("accepted")
        except InvalidStatus as e:
            out.append("typed4xx" if e.response.status_code == 403 else "5xx")
    return out


# ==== normal sessions =============================================================================

class NormalClients:
    """Clients that keep chatting (greedy) over HTTP and WebSocket while attacks run; each
    answer must equal the answer given before the attacks began."""

    def __init__(self, server: Server, n: int):
        self.server = server
        self.n = n
        self.ok = 0
        self.wrong: list[str] = []
        self.stop = threading.Event()
        self.expected_http = self._http_once()
        self.expected_ws = asyncio.run(self._ws_once())
        self.threads: list[threading.Thread] = []

    def _http_once(self) -> str:
        status, payload = request(self.server, "POST", "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0}, timeout=300)
        if status != 200:
            return f"status {status}"
        return json.loads(payload)["choices"][0]["message"]["content"]

    async def _ws_once(self) -> str:
        async with connect(self.server.ws, open_timeout=300) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "n", "sampling": {"max_tokens": 8}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "user", "session": "n", "content": "Name a fruit."}))
            text = None
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 300))
                if msg["type"] == "message":
                    text = msg["content"]
                if msg["type"] in ("done", "error"):
                    return text if msg["type"] == "done" else f"error {msg.get('code')}"

    def _loop(self, kind: str) -> None:
        while not self.stop.is_set():
            want = self.expected_http if kind == "http" else self.expected_ws
            try:
                got = self._http_once() if kind == "http" else asyncio.run(self._ws_once())
            except Exception as e:  # noqa: BLE001 - a failed normal session is a finding
                got, want = repr(e), "an answer"
            if got == want:
                self.ok += 1
                continue
            self.wrong.append(f"{kind}: {got!r} != {want!r}")
            # NOTE: after a failure (e.g. the server died and restarts), wait for it to serve
            # again instead of counting one failure per retry.
            while not self.stop.is_set() and not self.server.alive():
                time.sleep(0.5)
            self.stop.wait(5.0)

    def start(self) -> None:
        for i in range(self.n):
            t = threading.Thread(target=self._loop, args=("http" if i % 2 == 0 else "ws",), daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


# ==== main ========================================================================================

async def run_ws(server: Server, tally: Tally, timeout: float) -> None:
    for cls, label, frames in ws_attacks(server):
        outcome = await ws_frame_attack(server, frames, timeout)
        tally.add(cls, outcome, label)
        print(f"  {cls:8s} {outcome:9s} {label}", file=sys.stderr, flush=True)
    for outcome in await ws_origin_attacks(server, timeout):
        tally.add("web", outcome, "ws Origin")
    for how in ("cancel", "close", "disconnect"):
        tally.add("abort", await abort_attack(server, how, timeout), f"parallel_judge {how}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--normal-clients", type=int, default=2, help="concurrent normal sessions (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds one attack may take before it counts as a hang (default: %(default)s)")
    ap.add_argument("--half-open", type=int, default=60, help="half-open/slow HTTP connections (default: %(default)s)")
    args = ap.parse_args()
    global ATTACK_TIMEOUT
    ATTACK_TIMEOUT = args.timeout

    server = Server(["--header-timeout", "3", "--body-timeout", "3", "--max-tokens-limit", "64",
                     "--ws-max-tokens-per-turn", "512"])
    request(server, "POST", "/flush_cache", timeout=300)
    before = wait_idle(server)
    rss_before = rss_kib(server.proc.pid)
    normal = NormalClients(server, args.normal_clients)
    normal.start()
    tally = Tally()
    t0 = time.perf_counter()
    for cls, label, thunk in http_attacks(server, args.timeout):
        outcome, what = classify_http(server, thunk)
        tally.add(cls, outcome, f"{label}: {what}")
        print(f"  {cls:8s} {outcome:9s} {label}", file=sys.stderr, flush=True)
    asyncio.run(run_ws(server, tally, args.timeout))
    for outcome, what in socket_attacks(server, args.half_open, args.timeout):
        tally.add("sockets", outcome, what)
    elapsed = time.perf_counter() - t0
    normal.finish()
    if server.check():
        tally.add("all", "death", "server gone at the end")
    after = wait_idle(server)
    request(server, "POST", "/flush_cache", timeout=300)
    after = engine_stats(server)
    rss_after = rss_kib(server.proc.pid)
    server.stop()

    classes = sorted(tally.tried)
    print(f"{'class':10s} {'tried':>6s} {'typed4xx':>9s} {'accepted':>9s} {'closed':>7s} {'5xx':>5s} {'hang':>5s} "
          f"{'death':>6s}")
    for c in classes:
        o = {k: tally.outcome[(c, k)] for k in ("typed4xx", "accepted", "closed", "5xx", "hang", "death")}
        print(f"{c:10s} {tally.tried[c]:6d} {o['typed4xx']:9d} {o['accepted']:9d} {o['closed']:7d} {o['5xx']:5d} "
              f"{o['hang']:5d} {o['death']:6d}")
    for ex in tally.examples:
        print("  !", ex)
    for w in normal.wrong[:10]:
        print("  normal session wrong:", w)
    print(f"normal sessions: {normal.ok} correct, {len(normal.wrong)} wrong; attacks took {elapsed:.1f} s")
    print(f"KV pool free: {before.get('pool_free')} -> {after.get('pool_free')} of {after.get('pool_total')}; "
          f"server RSS: {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB")
    result = {
        "bench": "attack", "attacks": sum(tally.tried.values()), "typed_4xx": tally.total("typed4xx"),
        "accepted": tally.total("accepted"), "closed": tally.total("closed"), "5xx": tally.total("5xx"),
        "hangs": tally.total("hang"), "deaths": server.deaths, "normal_ok": normal.ok,
        "normal_wrong": len(normal.wrong), "pool_free_before": before.get("pool_free"),
        "pool_free_after": after.get("pool_free"), "pool_total": after.get("pool_total"),
        "rss_mib_before": round(rss_before / 1024), "rss_mib_after": round(rss_after / 1024),
        "by_class": {c: dict((k, v) for (cc, k), v in tally.outcome.items() if cc == c) for c in classes},
        "seconds": round(elapsed, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
