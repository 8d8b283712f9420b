"""Fixtures for the session-server tests: a real engine on the default model (session-scoped),
a scripted fake engine (for flows the small model cannot be relied on to take, such as a tool
call), and a helper that runs the real server on a free loopback port."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from sgrt.engine import EngineInfo, RequestHandle, Result, SamplingParams, StreamChunk

REPO = Path(__file__).resolve().parents[2]
PROGRAMS_DIR = REPO / "programs"


@pytest.fixture(scope="session")
def ws_engine(loaded_model):
    """An engine on the default model with a 4096-token KV pool, shared by the server tests."""
    from sgrt.engine import Engine

    engine = Engine(model=loaded_model, max_total_tokens=4096)
    yield engine
    engine.shutdown()


async def recv(ws: Any, timeout: float = 60.0) -> Any:
    """The next session-protocol message from the raw WebSocket ``ws``, decoded."""
    from sgrt.server.ws import protocol

    return protocol.decode_server(await asyncio.wait_for(ws.recv(), timeout))


async def recv_until(ws: Any, kind: type, timeout: float = 120.0) -> list[Any]:
    """Messages up to and including the first of type ``kind``."""
    out = []
    while True:
        msg = await recv(ws, timeout)
        out.append(msg)
        if isinstance(msg, kind):
            return out


@contextlib.asynccontextmanager
async def running_server(engine: Any, **kw: Any):
    """The real session server on 127.0.0.1, port chosen by the OS."""
    from sgrt.server import serve_ws

    server = await serve_ws(engine, host="127.0.0.1", port=0, **kw)
    try:
        yield server
    finally:
        await server.close()


async def wait_engine_idle(engine: Any, timeout: float = 120.0) -> None:
    """Wait until the engine has no running or waiting request (``timeout`` bounds the wait; it
    checks no speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = engine.stats()
        if st["running"] == 0 and st["waiting"] == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.stats()}")


class FakeEngine:
    """Engine stand-in (an :class:`~sgrt.engine.client.EngineClient`) that answers each request
    with the next scripted text, a token per ``delay`` seconds, through a real
    :class:`RequestHandle`. Records prompts and params."""

    metrics = None

    def __init__(self, tokenizer: Any, script: list[str], delay: float = 0.002):
        self.tokenizer = tokenizer
        self.info = EngineInfo(model_name="fake", context_length=4096, vocab_size=len(tokenizer),
                               max_total_tokens=4096, tokenizer=tokenizer)
        self.script = deque(script)
        self.delay = delay
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.aborted: set[str] = set()
        self._ids = itertools.count()

    def submit(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        self.prompts.append(ids)
        self.params.append(params)
        rid = request_id or f"fake-{next(self._ids)}"
        handle = RequestHandle(rid, self.abort)
        text = self.script.popleft() if self.script else "ok"
        threading.Thread(target=self._run, args=(handle, ids, text, params), daemon=True).start()
        return handle

    def _run(self, handle: RequestHandle, prompt: list[int], text: str, params: SamplingParams) -> None:
        out = self.tokenizer.encode(text)[: params.max_tokens]
        t0 = time.monotonic()
        sent: list[int] = []
        for tok in out:
            time.sleep(self.delay)
            if handle.request_id in self.aborted:
                break
            sent.append(tok)
            text = self.tokenizer.decode([tok], skip_special_tokens=params.skip_special_tokens)
            handle.push(StreamChunk(handle.request_id, text, [tok]))
        aborted = len(sent) < len(out)
        reason = "abort" if aborted else ("length" if len(out) == params.max_tokens else "stop")
        text = self.tokenizer.decode(sent, skip_special_tokens=params.skip_special_tokens)
        result = Result(request_id=handle.request_id, text=text, token_ids=sent,
                        finish_reason=reason, prompt_tokens=len(prompt), completion_tokens=len(sent),
                        ttft=self.delay, total_time=time.monotonic() - t0)
        handle.push(StreamChunk(handle.request_id, "", [], finished=True, result=result))

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stream(self, prompt: Any, params: SamplingParams) -> Any:
        return iter(self.submit(prompt, params))

    def flush_cache(self) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"running": 0, "waiting": 0}
