"""The OpenAI-compatible HTTP API through the official ``openai`` client, against the real server
(uvicorn on loopback) over the default model. Every generation is short (max_tokens <= 24)."""
from __future__ import annotations

import json
import re

import pytest

from sgrt.engine import SamplingParams

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    client,
    http_engine,
    http_server,
    needs_constraints,
    raw,
    sse_events,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}


def prompt_ids(engine, content: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return engine.tokenizer.encode(text)


def test_models_and_health(client, http_server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "sgrt"
    status, headers, body = raw(http_server.url, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and "x-sgrt-version" in headers
    assert body["engine"]["pool_total"] == 4096


def test_chat_plain_matches_engine_and_reports_cache(client, http_engine):
    content = "Name one color."
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                       max_tokens=8, temperature=0)
    choice = r.choices[0]
    ids = prompt_ids(http_engine, content)
    direct = http_engine.generate(ids, SamplingParams(max_tokens=8))
    assert choice.message.role == "assistant" and choice.message.content == direct.text
    assert choice.finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == direct.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == MODEL_NAME
    # The same prompt again: its prefix comes from the radix cache.
    again = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1


def test_openai_defaults_sample_and_seed_reproduces(client):
    """No temperature given -> OpenAI's default 1.0 (not the engine's greedy); n choices with one
    seed differ from each other, reproducibly."""
    msgs = [{"role": "user", "content": "Write one unusual word."}]
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0)
    a = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, n=4, seed=7)
    b = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, n=4, seed=7)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1 or texts[0] != greedy.choices[0].message.content
    assert 4 <= a.usage.completion_tokens <= 40  # summed over the 4 choices
    assert a.usage.prompt_tokens == greedy.usage.prompt_tokens  # the prompt counts once for n choices


def test_chat_stream_with_usage(client):
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    if not any("\ufffd" in e.token for e in content):  # no token splits a UTF-8 character
        assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completions_stop_n_and_batch(client):
    prompt = "Count: 1, 2, 3, 4,"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert base.object == "text_completion" and base.usage.completion_tokens >= 1
    if len(text) > 4:  # stop at a string the greedy output contains
        stop = text[2:4]
        cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    batch = client.completions.create(model=MODEL_NAME, prompt=[prompt, "The sky is"], max_tokens=4, n=2,
                                      temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] == text[:len(by_index[0])]
    ids = client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=1).usage.prompt_tokens
    other = client.completions.create(model=MODEL_NAME, prompt=["The sky is"], max_tokens=1).usage.prompt_tokens
    assert batch.usage.prompt_tokens == ids + other  # each prompt once, whatever n


def test_completions_token_ids_echo_and_logprobs(client, http_engine):
    prompt = "The capital of France is"
    ids = http_engine.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2)
    choice = r.choices[0]
    assert choice.text == prompt + by_text.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens) == choice.text
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])


def test_prompt_logprobs_from_0_on_a_cached_prompt(http_server):
    body = {"text": "A cached prompt for logprobs", "sampling_params": {"max_tokens": 0}}
    raw(http_server.url, "POST", "/generate", body)
    status, _, out = raw(http_server.url, "POST", "/generate", {**body, "return_logprob": True,
                                                                 "logprob_start_len": 0})
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]


def test_echo_logprobs_on_a_cached_prompt(client):
    prompt = "A cached prompt for echo"
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=0)
    lps = r.choices[0].logprobs.token_logprobs
    assert lps[0] is None and all(v is not None and v <= 0 for v in lps[1:])


def test_extra_sampling_fields(client):
    msgs = [{"role": "user", "content": "Describe a cat."}]
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0)
    top1 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=1.0,
                                          extra_body={"top_k": 1, "min_p": 0.05})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    long = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say: ok"}],
                                          max_completion_tokens=10, temperature=0,
                                          extra_body={"min_tokens": 6})
    assert 6 <= long.usage.completion_tokens <= 10


def test_generate_native_prompt_logprobs_and_prefill(http_server, http_engine):
    text = "The quick brown fox jumps"
    ids = http_engine.tokenizer.encode(text)
    http_engine.flush_cache()  # NOTE: see test_prompt_logprobs_from_0_on_a_cached_prompt
    direct = http_engine.generate(ids, SamplingParams(max_tokens=0, return_logprob=True, logprob_start_len=0))
    http_engine.flush_cache()
    status, _, out = raw(http_server.url, "POST", "/generate", {
        "text": text, "sampling_params": {"max_tokens": 0}, "return_logprob": True, "logprob_start_len": 0,
        "return_text_in_logprobs": True})
    assert status == 200
    meta = out["meta_info"]
    assert out["text"] == "" and meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(ids)
    lps = meta["input_token_logprobs"]
    assert [t for _, t, _ in lps] == ids and lps[0][0] is None and all(lp <= 0 for lp, _, _ in lps[1:])
    assert [lp for lp, _, _ in lps[1:]] == pytest.approx(direct.prompt_logprobs[1:], abs=1e-5)
    # A batch of token-id prompts, logprobs from a position each; the prefill above is cached.
    status, _, outs = raw(http_server.url, "POST", "/generate", {
        "input_ids": [ids, ids[:3]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": [len(ids) - 2, 1]})
    assert status == 200 and len(outs) == 2
    assert len(outs[0]["meta_info"]["input_token_logprobs"]) == 2
    assert len(outs[1]["meta_info"]["input_token_logprobs"]) == 2
    assert outs[0]["meta_info"]["cached_tokens"] >= len(ids) - 3


def test_generate_native_stream_and_tokenize(http_server, http_engine):
    body = {"text": "Once upon a time", "sampling_params": {"max_tokens": 8}, "return_logprob": True}
    status, _, whole = raw(http_server.url, "POST", "/generate", body)
    assert status == 200
    status, headers, payload = raw(http_server.url, "POST", "/generate", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(payload)
    assert events[-1] == "[DONE]" and events[-2]["finished"]
    assert "".join(e["text"] for e in events[:-1]) == whole["text"]
    assert sum(len(e["token_ids"]) for e in events[:-1]) == whole["meta_info"]["completion_tokens"]
    assert all(len(e["output_token_logprobs"]) == len(e["token_ids"]) for e in events[:-1])
    status, _, tok = raw(http_server.url, "POST", "/tokenize", {"prompt": "Hello world"})
    assert tok["tokens"] == http_engine.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    status, _, detok = raw(http_server.url, "POST", "/detokenize", {"tokens": tok["tokens"]})
    assert detok["prompt"] == "Hello world"
    msgs = [{"role": "user", "content": "x"}]
    status, _, tmpl = raw(http_server.url, "POST", "/apply_chat_template", {"messages": msgs})
    assert tmpl["text"] == http_engine.tokenizer.apply_chat_template(msgs)


# ---- constrained (json_schema, regex, tools) -----------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@needs_constraints
def test_response_format_json_schema_and_object(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 16
    obj = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a JSON object with one key."}],
        max_tokens=24, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.lstrip().startswith("{")


@needs_constraints
def test_regex_extra_field_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Pick a three-digit number."}], max_tokens=8,
        temperature=0, stream=True, extra_body={"regex": "[0-9]{3}"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[0-9]{3}", text)


@needs_constraints
def test_tool_call_required_named_and_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"tz"})
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, tools=[WEATHER, TIME], max_tokens=24, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    ncall = named.choices[0].message.tool_calls[0]
    assert ncall.function.name == "get_time" and set(json.loads(ncall.function.arguments)) == {"tz"}
    # The call and its result go back into the history; the model answers in text.
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    after = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content


@needs_constraints
def test_tool_call_streamed_and_auto(client):
    msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER],
                                            tool_choice="required", max_tokens=24, temperature=0, stream=True)
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls[0].function.name == "get_weather"
    assert "city" in json.loads("".join(c.function.arguments or "" for c in calls))
    auto = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER], max_tokens=24,
                                          temperature=0)
    message = auto.choices[0].message
    if auto.choices[0].finish_reason == "tool_calls":
        assert message.tool_calls[0].function.name == "get_weather" and message.content is None
    else:
        assert message.tool_calls is None and not message.content.startswith("{")
