"""Fixtures and helpers of the HTTP API tests (imported by name, as
``from tests.server.conftest_http import http_server``, by the tests under ``tests/server/http``,
``openai``, ``anthropic``, ``sglang`` and ``turns``, and by ``tests/backends/test_http_*.py``;
the WebSocket fixtures are in ``conftest.py`` beside it).

The server is the real thing: uvicorn on a background thread, on a free loopback port, over a
float32 engine built from the session's ``loaded_model``.
"""
from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest

MODEL_NAME = "smollm2-135m-instruct"


def has_constraints() -> bool:
    """Whether the constrained-decoding layer is in place (json_schema / regex / tools need it)."""
    try:
        from sgrt.constrained import GrammarCompiler  # noqa: F401
    except ImportError:
        return False
    return True


needs_constraints = pytest.mark.skipif(not has_constraints(),
                                       reason="sgrt.constrained (GrammarCompiler) not available yet")


@pytest.fixture(scope="module")
def http_engine(loaded_model):
    from sgrt.engine import Engine

    eng = Engine(model=loaded_model, max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def http_server(http_engine):
    """The HTTP API over ``http_engine`` on a free loopback port (no auth token)."""
    from sgrt.server.http.server import HttpServerThread

    server = HttpServerThread(http_engine, model_name=MODEL_NAME).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(http_server):
    """The official ``openai`` client pointed at the server."""
    import openai

    c = openai.OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def raw(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
        raw_body: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP request without any client library: ``(status, headers, decoded JSON or bytes)``."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        data = raw_body if raw_body is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    try:
        return resp.status, hdrs, json.loads(payload)
    except ValueError:
        return resp.status, hdrs, payload


def sse_events(payload: bytes) -> list[Any]:
    """The JSON events of a whole SSE body (``[DONE]`` as the string "[DONE]")."""
    out = []
    for block in payload.decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(engine: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the engine has nothing running or waiting; return its stats. ``timeout`` bounds
    the wait (generous: a loaded 2-core CI machine is several times slower), it checks no speed."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout} s: {stats}")
        time.sleep(0.02)


def chat_body(content: str = "Say hello.", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **fields}
