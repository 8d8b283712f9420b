"""The model names the HTTP API answers to (issue 41): a request naming another model is a 404
``model_not_found`` listing the served names (as OpenAI and vLLM answer), on every endpoint that
takes a ``model``."""
from __future__ import annotations

import pytest

from .conftest_http import http_engine, raw  # noqa: F401 - fixture

NAMES = ["tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def named_server(http_engine):  # noqa: F811 - the fixture
    from sgrt.server.http_api import HttpServerThread

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


def test_models_lists_every_name(named_server):
    status, _, payload = raw(named_server.url, "GET", "/v1/models")
    assert status == 200 and [card["id"] for card in payload["data"]] == NAMES
    status, _, card = raw(named_server.url, "GET", "/v1/models/tiny-alias")
    assert status == 200 and card["id"] == "tiny-alias"
    status, _, payload = raw(named_server.url, "GET", "/v1/models/other")
    assert status == 404 and payload["error"]["code"] == "model_not_found"
