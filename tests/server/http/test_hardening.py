"""Issue 15, HTTP side: typed 4xx instead of 500s (seed outside 64 bits, deep JSON, no exception
text to clients), web hardening (Origin, Content-Type, POST-only state changes), a large request
off the event loop, header/body timeouts and the connection cap. Raw HTTP over real sockets
against the real server (uvicorn thread) on the default model."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    chat_body,
    http_engine,
    http_server,
    raw,
    wait_idle,
)


def error_of(status: int, body: dict, expected: int) -> dict:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- field ranges ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", lambda s: chat_body(seed=s, max_tokens=1)),
    ("/v1/completions", lambda s: {"model": MODEL_NAME, "prompt": "Hi", "seed": s, "max_tokens": 1}),
    ("/generate", lambda s: {"text": "Hi", "sampling_params": {"seed": s, "max_tokens": 1}}),
])
def test_seed_outside_64_bits_is_a_400_naming_seed(http_server, http_engine, path, body, seed):
    status, _, payload = raw(http_server.url, "POST", path, body(seed))
    err = error_of(status, payload, 400)
    assert "seed" in (err["param"] or "") and "seed" in err["message"]
    assert wait_idle(http_engine)["running"] == 0


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_float_fields_given_as_huge_integers_are_a_400(http_server, http_engine, name):
    """torch overflows on a Python int past 2**63 as an operand: refused where parsed."""
    before = http_engine.stats()["aborted"]
    status, _, payload = raw(http_server.url, "POST", "/generate",
                             {"text": "Hi", "sampling_params": {name: 2**64, "max_tokens": 1}})
    err = error_of(status, payload, 400)
    assert name in err["param"] and "2**53" in err["message"]
    assert http_engine.stats()["aborted"] == before  # nothing reached the engine


def test_seed_at_the_64_bit_edges_is_accepted(http_server):
    for seed in (2**64 - 1, -(2**63)):
        status, _, payload = raw(http_server.url, "POST", "/generate",
                                 {"text": "Hi", "sampling_params": {"seed": seed, "max_tokens": 1,
                                                                    "temperature": 1.0}})
        assert status == 200, payload
        assert payload["meta_info"]["completion_tokens"] == 1


def test_n_choices_whose_derived_seed_overflows_are_refused_whole(http_server, http_engine):
    before = http_engine.stats()["aborted"]
    status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions",
                             chat_body(seed=2**64 - 1, n=2, max_tokens=1))
    assert error_of(status, payload, 400)["param"] == "seed"
    assert http_server.api.in_flight == 0
    assert http_engine.stats()["aborted"] == before  # nothing was submitted


# ---- nesting depth --------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [100, 1_000, 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate", "/tokenize",
                                  "/apply_chat_template"])
def test_deep_json_is_a_400_that_names_the_limit(http_server, path, depth):
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "m", "prompt": {nested}, "messages": {nested}}}'.encode()
    status, _, payload = raw(http_server.url, "POST", path, raw_body=body)
    err = error_of(status, payload, 400)
    assert "max_json_depth" in err["message"] and str(depth + 1) in err["message"]


def test_depth_inside_strings_does_not_count(http_server):
    prompt = "[" * 5000 + "{" * 5000
    status, _, payload = raw(http_server.url, "POST", "/tokenize", {"prompt": prompt})
    assert status == 200, payload
    assert payload["count"] > 0


# ---- no exception text to clients -----------------------------------------------------------------

def test_an_unexpected_error_is_a_500_without_exception_text(http_server):
    api = http_server.api
    renderer = api.renderer

    class Broken:
        def render(self, *a, **k):
            raise RuntimeError("secret detail /home/user/.cache/x")

    api.renderer = Broken()
    try:
        status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
    finally:
        api.renderer = renderer
    err = error_of(status, payload, 500)
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    assert "incident" in err["message"] and err["code"] == "internal_error"


# ---- constraints that cannot finish: a typed 4xx at compile time or when the matcher gives up ----

#: Every value it allows would have to contain itself: no finite instance.
NO_FINITE = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                             "required": ["next"]}}, "$ref": "#/$defs/n"}
COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tool_parameters_with_no_finite_instance_are_a_400_naming_the_tool(http_server, choice):
    body = chat_body(max_tokens=4, tool_choice=choice,
                     tools=[{"type": "function", "function": {"name": "f", "parameters": NO_FINITE}}])
    status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions", body)
    err = error_of(status, payload, 400)
    assert err["code"] == "grammar_error" and err["param"] == "tools", err
    assert "'f'" in err["message"] and "no finite instance" in err["message"]


def test_a_grammar_that_hits_a_matcher_limit_mid_generation_is_the_clients_error(http_server):
    # A Lark grammar embedding such a schema compiles (the %json inside is llguidance's); the
    # matcher then hits its item limit on the first token. That is the request's fault.
    grammar = "start: %json " + json.dumps({**NO_FINITE, "x-guidance": COMPACT})
    status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=4, grammar=grammar))
    err = error_of(status, payload, 400)
    assert err["code"] == "grammar_error" and err["param"] == "grammar", err
    assert "grammar engine limit" in err["message"] and "incident" not in err["message"]
    status, _, payload = raw(http_server.url, "POST", "/generate",
                             {"text": "x", "sampling_params": {"max_tokens": 4, "grammar": grammar}})
    assert status == 200 and payload["meta_info"]["finish_reason"] == "abort", payload
    assert "grammar engine limit" in payload["meta_info"]["error"], payload


# ---- web hardening --------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_post_needs_application_json(http_server, ctype):
    status, _, payload = raw(http_server.url, "POST", "/generate", headers={"content-type": ctype},
                             raw_body=json.dumps({"text": "Hi", "sampling_params": {"max_tokens": 1}}).encode())
    assert error_of(status, payload, 415)["code"] == "unsupported_media_type"


def test_flush_cache_is_post_only(http_server):
    status, _, payload = raw(http_server.url, "GET", "/flush_cache")
    assert error_of(status, payload, 405)["code"] == "method_not_allowed"
    status, _, payload = raw(http_server.url, "POST", "/flush_cache", headers={"content-type": "text/plain"},
                             raw_body=b"x")
    assert status == 415
    status, _, payload = raw(http_server.url, "POST", "/flush_cache")
    assert status == 200 and payload == {"ok": True}


@pytest.mark.parametrize("origin, allowed", [
    ("https://evil.example", False), ("null", False), ("http://localhost.evil.example", False),
    ("http://localhost:5173", True), ("http://127.0.0.1:3000", True), ("http://[::1]:8080", True),
])
def test_browser_origins(http_server, origin, allowed):
    status, _, payload = raw(http_server.url, "POST", "/tokenize", {"prompt": "Hi"}, headers={"origin": origin})
    if allowed:
        assert status == 200, payload
    else:
        assert error_of(status, payload, 403)["code"] == "origin_not_allowed"


def test_allowed_origins_list(http_engine):
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, allowed_origins=("https://app.example",)) as srv:
        ok = raw(srv.url, "POST", "/tokenize", {"prompt": "Hi"}, headers={"origin": "https://app.example"})
        bad = raw(srv.url, "POST", "/tokenize", {"prompt": "Hi"}, headers={"origin": "https://other.example"})
    assert ok[0] == 200 and bad[0] == 403


# ---- one client must not stall the others ---------------------------------------------------------

def test_a_large_prompt_does_not_hold_the_event_loop(http_server):
    """A ~3 MB prompt is tokenized on a worker thread: /health answers while it is in flight."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 70_000  # ~3.1 MB
    events: list[str] = []
    lock = threading.Lock()

    def big() -> None:
        status, _, _ = raw(http_server.url, "POST", "/tokenize", {"prompt": prompt})
        with lock:
            events.append(f"big:{status}")

    reads_before = http_server.api.bodies_read
    t = threading.Thread(target=big)
    t.start()
    # NOTE: wait until the big request is being worked on (its body read), then probe /health.
    while http_server.api.bodies_read == reads_before and t.is_alive():
        time.sleep(0.005)
    status, _, _ = raw(http_server.url, "GET", "/health")
    with lock:
        events.append(f"health:{status}")
    t.join()
    assert events == ["health:200", "big:200"], events


# ---- timeouts and the connection cap --------------------------------------------------------------

def _open(url: str) -> socket.socket:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (EOF or reset) within the socket's timeout."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_half_open_and_slow_connections_are_closed(http_engine):
    from sgrt.server.http.server import HttpServerThread

    # NOTE: 1 s timeouts: long enough that the test's own sends arrive in time on a loaded machine.
    with HttpServerThread(http_engine, model_name=MODEL_NAME, header_timeout_s=1.0, body_timeout_s=1.0) as srv:
        silent = _open(srv.url)  # connects, sends nothing
        partial = _open(srv.url)  # part of the headers, then nothing
        partial.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        slow_body = _open(srv.url)  # headers, then part of the body
        slow_body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"text\":")
        for s in (silent, partial):
            assert _closed_by_server(s)
        reply = b""
        try:
            while chunk := slow_body.recv(65536):
                reply += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        # the server still answers normal clients
        assert raw(srv.url, "GET", "/health")[0] == 200
        for s in (silent, partial, slow_body):
            s.close()


def test_connection_cap(http_engine):
    from sgrt.server.http.server import HttpServerThread

    # At the cap a new connection closes the one that has waited longest for a request's headers
    # (here the first idle one) and is served itself: idle sockets cannot lock clients out.
    # (header_timeout_s far above the socket timeouts: no closing by the header timer here.)
    with HttpServerThread(http_engine, model_name=MODEL_NAME, max_connections=3, header_timeout_s=600) as srv:
        held = [_open(srv.url) for _ in range(3)]
        for s in held:  # each connection accepted (and timed) before the next
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        extra = _open(srv.url)
        assert _closed_by_server(held[0])
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(65536).startswith(b"HTTP/1.1 200")
        held[1].settimeout(0.5)
        assert not _closed_by_server(held[1])  # one eviction per new connection, not more
        for s in held:
            s.close()
        extra.close()
        deadline = time.monotonic() + 120
        while True:  # the held sockets' close reaches the server asynchronously
            try:
                status = raw(srv.url, "GET", "/health")[0]
                break
            except (ConnectionError, OSError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert status == 200


# ---- finished requests leave the queue count ------------------------------------------------------

def test_finished_requests_leave_the_queue_count_before_they_are_released(http_engine):
    """A request counts against max_queue until the engine finishes it, whether or not its
    response has been sent (a client that stops reading a stream must not hold queue places)."""
    from sgrt.engine import SamplingParams
    from sgrt.server.http.core import EngineCall, HttpApi
    from sgrt.server.http.errors import ApiError

    api = HttpApi(http_engine, MODEL_NAME)
    api.limits.max_queue = 4
    ids = http_engine.tokenizer.encode("Hello")
    calls = [EngineCall(ids, SamplingParams(max_tokens=4, ignore_eos=True), i) for i in range(4)]
    handles = api.submit(calls)
    assert api.in_flight == 4
    with pytest.raises(ApiError) as info:  # full while they run
        api.submit(calls[:1])
    assert info.value.status == 429
    for h in handles:
        h.result(timeout=300)
    assert api.in_flight == 0  # finished, never released
    again = api.submit(calls)
    for h in again:
        h.result(timeout=300)
    api.release(handles + again)
    assert api.in_flight == 0
    api.shutdown_workers()
