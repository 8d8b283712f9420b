"""Hostile clients against ``sgrt serve``, with normal sessions running beside them.

Starts ``sgrt serve`` as a process (default model, an auth token, WebSocket + HTTP on free
loopback ports, the repo's ``programs/``), then runs a bounded set of hostile inputs from each
class of issues 15 and 43 against HTTP and WebSocket while normal clients keep chatting and a
probe process (another client) measures the server's latency and whether new authenticated
clients get in. Issue 15's classes:

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

Issue 43's classes:

- ``lockout``: 3x ``--max-connections`` WebSocket connections that upgrade and never send a
  message, as many that never upgrade, as many silent HTTP connections; each time an
  authenticated client must get in at once (else a lock-out) and every silent one must be closed
  within the auth / header timeout (else a hang).
- ``loop``: CPU-bound requests at the limits (a session.start with 32 tools of 750 properties,
  chat-template renders of 4,096 long messages, a 3 MB tokenize, echo and detokenize of 580,000
  ids) and past them (130,000 messages), while the probe measures latency.
- ``pertoken``: 780,000 stop strings (chat, completions, /generate, Messages, WebSocket), huge
  ``stop_token_ids``, ``logit_bias``, tools and messages lists; stop strings at the limit.
- ``stream``: 16 clients with 16-choice streams and a tiny receive buffer that never read
  (max_queue's worth), then a request of 16 choices must run once the engine finished them (else
  a lock-out); unread ~10 MB responses must be cut by the write timeout (else a hang).
- ``types``: the attack pass's 500s (echo of ids past the vocabulary, non-object
  ``text.format``, non-string ``arguments``, non-object content blocks, in ``tool_result``,
  streamed) and every JSON type at every place of a rich body of each route.
- ``programs``: registered programs started with arguments of the wrong type.
- ``store``: Responses ``metadata`` past OpenAI's bounds, 60 x 3.9 MB of it.
- ``smuggle``: Content-Length with Transfer-Encoding (and neighbours): a 400 and a closed
  connection, the smuggled request never answered (else "accepted").

Counts: attacks tried, typed 4xx (or typed WebSocket errors / refused upgrades), accepted (a
valid answer), 5xx (or ``internal`` / ``program_failed`` errors), hangs (no answer within the
timeout), lock-outs (an authenticated client refused while an attack ran), server deaths (the
process exited; it is restarted and the run goes on), stalls (the probe's ``GET /health`` or
WebSocket round trip over 1 s), normal sessions completed with the expected (greedy) text, KV
pool free slots and server RSS before and after. Ends with one line of JSON. Target: 0 deaths,
0 hangs, 0 5xx, 0 stalls, 0 lock-outs, every normal session correct, pool back to its start.

Usage: ``python bench/attack.py [--normal-clients 2] [--timeout 60]`` (several minutes on 2 cores).
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
import tempfile
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
TOKEN = "attack-bench-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_CONNECTIONS = 64  # the server's --max-connections (each server)
AUTH_TIMEOUT = 2.0  # --auth-timeout
WRITE_TIMEOUT = 3.0  # --write-timeout
STALL_S = 1.0  # a probe slower than this is a stall


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
               str(self.http_port), "--programs", str(REPO / "programs"), "--auth-token", TOKEN,
               "--served-model-name", "m", *self.extra]  # (the attacks name their model "m")
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
    """One request on a new connection, with the auth token unless ``headers`` replace it."""
    timeout = ATTACK_TIMEOUT if timeout is None else timeout
    host, port = server.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data,
                     headers={"content-type": "application/json", **AUTH, **(headers or {})})
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
        if outcome in ("5xx", "hang", "death", "lockout") and len(self.examples) < 30:
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
        return json.dumps({"type": "session.start", "session": "a", "auth_token": TOKEN, **kw})

    for name, schema in SCHEMA_BOMBS:
        out.append(("grammar", f"ws tool {name}", [start(tools=[{"name": "f", "parameters": schema}])]))
    for name, value in FIELD_ATTACKS[:4]:
        out.append(("fields", f"ws sampling {name}", [start(sampling={name: value})]))
    for n in (1_000, 100_000):
        out.append(("fields", f"ws nested {n}", [f'{{"type": "session.start", "session": "a", "auth_token": "{TOKEN}", '
                                                  f'"args": {deep(n)}}}']))
    out.append(("stall", "ws 1 MB user", [start(sampling={"max_tokens": 2}),
                                          json.dumps({"type": "user", "session": "a", "content": "x " * 500_000})]))
    return out


async def abort_attack(server: Server, how: str, timeout: float) -> str:
    """parallel_judge over the WebSocket, then cancel / close / disconnect once its branches run."""
    try:
        async with connect(server.ws, open_timeout=timeout) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "j", "program": "parallel_judge",
                                      "auth_token": TOKEN,
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


# ==== issue 43: lock-outs, the event loop, per-token work, unread streams, wire types ===========

def ws_host_port(server: Server) -> tuple[str, int]:
    return "127.0.0.1", server.ws_port


async def ws_client_gets_in(server: Server, timeout: float = 30.0) -> bool:
    """Whether a new authenticated WebSocket client connects and opens a session at once."""
    try:
        async with connect(server.ws, open_timeout=timeout) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "in", "auth_token": TOKEN}))
            return json.loads(await asyncio.wait_for(ws.recv(), timeout))["type"] == "ready"
    except (OSError, asyncio.TimeoutError, ConnectionClosed, InvalidStatus):
        return False


def http_client_gets_in(server: Server, timeout: float = 30.0) -> bool:
    """Whether a new authenticated HTTP client gets an answer at once."""
    try:
        return request(server, "GET", "/v1/models", timeout=timeout)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


async def _closed_by_server(ws: Any, timeout: float) -> bool:
    try:
        await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed:
        return True
    except asyncio.TimeoutError:
        return False
    return False


async def lockout_attacks(server: Server, tally: Tally) -> None:
    """Silent WebSocket connections (upgraded, or not even that) and silent HTTP connections,
    3x max_connections each, then an authenticated client; the silent ones must be closed."""
    n = 3 * MAX_CONNECTIONS
    slack = AUTH_TIMEOUT + 30
    silent = []
    for _ in range(n):
        try:
            silent.append(await connect(server.ws, open_timeout=30))
        except (OSError, InvalidStatus, asyncio.TimeoutError):
            pass  # refused or evicted while opening: the cap did its job
    tally.add("lockout", "typed4xx" if await ws_client_gets_in(server) else "lockout", "ws: silent upgraded connections")
    closed = await asyncio.gather(*(_closed_by_server(ws, slack) for ws in silent))
    for ok in closed:
        tally.add("lockout", "typed4xx" if ok else "hang", "ws: a silent connection kept open")
    host, port = ws_host_port(server)
    raw = [await asyncio.open_connection(host, port) for _ in range(n)]
    tally.add("lockout", "typed4xx" if await ws_client_gets_in(server) else "lockout", "ws: silent TCP connections")
    for reader, writer in raw:
        try:
            eof = await asyncio.wait_for(reader.read(), slack) == b""
        except (asyncio.TimeoutError, OSError):
            eof = False
        tally.add("lockout", "typed4xx" if eof else "hang", "ws: a silent TCP connection kept open")
        writer.close()
    hhost, hport = server.http.split(":")
    socks = [socket.create_connection((hhost, int(hport)), timeout=60) for _ in range(n)]
    for i, s in enumerate(socks):
        if i % 2:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    ok = await asyncio.to_thread(http_client_gets_in, server)
    tally.add("lockout", "typed4xx" if ok else "lockout", "http: silent connections")
    for s in socks:
        s.close()
    print(f"  lockout  done", file=sys.stderr, flush=True)


def _messages(n: int, chars: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "word " * (chars // 5)}
            for i in range(n)]


async def ws_big_tools(server: Server, timeout: float) -> str:
    props = {f"p{i}": {"type": "integer"} for i in range(750)}
    tools = [{"name": f"t{j}", "parameters": {"type": "object", "properties": props}} for j in range(32)]
    return await ws_frame_attack(server, [json.dumps({"type": "session.start", "session": "t", "tools": tools,
                                                      "auth_token": TOKEN})], timeout)


def loop_attacks(server: Server, timeout: float) -> list[tuple[str, str, Any]]:
    """CPU-bound requests at (and past) the limits; the probe measures latency meanwhile."""
    ids = [i % 40_000 for i in range(580_000)]
    out: list[tuple[str, str, Any]] = []
    add = out.append
    add(("loop", "apply_chat_template 130,000 messages", lambda: request(server, "POST", "/apply_chat_template", {
        "messages": [{"role": "user", "content": "x"}] * 130_000})))
    for _ in range(2):
        add(("loop", "apply_chat_template 4,096 x 880 chars", lambda: request(server, "POST", "/apply_chat_template", {
            "messages": _messages(4096, 880)})))
        add(("loop", "chat of 4,096 x 880 chars", lambda: request(server, "POST", "/v1/chat/completions", {
            "model": "m", "max_tokens": 1, "messages": _messages(4096, 880)})))
        add(("loop", "tokenize 3 MB", lambda: request(server, "POST", "/tokenize", {"prompt": "The quick fox. " * 200_000})))
        add(("loop", "echo over 580,000 ids", lambda: request(server, "POST", "/v1/completions", {
            "model": "m", "prompt": ids, "echo": True, "max_tokens": 1})))
        add(("loop", "detokenize 580,000 ids", lambda: request(server, "POST", "/detokenize", {"tokens": ids})))
        add(("loop", "detokenize a window", lambda: request(server, "POST", "/detokenize", {"tokens": ids[:8192]})))
        add(("loop", "generate 64 prompts logprobs", lambda: request(server, "POST", "/generate", {
            "text": ["Hello there, how are you? " * 40] * 64, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 5, "sampling_params": {"max_tokens": 0}}, timeout=timeout)))
    return out


def pertoken_attacks(server: Server) -> list[tuple[str, str, Any]]:
    stops = [str(i % 10) for i in range(780_000)]
    out: list[tuple[str, str, Any]] = []
    add = out.append
    add(("pertoken", "chat 780,000 stop strings", lambda: request(server, "POST", "/v1/chat/completions",
                                                                   {**CHAT, "max_tokens": 64, "stop": stops})))
    add(("pertoken", "completions 780,000 stop strings", lambda: request(server, "POST", "/v1/completions", {
        "model": "m", "prompt": "Once upon a time", "max_tokens": 64, "stop": stops})))
    add(("pertoken", "generate 780,000 stop strings", lambda: request(server, "POST", "/generate", {
        "text": "Once upon a time", "sampling_params": {"max_tokens": 64, "stop": stops}})))
    add(("pertoken", "messages 780,000 stop_sequences", lambda: request(server, "POST", "/v1/messages", {
        "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], "stop_sequences": stops})))
    add(("pertoken", "one stop string of 3 MB", lambda: request(server, "POST", "/v1/chat/completions",
                                                                 {**CHAT, "stop": ["x" * 3_000_000]})))
    add(("pertoken", "stop strings at the limit", lambda: request(server, "POST", "/v1/chat/completions", {
        **CHAT, "max_tokens": 32, "stop": [f"never{i:03d}" + "z" * 100 for i in range(64)]})))
    add(("pertoken", "stop_token_ids 500,000", lambda: request(server, "POST", "/v1/chat/completions", {
        **CHAT, "stop_token_ids": [i % 40_000 for i in range(500_000)]})))
    add(("pertoken", "logit_bias 200,000", lambda: request(server, "POST", "/v1/chat/completions", {
        **CHAT, "logit_bias": {str(i): 1 for i in range(200_000)}})))
    add(("pertoken", "tools 20,000", lambda: request(server, "POST", "/v1/chat/completions", {
        **CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(20_000)]})))
    add(("pertoken", "messages 130,000", lambda: request(server, "POST", "/v1/chat/completions", {
        "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * 130_000})))
    add(("pertoken", "responses input 130,000", lambda: request(server, "POST", "/v1/responses", {
        "model": "m", "max_output_tokens": 1, "input": [{"role": "user", "content": "x"}] * 130_000})))
    return out


async def ws_pertoken_attack(server: Server, timeout: float) -> str:
    return await ws_frame_attack(server, [json.dumps({"type": "session.start", "session": "s", "auth_token": TOKEN,
                                                      "sampling": {"stop": [str(i % 10) for i in range(150_000)]}})],
                                 timeout)


def _unread(server: Server, path: str, body: Any) -> socket.socket:
    host, port = server.http.split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json"
              f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _server_closes(s: socket.socket, timeout: float) -> bool:
    """Read until the server closes the connection (True) or ``timeout`` passes (False)."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except (socket.timeout, OSError):
        return False


def stream_attacks(server: Server, tally: Tally) -> None:
    """max_queue's worth of unread 16-choice streams, then a 16-choice request; unread large
    responses, which the write timeout must cut."""
    finished = engine_stats(server).get("finished", 0)
    body = {**CHAT, "max_tokens": 16, "n": 16, "stream": True, "logprobs": True, "top_logprobs": 20,
            "temperature": 1.0, "ignore_eos": True}
    socks = [_unread(server, "/v1/chat/completions", body) for _ in range(16)]  # 256 = max_queue
    deadline = time.monotonic() + 600
    while engine_stats(server).get("finished", 0) < finished + 256 and time.monotonic() < deadline:
        time.sleep(0.2)
    status, payload = request(server, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, "n": 16})
    tally.add("stream", "accepted" if status == 200 else "lockout", f"16 choices after unread streams: {status}")
    for s in socks:
        tally.add("stream", "typed4xx" if _server_closes(s, WRITE_TIMEOUT + 60) else "hang", "an unread stream kept open")
        s.close()
    big = [_unread(server, "/tokenize", {"prompt": "a " * 1_800_000}) for _ in range(4)]
    for s in big:
        tally.add("stream", "typed4xx" if _server_closes(s, WRITE_TIMEOUT + 120) else "hang", "an unread 10 MB answer")
        s.close()
    print(f"  stream   done", file=sys.stderr, flush=True)


TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m", "max_tokens": 2, "stop": ["zzz"], "seed": 1, "metadata": {"k": "v"},
        "response_format": {"type": "text"}, "tools": [TOOL], "tool_choice": "none",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
    "/v1/completions": {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "echo": True, "logprobs": 1},
    "/v1/responses": {
        "model": "m", "max_output_tokens": 2, "instructions": "Be brief.", "metadata": {"k": "v"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
    "/v1/messages": {
        "model": "m", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "f"},
        "stop_sequences": ["zzz"], "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "ok"}]}]}]},
    "/generate": {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_tokens": 2, "stop": ["z"]}, "rid": ["a", "b"]},
    "/tokenize": {"messages": [{"role": "user", "content": "Hi"}]},
    "/detokenize": {"tokens": [1, 2]},
    "/apply_chat_template": {"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL]},
}
JSON_SAMPLES = [None, True, 7, -1, 2**70, 0.5, "x", [1], ["x"], [None], {"k": 1}, {}]


def _places(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, path + (i,))
    return out


def _replaced(body: Any, path: tuple, value: Any) -> Any:
    out = json.loads(json.dumps(body))
    if not path:
        return value
    target = out
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return out


#: The attack pass's 500s and their neighbours.
TYPE_SAMPLES = [
    ("/v1/completions", {"model": "m", "prompt": [49152, 60000], "echo": True, "max_tokens": 1}),
    ("/v1/completions", {"model": "m", "prompt": [[1], [10**30]], "echo": True, "max_tokens": 1, "stream": True}),
    ("/v1/completions", {"model": "m", "prompt": [-5], "echo": True, "max_tokens": 1}),
    ("/v1/responses", {"model": "m", "input": "x", "text": {"format": "json_object"}}),
    ("/v1/responses", {"model": "m", "input": "x", "text": {"format": 5}, "stream": True}),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                "arguments": {"a": 1}}]}),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                "arguments": [1]}], "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [5]}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ["x"]}], "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [5]}]}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [None, "x"]}]}]}),
]


def types_attacks(server: Server) -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    for path, body in TYPE_SAMPLES:
        out.append(("types", f"{path} sample", lambda p=path, b=body: request(server, "POST", p, b)))
    for path, body in TEMPLATES.items():
        for where in _places(body):
            for value in JSON_SAMPLES:
                bad = _replaced(body, where, value)
                if bad == body:
                    continue
                stream = path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages") \
                    and isinstance(bad, dict) and hash((where, repr(value))) % 2 == 0
                if stream:
                    bad = {**bad, "stream": True}
                out.append(("types", f"{path} {where} = {value!r:.20}",
                            lambda p=path, b=bad: request(server, "POST", p, b)))
    return out


PROGRAM_ARGS = [
    ("parallel_judge", {"question": "q", "n": "3"}), ("parallel_judge", {"question": "q", "n": 2.5}),
    ("parallel_judge", {"question": 5}), ("chat", {"turns": ["Hi"], "history": [5]}),
    ("chat", {"turns": "Hi"}), ("chat", {"turns": ["Hi"], "history": [{"role": "user", "content": {"a": 1}}]}),
    ("chat", {"turns": [None]}), ("tool_use", {"request": "x", "tools": [1, 2]}),
    ("tool_use", {"request": "x", "tools": [{"name": 5}]}), ("tool_use", {"request": "x", "tools": {"a": 1}}),
    ("tool_use", {"request": "x", "tools": [{"name": "f", "parameters": []}]}),
    ("react", {"question": "q", "tools": {"calc": "x"}}), ("react", {"question": "q", "max_steps": "4"}),
    ("classify", {"text": "x", "labels": "abc"}), ("classify", {"text": "x", "examples": [[1, 2]]}),
    ("classify", {"text": "x", "examples": [{"text": "a"}]}), ("extract", {"text": "x", "schema": "not a schema"}),
    ("skeleton_of_thought", {"question": "q", "num_points": [3]}), ("echo_summary", {"text": None}),
    ("echo_summary", {}), ("echo_summary", {"text": "x", "bogus": 1}),
]


async def program_attack(server: Server, program: str, args: dict[str, Any], timeout: float) -> str:
    """A typed refusal (``invalid_request``) is right; ``program_failed`` or ``internal`` is a 5xx."""
    try:
        async with connect(server.ws, open_timeout=timeout) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "p", "program": program, "args": args,
                                      "auth_token": TOKEN, "sampling": {"max_tokens": 8}}))
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
                if msg["type"] == "error":
                    return "5xx" if msg["code"] in ("internal", "program_failed", "generation_failed") else "typed4xx"
                if msg["type"] == "done":
                    return "accepted"
    except asyncio.TimeoutError:
        return "hang"
    except (ConnectionClosed, OSError):
        return "death" if server.check() else "closed"


def store_attacks(server: Server) -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    big = {"k": "v" * 3_900_000}
    for i in range(60):
        out.append(("store", "metadata of 3.9 MB", lambda: request(server, "POST", "/v1/responses", {
            "model": "m", "input": "x", "max_output_tokens": 1, "metadata": big})))
    for meta in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}, {"k": {"a": 1}}):
        out.append(("store", f"metadata {str(meta)[:30]}", lambda m=meta: request(server, "POST", "/v1/responses", {
            "model": "m", "input": "x", "max_output_tokens": 1, "metadata": m})))
    out.append(("store", "chat metadata 3.9 MB", lambda: request(server, "POST", "/v1/chat/completions",
                                                                  {**CHAT, "metadata": big})))
    return out


SMUGGLED = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
FRAMINGS = [b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(SMUGGLED),
            b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
            b"transfer-encoding: chunked\r\ncontent-length: 0\r\n",
            b"Content-Length: 4\r\nTransfer-Encoding: gzip, chunked\r\n",
            b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
            b"Transfer-Encoding: chunked, identity\r\n",
            b"Content-Length: 4\r\nContent-Length: 60\r\n",
            b"Transfer-Encoding:\tchunked\r\nContent-Length: 3\r\n"]


def smuggle_attack(server: Server, framing: bytes) -> tuple[str, str]:
    """``typed4xx`` when the one answer is a 400 and the connection then closes; ``accepted``
    when a second (smuggled) request was answered or the connection stayed open."""
    host, port = server.http.split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    try:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Type: application/json\r\n" + framing + b"\r\n" + SMUGGLED)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            return "accepted", f"connection left open: {framing!r}"
        except ConnectionResetError:
            pass
    finally:
        s.close()
    if data.count(b"HTTP/1.1 ") != 1 or not data.startswith(b"HTTP/1.1 4"):
        return ("5xx" if data.startswith(b"HTTP/1.1 5") else "accepted"), f"{framing!r}: {data[:80]!r}"
    return "typed4xx", ""


# ==== the probe: another client, in its own process ==============================================

def probe_main(http_addr: str, ws_url: str, out_path: str) -> None:
    """Run by ``attack.py --probe``: every 0.2 s a ``GET /health`` on a new connection and a
    round trip on an open (authenticated) WebSocket connection, every 2 s a new authenticated
    HTTP and WebSocket client; one JSON line per probe to ``out_path``, until killed."""
    host, port = http_addr.split(":")

    def http_probe(path: str) -> tuple[float, bool]:
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("GET", path, headers=AUTH)
            ok = conn.getresponse().status == 200
            conn.close()
        except (OSError, http.client.HTTPException):
            ok = False
        return time.perf_counter() - t0, ok

    async def run() -> None:
        out = open(out_path, "a", buffering=1)
        ws = None
        n = 0
        while True:
            n += 1
            lat, ok = await asyncio.to_thread(http_probe, "/health")
            out.write(json.dumps({"kind": "http", "s": lat, "ok": ok, "t": time.time()}) + "\n")
            t0 = time.perf_counter()
            try:
                if ws is None:
                    ws = await connect(ws_url, open_timeout=60)
                    await ws.send(json.dumps({"type": "session.start", "session": "probe", "auth_token": TOKEN}))
                    await asyncio.wait_for(ws.recv(), 60)
                    t0 = time.perf_counter()
                await ws.send(json.dumps({"type": "cancel", "session": "none"}))  # answered at once: unknown_session
                await asyncio.wait_for(ws.recv(), 60)
                out.write(json.dumps({"kind": "ws", "s": time.perf_counter() - t0, "ok": True, "t": time.time()}) + "\n")
            except (OSError, asyncio.TimeoutError, ConnectionClosed, InvalidStatus):
                ws = None
                out.write(json.dumps({"kind": "ws", "s": time.perf_counter() - t0, "ok": False, "t": time.time()}) + "\n")
            if n % 10 == 0:  # a new client of each kind must get in (lock-outs)
                lat, ok = await asyncio.to_thread(http_probe, "/v1/models")
                out.write(json.dumps({"kind": "http_new", "s": lat, "ok": ok, "t": time.time()}) + "\n")
                t0 = time.perf_counter()
                try:
                    async with connect(ws_url, open_timeout=60) as new:
                        await new.send(json.dumps({"type": "session.start", "session": "n", "auth_token": TOKEN}))
                        ok = json.loads(await asyncio.wait_for(new.recv(), 60))["type"] == "ready"
                except (OSError, asyncio.TimeoutError, ConnectionClosed, InvalidStatus):
                    ok = False
                out.write(json.dumps({"kind": "ws_new", "s": time.perf_counter() - t0, "ok": ok, "t": time.time()}) + "\n")
            await asyncio.sleep(0.2)

    asyncio.run(run())


class Probe:
    """The probe process (``--probe``); ``read()`` its records."""

    def __init__(self, server: Server, path: Path):
        self.path = path
        path.write_text("")
        self.proc = subprocess.Popen([sys.executable, __file__, "--probe", server.http, server.ws, str(path)],
                                     cwd=REPO, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def read(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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
            await ws.send(json.dumps({"type": "session.start", "session": "n", "sampling": {"max_tokens": 8},
                                      "auth_token": TOKEN}))
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


def run_http(server: Server, tally: Tally, attacks: list[tuple[str, str, Any]], quiet: bool = False) -> None:
    for cls, label, thunk in attacks:
        outcome, what = classify_http(server, thunk)
        tally.add(cls, outcome, f"{label}: {what}")
        if not quiet or outcome not in ("typed4xx", "accepted"):
            print(f"  {cls:8s} {outcome:9s} {label}", file=sys.stderr, flush=True)


async def run_ws43(server: Server, tally: Tally, timeout: float) -> None:
    """The WebSocket attacks of issue 43 (the lock-out ones first)."""
    await lockout_attacks(server, tally)
    outcomes = await asyncio.gather(ws_big_tools(server, timeout), ws_big_tools(server, timeout))
    for outcome in outcomes:
        tally.add("loop", outcome, "ws session.start 32 tools x 750 properties")
    tally.add("pertoken", await ws_pertoken_attack(server, timeout), "ws 150,000 stop strings")
    for program, prog_args in PROGRAM_ARGS:
        outcome = await program_attack(server, program, prog_args, timeout)
        tally.add("programs", outcome, f"{program} {prog_args}"[:120])
        print(f"  programs {outcome:9s} {program} {str(prog_args)[:60]}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--normal-clients", type=int, default=2, help="concurrent normal sessions (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds one attack may take before it counts as a hang (default: %(default)s)")
    ap.add_argument("--half-open", type=int, default=60, help="half-open/slow HTTP connections (default: %(default)s)")
    ap.add_argument("--probe", nargs=3, metavar=("HTTP", "WS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe_main(*args.probe)
        return
    global ATTACK_TIMEOUT
    ATTACK_TIMEOUT = args.timeout

    server = Server(["--header-timeout", "3", "--body-timeout", "3", "--max-tokens-limit", "64",
                     "--ws-max-tokens-per-turn", "512", "--max-connections", str(MAX_CONNECTIONS),
                     "--auth-timeout", str(AUTH_TIMEOUT), "--write-timeout", str(WRITE_TIMEOUT)])
    request(server, "POST", "/flush_cache", timeout=300)
    before = wait_idle(server)
    rss_before = rss_kib(server.proc.pid)
    normal = NormalClients(server, args.normal_clients)
    normal.start()
    probe_file = tempfile.NamedTemporaryFile(prefix="sgrt-attack-probe-", suffix=".jsonl", delete=False)
    probe = Probe(server, Path(probe_file.name))
    tally = Tally()
    t0 = time.perf_counter()
    run_http(server, tally, http_attacks(server, args.timeout))
    asyncio.run(run_ws(server, tally, args.timeout))
    for outcome, what in socket_attacks(server, args.half_open, args.timeout):
        tally.add("sockets", outcome, what)
    # issue 43
    asyncio.run(run_ws43(server, tally, args.timeout))
    run_http(server, tally, loop_attacks(server, args.timeout))
    run_http(server, tally, pertoken_attacks(server))
    stream_attacks(server, tally)
    run_http(server, tally, types_attacks(server), quiet=True)
    run_http(server, tally, store_attacks(server), quiet=True)
    for framing in FRAMINGS:
        tally.add("smuggle", *smuggle_attack(server, framing))
    elapsed = time.perf_counter() - t0
    probe.stop()
    normal.finish()
    if server.check():
        tally.add("all", "death", "server gone at the end")
    after = wait_idle(server)
    request(server, "POST", "/flush_cache", timeout=300)
    after = engine_stats(server)
    rss_after = rss_kib(server.proc.pid)
    server.stop()

    probes = probe.read()
    Path(probe_file.name).unlink(missing_ok=True)
    latencies = {k: sorted(p["s"] for p in probes if p["kind"] == k and p["ok"]) for k in ("http", "ws")}
    stalls = [p for p in probes if p["kind"] in ("http", "ws") and (p["s"] > STALL_S or not p["ok"])]
    lockouts = [p for p in probes if p["kind"] in ("http_new", "ws_new") and not p["ok"]]
    lockouts_total = len(lockouts) + tally.total("lockout")

    classes = sorted(tally.tried)
    kinds = ("typed4xx", "accepted", "closed", "5xx", "hang", "lockout", "death")
    print(f"{'class':10s} {'tried':>6s} {'typed4xx':>9s} {'accepted':>9s} {'closed':>7s} {'5xx':>5s} {'hang':>5s} "
          f"{'lockout':>8s} {'death':>6s}")
    for c in classes:
        o = {k: tally.outcome[(c, k)] for k in kinds}
        print(f"{c:10s} {tally.tried[c]:6d} {o['typed4xx']:9d} {o['accepted']:9d} {o['closed']:7d} {o['5xx']:5d} "
              f"{o['hang']:5d} {o['lockout']:8d} {o['death']:6d}")
    for ex in tally.examples:
        print("  !", ex)
    for w in normal.wrong[:10]:
        print("  normal session wrong:", w)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    for kind, xs in latencies.items():
        print(f"probe {kind}: {len(xs)} ok, p50 {pct(xs, 0.5) * 1000:.0f} ms, p99 {pct(xs, 0.99) * 1000:.0f} ms, "
              f"max {max(xs, default=float('nan')) * 1000:.0f} ms")
    print(f"stalls over {STALL_S:g} s (or failed probes): {len(stalls)}; lock-outs: {lockouts_total} "
          f"({len(lockouts)} of {sum(p['kind'] in ('http_new', 'ws_new') for p in probes)} new-client probes)")
    print(f"normal sessions: {normal.ok} correct, {len(normal.wrong)} wrong; attacks took {elapsed:.1f} s")
    print(f"KV pool free: {before.get('pool_free')} -> {after.get('pool_free')} of {after.get('pool_total')}; "
          f"server RSS: {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    result = {
        "bench": "attack", "attacks": sum(tally.tried.values()), "typed_4xx": tally.total("typed4xx"),
        "accepted": tally.total("accepted"), "closed": tally.total("closed"), "5xx": tally.total("5xx"),
        "hangs": tally.total("hang"), "deaths": server.deaths, "stalls": len(stalls), "lockouts": lockouts_total,
        "probe_http_max_ms": round(max(latencies["http"], default=0) * 1000),
        "probe_ws_max_ms": round(max(latencies["ws"], default=0) * 1000),
        "probe_http_p99_ms": round(pct(latencies["http"], 0.99) * 1000) if latencies["http"] else None,
        "normal_ok": normal.ok,
        "normal_wrong": len(normal.wrong), "pool_free_before": before.get("pool_free"),
        "pool_free_after": after.get("pool_free"), "pool_total": after.get("pool_total"),
        "rss_mib_before": round(rss_before / 1024), "rss_mib_after": round(rss_after / 1024),
        "by_class": {c: dict((k, v) for (cc, k), v in tally.outcome.items() if cc == c) for c in classes},
        "seconds": round(elapsed, 1), "load_average": [round(x, 1) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
