"""Tools through the official ``openai`` client against the live server on the default model:
nested Pydantic parameters (``$defs``), parallel calls, and incremental tool-call streaming
(id and name first, then argument fragments)."""
from __future__ import annotations

import json

import pydantic
import pytest

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    client,
    http_engine,
    http_server,
    needs_constraints,
    raw,
    sse_events,
)


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=16)
    city: str = pydantic.Field(max_length=12)


class Contact(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    address: Address


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def nested_tool() -> dict:
    schema = Contact.model_json_schema()
    assert "$defs" in schema and schema["properties"]["address"] == {"$ref": "#/$defs/Address"}
    return {"type": "function", "function": {"name": "save_contact", "description": "Save a contact",
                                             "parameters": schema, "strict": True}}


@needs_constraints
def test_nested_pydantic_tool_parameters(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Save Ann, who lives at 1 Main St, Oslo."}],
        tools=[nested_tool()], tool_choice={"type": "function", "function": {"name": "save_contact"}},
        max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    contact = Contact.model_validate_json(call.function.arguments)  # the nested model validates
    assert isinstance(contact.address, Address)


@needs_constraints
def test_parallel_calls_and_parallel_false(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris and in Rome? Call get_weather once "
                                        "for each city, one call per line."}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=True, max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 2, r.choices[0].message
    assert len({c.id for c in calls}) == len(calls)
    assert all(set(json.loads(c.function.arguments)) == {"city"} for c in calls)
    single = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=60, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1
    # The history of a parallel turn goes back in and the model answers in text.
    history = msgs + [r.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    after = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None


@needs_constraints
def test_tool_call_streams_incrementally(client, http_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Save Ann, 1 Main St, Oslo."}],
            "tools": [nested_tool()], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 60, "temperature": 0, "stream": True}
    status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions", body)
    assert status == 200
    chunks = [e for e in sse_events(payload) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    tool_deltas = [d for d in deltas if d.get("tool_calls")]
    first = tool_deltas[0]["tool_calls"][0]
    # OpenAI's shape: id, type and name in the first, "arguments": "" ...
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "save_contact", "arguments": ""}
    # ... then the arguments in several fragments, each without id or name, content null beside.
    frags = [d["tool_calls"][0] for d in tool_deltas[1:]]
    assert len(frags) > 3 and all("id" not in f and "name" not in f["function"] for f in frags)
    assert all(d["content"] is None for d in tool_deltas)
    args = "".join(f["function"]["arguments"] for f in frags)
    Contact.model_validate_json(args)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The same through the SDK's stream helper, which assembles the fragments.
    with client.chat.completions.stream(model=MODEL_NAME, messages=body["messages"], tools=[nested_tool()],
                                        tool_choice={"type": "function", "function": {"name": "save_contact"}},
                                        max_tokens=60, temperature=0) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "save_contact" and Contact.model_validate_json(call.function.arguments)


@needs_constraints
def test_sdk_parse_with_nested_pydantic_tool(client):
    import openai

    r = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Save Bob at 2 High St, Rome."}],
        tools=[openai.pydantic_function_tool(Contact, name="save_contact")],
        tool_choice={"type": "function", "function": {"name": "save_contact"}}, max_tokens=60, temperature=0)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Contact) and isinstance(parsed.address, Address)


@needs_constraints
def test_auto_stream_role_chunk_matches_the_turn(http_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the weather in Rome?"}],
            "tools": [WEATHER], "max_tokens": 24, "temperature": 0, "stream": True}
    status, _, payload = raw(http_server.url, "POST", "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in sse_events(payload) if e != "[DONE]" and e["choices"]]
    assert status == 200 and deltas[0]["role"] == "assistant"
    called = any(d.get("tool_calls") for d in deltas)
    # content null for a turn of tool calls, "" for a text turn (OpenAI's first chunks)
    assert deltas[0]["content"] == (None if called else "")
    assert sum("role" in d for d in deltas) == 1
