"""HTTP API error cases with raw HTTP (no client library): OpenAI-style bodies and status codes,
auth, limits, and a dropped stream freeing its KV slots."""
from __future__ import annotations

import http.client
import json
import time

import pytest

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    chat_body,
    http_engine,
    http_server,
    needs_constraints,
    raw,
    sse_events,
    wait_idle,
)


def assert_error(status: int, body: dict, expected_status: int, param: str | None = None) -> dict:
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body, param", [
    (chat_body(temperature=-1), "temperature"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(max_tokens=-3), "max_tokens"),
    (chat_body(max_tokens="ten"), "max_tokens"),
    (chat_body(n=0), "n"),
    (chat_body(n=1000), "n"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat_body(max_tokns=5), "max_tokns"),
    (chat_body(stop=[""]), "stop"),
    (chat_body(logit_bias={"50": 10}), "logit_bias"),
    (chat_body(response_format={"type": "yaml"}), "response_format.type"),
    (chat_body(regex="a+", grammar="start: 'a'"), "grammar"),
    (chat_body(tool_choice="required"), "tool_choice"),
    (chat_body(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
               tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice.function.name"),
    ({"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"model": MODEL_NAME, "messages": []}, "messages"),
    ({"model": MODEL_NAME}, "messages"),
    (chat_body(max_tokens=100_000), "messages"),  # past the context window
])
def test_chat_400_names_the_field(http_server, body, param):
    status, _, out = raw(http_server.url, "POST", "/v1/chat/completions", body)
    assert_error(status, out, 400, param)
    assert out["error"]["type"] == "invalid_request_error"


def test_completions_and_generate_400(http_server):
    url = http_server.url
    for body, param in [
        ({"model": MODEL_NAME, "prompt": [1, "a"]}, "prompt"),
        ({"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": MODEL_NAME, "prompt": "x", "logprobs": 99}, "logprobs"),
        ({"model": MODEL_NAME, "prompt": [10 ** 9]}, "prompt[0]"),  # the id out of the vocabulary
    ]:
        status, _, out = raw(url, "POST", "/v1/completions", body)
        assert_error(status, out, 400, param)
    status, _, out = raw(url, "POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": -1}})
    assert_error(status, out, 400, "sampling_params.max_tokens")
    status, _, out = raw(url, "POST", "/generate", {"text": "x", "input_ids": [1]})
    assert_error(status, out, 400, "text")
    status, _, out = raw(url, "POST", "/v1/chat/completions", raw_body=b"{not json")
    assert_error(status, out, 400)
    status, _, out = raw(url, "GET", "/v1/nothing")
    assert_error(status, out, 404)
    status, _, out = raw(url, "GET", "/v1/chat/completions")
    assert_error(status, out, 405)


@needs_constraints
def test_grammar_error_is_400_also_for_streams(http_server):
    body = chat_body(grammar="start: ((( not lark", max_tokens=4)
    status, _, out = raw(http_server.url, "POST", "/v1/chat/completions", body)
    err = assert_error(status, out, 400)
    assert err["code"] == "grammar_error"
    status, _, out = raw(http_server.url, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert assert_error(status, out, 400)["code"] == "grammar_error"


def test_auth_token(http_engine):
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, auth_token="s3cret") as server:
        status, _, out = raw(server.url, "GET", "/v1/models")
        assert_error(status, out, 401, "authorization")
        status, _, out = raw(server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1),
                             headers={"authorization": "Bearer wrong"})
        assert_error(status, out, 401)
        status, _, out = raw(server.url, "GET", "/v1/models", headers={"authorization": "Bearer s3cret"})
        assert status == 200 and out["data"][0]["id"] == MODEL_NAME
        status, _, out = raw(server.url, "GET", "/health")  # open, without the engine's stats
        assert status == 200 and "engine" not in out
        import openai

        c = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, temperature=0)
        assert r.usage.completion_tokens <= 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_413_body_too_large(http_engine):
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, max_body_bytes=2048) as server:
        status, _, out = raw(server.url, "POST", "/v1/chat/completions", chat_body("x" * 5000))
        assert_error(status, out, 413)
        status, _, out = raw(server.url, "POST", "/v1/chat/completions", chat_body("ok", max_tokens=1))
        assert status == 200


def _open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_429_over_queue_limit(http_engine):
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, max_queue=2) as server:
        long_body = chat_body("Tell a long story.", max_tokens=1000, temperature=0, ignore_eos=True, stream=True)
        conn, resp = _open_stream(server.url, long_body)
        try:
            resp.readline()  # the stream is running: 1 request in flight
            status, _, out = raw(server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1, n=2))
            err = assert_error(status, out, 429)
            assert err["code"] == "queue_full"
            status, headers, out = raw(server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
            assert status == 200  # 1 + 1 <= 2
        finally:
            conn.close()
        wait_idle(http_engine)
        assert server.api.in_flight == 0


def test_503_when_engine_stopped_or_closing(loaded_model, http_engine):
    from sgrt.engine import Engine
    from sgrt.server.http.server import HttpServerThread

    stopped = Engine(model=loaded_model, max_total_tokens=64)
    stopped.shutdown()
    with HttpServerThread(stopped, model_name=MODEL_NAME) as server:
        status, _, out = raw(server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
        assert_error(status, out, 503)
        status, _, out = raw(server.url, "GET", "/health")
        assert_error(status, out, 503)
    with HttpServerThread(http_engine, model_name=MODEL_NAME) as server:
        server.api.closing = True
        status, _, out = raw(server.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert assert_error(status, out, 503)["code"] == "closing"


@pytest.mark.parametrize("n", [1, 2])
def test_dropped_stream_aborts_and_frees_kv(http_server, http_engine, n):
    """A client that closes an SSE stream mid-way aborts its requests: the engine goes idle long
    before 1000 tokens, and after a cache flush the KV pool's free list is whole again."""
    wait_idle(http_engine)
    http_engine.flush_cache()
    free_at_start = http_engine.pool.num_free
    aborted_before = http_engine.stats()["aborted"]
    body = chat_body("Write a very long essay.", max_tokens=1000, temperature=0, ignore_eos=True, stream=True, n=n)
    conn, resp = _open_stream(http_server.url, body)
    got = 0
    while got < 3 + n:  # role chunks, then content
        line = resp.readline()
        got += line.startswith(b"data: ")
    conn.sock.close()
    conn.close()
    stats = wait_idle(http_engine, timeout=120)  # a bound on the wait, not a speed check
    assert stats["aborted"] == aborted_before + n
    assert http_server.api.in_flight == 0
    http_engine.flush_cache()
    assert http_engine.pool.num_free == free_at_start == http_engine.pool.num_slots
    http_engine.check_integrity()


def test_dropped_plain_request_aborts(http_server, http_engine):
    """A non-streaming request whose client goes away is aborted too."""
    wait_idle(http_engine)
    aborted_before = http_engine.stats()["aborted"]
    host, port = http_server.url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                 body=json.dumps(chat_body("Write a long essay.", max_tokens=1000, ignore_eos=True)).encode())
    deadline = time.monotonic() + 120
    while http_engine.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    conn.sock.close()
    conn.close()
    stats = wait_idle(http_engine)
    assert stats["aborted"] == aborted_before + 1 and http_server.api.in_flight == 0


def test_closing_the_server_aborts_open_streams(http_engine):
    from sgrt.server.http.server import HttpServerThread

    wait_idle(http_engine)
    aborted_before = http_engine.stats()["aborted"]
    server = HttpServerThread(http_engine, model_name=MODEL_NAME).start()
    conn, resp = _open_stream(server.url, chat_body("Write a long essay.", max_tokens=1000, ignore_eos=True,
                                                    stream=True))
    try:
        resp.readline()
        server.stop()
        events = sse_events(resp.read())  # the stream ended properly, as aborted
    finally:
        conn.close()
    # NOTE: no wall-clock bound (shared machines): the stream was cut long before its 1,000
    # tokens, and the engine counts it as aborted.
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 500, len(events)
    stats = wait_idle(http_engine, timeout=120)
    assert stats["aborted"] == aborted_before + 1 and server.api.in_flight == 0
