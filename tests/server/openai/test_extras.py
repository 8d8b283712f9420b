"""Documented OpenAI fields accepted (and logged as ignored), ``GET /v1/models/{id}``,
``GET /metrics`` (Prometheus text), and a family tool-call format (Hermes ``<tool_call>``)
forced on the default model, against the live server."""
from __future__ import annotations

import json
import logging

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sgrt.server.turns import formats as tf
from sgrt.server.openai.adapter import format_calls

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    chat_body,
    client,
    http_engine,
    http_server,
    needs_constraints,
    raw,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def test_documented_fields_accepted_unknown_refused(client, http_server, caplog):
    caplog.set_level(logging.WARNING, logger="sgrt.server.http")
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        reasoning_effort="low",
        verbosity="low", modalities=["text"], prediction={"type": "content", "content": "x"},
        prompt_cache_retention="24h", user="u1", store=False, metadata={"a": "b"},
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = list(r)
    assert chunks[-1].usage.completion_tokens == 2
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    for name in ("verbosity", "modalities", "prediction", "prompt_cache_retention", "user", "metadata",
                 "reasoning_effort"):
        assert name in logged, name
    status, _, body = raw(http_server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1, not_a_field=1))
    assert status == 400 and body["error"]["param"] == "not_a_field"


def test_model_by_id(client):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.owned_by == "sgrt"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@needs_constraints
def test_metrics_prometheus_text(client, http_server):
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Pick a digit."}],
                                   max_tokens=3, extra_body={"regex": "[0-9]{2}"})
    status, headers, text = raw(http_server.url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text)}
    ok = [s for s in families["sgrt_http_requests"].samples
          if s.labels.get("path") == "/v1/chat/completions" and s.labels.get("status") == "200"]
    assert ok and ok[0].value >= 1
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert samples["sgrt_time_to_first_token_seconds_count"] >= 1
    assert samples["sgrt_e2e_request_latency_seconds_count"] >= 1
    assert samples["sgrt_inter_token_latency_seconds_count"] >= 1
    assert samples["sgrt_prompt_tokens_total"] > 0 and samples["sgrt_generation_tokens_total"] >= 2
    assert samples["sgrt_grammar_compile_seconds_count"] >= 1
    for gauge in ("sgrt_num_requests_running", "sgrt_num_requests_waiting", "sgrt_kv_pool_usage_ratio",
                  "sgrt_prefix_cache_hit_rate", "sgrt_spec_decode_acceptance_rate"):
        assert gauge in samples, gauge
    assert 0.0 <= samples["sgrt_kv_pool_usage_ratio"] <= 1.0


@pytest.fixture()
def hermes_server(http_server):
    """The same server with the Hermes / Qwen tool-call format forced (as detected from a Qwen
    template); restored afterwards."""
    renderer = http_server.api.renderer
    saved = renderer.traits
    renderer.traits = tf.TemplateTraits(tf.HERMES)
    yield http_server
    renderer.traits = saved


@needs_constraints
def test_hermes_format_on_the_default_model(client, hermes_server, http_engine):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city"}
    # The model wrote the call in the Hermes form: its token count is that text's, not the bare JSON's.
    hermes = len(http_engine.tokenizer.encode(format_calls(tf.HERMES, [("get_weather", args)])))
    bare = len(http_engine.tokenizer.encode(format_calls(tf.GENERIC, [("get_weather", args)])))
    assert hermes > bare + 4 and abs(r.usage.completion_tokens - hermes) <= 2
    # Streamed: the name first, then the arguments in fragments (parsed out of the Hermes text).
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=40, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    tool = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert tool[0].function.name == "get_weather" and len(tool) > 2
    assert json.loads("".join(t.function.arguments or "" for t in tool)) == args
