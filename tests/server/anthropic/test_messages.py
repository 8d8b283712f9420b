"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic`` client,
against the live server on the default model."""
from __future__ import annotations

import pytest

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    http_engine,
    http_server,
    needs_constraints,
    raw,
)

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


GREEDY = {"temperature": 0}  # recent SDKs dropped the sampling fields; the server still takes them


@pytest.fixture(scope="module")
def aclient(http_server):
    c = anthropic.Anthropic(base_url=http_server.url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def test_text_message_system_and_stop(aclient, http_server):
    m = aclient.messages.create(model=MODEL_NAME, max_tokens=6, system="Answer briefly.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Say hello."}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    # A stop sequence taken from the greedy answer itself stops there and is reported.
    word = m.content[0].text.split()[0] if m.content[0].text.split() else m.content[0].text
    stopped = aclient.messages.create(model=MODEL_NAME, max_tokens=6, system="Answer briefly.", extra_body=GREEDY,
                                      messages=[{"role": "user", "content": "Say hello."}], stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    status, _, body = raw(http_server.url, "POST", "/v1/messages", {"max_tokens": 1, "messages": [], "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus"


@needs_constraints
def test_tool_use_round_trip(aclient):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = aclient.messages.create(model=MODEL_NAME, max_tokens=30, extra_body=GREEDY, tools=[WEATHER], messages=msgs,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and set(uses[0].input) == {"city"}
    assert uses[0].id.startswith("call_")
    follow = aclient.messages.create(
        model=MODEL_NAME, max_tokens=8, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=msgs + [{"role": "assistant", "content": m.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                       "content": "sunny, 21 C"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text
    assert follow.usage.cache_read_input_tokens > 0  # the first turn's prefix came from the radix cache


@needs_constraints
def test_streamed_events(aclient):
    with aclient.messages.stream(model=MODEL_NAME, max_tokens=30, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(parts) > 2
    assert final.stop_reason == "tool_use" and final.content[0].input["city"]
    with aclient.messages.stream(model=MODEL_NAME, max_tokens=5, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Say hi."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens"


def test_auth_token_x_api_key_and_bearer(http_engine):
    """With an auth token, the anthropic SDK's ``x-api-key`` header and a Bearer token both
    pass; a wrong or missing key is a 401 in Anthropic's error shape, which the SDK raises as
    ``AuthenticationError``."""
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, auth_token="s3cret") as server:
        msgs = [{"role": "user", "content": "Say hi."}]
        with anthropic.Anthropic(base_url=server.url, api_key="s3cret", max_retries=0) as good:
            m = good.messages.create(model=MODEL_NAME, max_tokens=2, messages=msgs, extra_body=GREEDY)
            assert m.usage.output_tokens == 2 and m.stop_reason == "max_tokens"
            with good.messages.stream(model=MODEL_NAME, max_tokens=2, messages=msgs, extra_body=GREEDY) as s:
                assert s.get_final_message().usage.output_tokens == 2
        with anthropic.Anthropic(base_url=server.url, auth_token="s3cret", max_retries=0) as bearer:
            m = bearer.messages.create(model=MODEL_NAME, max_tokens=1, messages=msgs, extra_body=GREEDY)
            assert m.usage.output_tokens == 1
        with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as err:
                bad.messages.create(model=MODEL_NAME, max_tokens=1, messages=msgs)
            assert err.value.status_code == 401
            assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.AuthenticationError):
                with bad.messages.stream(model=MODEL_NAME, max_tokens=1, messages=msgs) as s:
                    s.get_final_message()
        status, _, body = raw(server.url, "POST", "/v1/messages", {"max_tokens": 1, "messages": msgs})
        assert status == 401 and body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]
        # A Bearer token and x-api-key are both read everywhere; the OpenAI routes keep OpenAI's shape.
        status, _, body = raw(server.url, "GET", "/v1/models", headers={"x-api-key": "s3cret"})
        assert status == 200 and body["data"][0]["id"] == MODEL_NAME
        status, _, body = raw(server.url, "GET", "/v1/models", headers={"x-api-key": "nope", "authorization": "Bearer no"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and "type" not in body
