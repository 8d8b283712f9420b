"""The model names the HTTP API answers to (issue 41): a request naming another model is a 404
``model_not_found`` listing the served names (as OpenAI and vLLM answer), on every endpoint that
takes a ``model``; ``sgrt serve --served-model-name`` sets the names and ``--chat-template`` the
template, checked on the process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest_http import http_engine, raw  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def named_server(http_engine):  # noqa: F811 - the fixture
    from sgrt.server.http.server import HttpServerThread

    server = HttpServerThread(http_engine, model_name=NAMES[0], model_aliases=NAMES[1:]).start()
    yield server
    server.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/tokenize", {"prompt": "Hi"}),
])
def test_unknown_model_is_404_and_served_names_pass(named_server, path, body):
    status, _, payload = raw(named_server.url, "POST", path, {**body, "model": "gpt-4o"})
    assert status == 404, payload
    err = payload["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gpt-4o' does not exist" in err["message"] and "'tiny', 'tiny-alias'" in err["message"]
    for name in (*NAMES, None):  # each served name, and no name at all
        status, _, payload = raw(named_server.url, "POST", path, {**body, **({"model": name} if name else {})})
        assert status == 200, (name, payload)


def test_native_generate_ignores_model_as_sglang_does(named_server):
    """An SGLang router forwards its client's ``model`` to /generate, which SGLang ignores."""
    status, _, payload = raw(named_server.url, "POST", "/generate",
                             {"text": "Hi", "model": "gpt-4o", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and payload["meta_info"]["completion_tokens"] == 1, payload


def test_models_lists_every_name(named_server):
    status, _, payload = raw(named_server.url, "GET", "/v1/models")
    assert status == 200 and [card["id"] for card in payload["data"]] == NAMES
    status, _, card = raw(named_server.url, "GET", "/v1/models/tiny-alias")
    assert status == 200 and card["id"] == "tiny-alias"
    status, _, payload = raw(named_server.url, "GET", "/v1/models/other")
    assert status == 404 and payload["error"]["code"] == "model_not_found"


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    """``sgrt serve`` on free ports: the process and its HTTP API's base URL (once it listens)."""
    proc = subprocess.Popen([sys.executable, "-m", "sgrt.cli", "serve", "--port", "0", "--http-port", "0",
                             "--max-total-tokens", "1024", "--quiet", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "OpenAI-compatible API on " in line:
            return proc, line.strip().rsplit(" ", 1)[-1].removesuffix("/v1")
    proc.wait(timeout=60)
    raise AssertionError(f"sgrt serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_names_and_chat_template_as_a_process():
    """--served-model-name: the names /v1/models lists and requests must use; --chat-template:
    the template the server renders chats with (Llama 3's turn format on SmolLM2 here)."""
    proc, url = _serve("--served-model-name", *NAMES, "--chat-template", "llama3")
    try:
        status, _, payload = raw(url, "GET", "/v1/models")
        assert [card["id"] for card in payload["data"]] == NAMES
        status, _, payload = raw(url, "POST", "/v1/chat/completions",
                                 {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 404 and payload["error"]["code"] == "model_not_found"
        status, _, payload = raw(url, "POST", "/apply_chat_template",
                                 {"messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200, payload
        assert "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" in payload["text"]
    finally:
        status = _stop(proc)
    assert status == 0


def test_serve_default_names_of_a_path():
    """Without --served-model-name a GGUF path is served under the path, its file name and stem."""
    from sgrt.models.specs import default_gguf_path

    gguf = default_gguf_path()
    proc, url = _serve("--model", str(gguf))
    try:
        status, _, payload = raw(url, "GET", "/v1/models")
        assert [card["id"] for card in payload["data"]] == [str(gguf), gguf.name, gguf.stem]
        status, _, payload = raw(url, "POST", "/v1/completions", {"model": gguf.stem, "prompt": "Hi", "max_tokens": 1})
        assert status == 200, payload
    finally:
        status = _stop(proc)
    assert status == 0
