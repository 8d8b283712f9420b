"""The Responses API (``POST /v1/responses``) through the official ``openai`` client's
``client.responses``, against the live server on the default model."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    client,
    http_engine,
    http_server,
    needs_constraints,
    raw,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_text_response_and_store(client, http_server):
    r = client.responses.create(model=MODEL_NAME, input="Say hello.", instructions="Answer in one short line.",
                                max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.output[0].content[0].type == "output_text"
    # Stored (store defaults to true): GET returns it; DELETE removes it.
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # Unknown fields stay a 400 that names them; documented ones are accepted.
    status, _, body = raw(http_server.url, "POST", "/v1/responses", {"input": "x", "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus"
    ok = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=1, user="u", truncation="disabled",
                                 metadata={"k": "v"}, include=[], store=False)
    assert ok.status == "incomplete" and ok.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=ok.id, max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"


@needs_constraints
def test_json_schema_format(client):
    r = client.responses.create(model=MODEL_NAME, input="Invent a person. Reply in JSON.", max_output_tokens=40,
                                temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                "schema": PERSON, "strict": True}})
    assert r.status == "completed", r.output_text
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@needs_constraints
def test_function_call_then_continue_with_previous_response_id(client):
    first = client.responses.create(model=MODEL_NAME, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=30,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and set(json.loads(call.arguments)) == {"city"}
    # Continue: only the tool output is sent; the server has the rest.
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    # The previous turn is in the prompt (longer than both turns) and came from the radix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    # The same conversation sent as explicit items gives the same prompt length.
    explicit = client.responses.create(
        model=MODEL_NAME, tools=[WEATHER], tool_choice="none", max_output_tokens=1, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert explicit.usage.input_tokens == second.usage.input_tokens


@needs_constraints
def test_streamed_events(client):
    events = list(client.responses.create(model=MODEL_NAME, input="Say hi.", max_output_tokens=5, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == events[-1].response.output_text
    # A streamed function call: the item first, then argument fragments, then the done events.
    stream = client.responses.create(model=MODEL_NAME, input="Weather in Rome?", tools=[WEATHER],
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=30,
                                     temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    frags = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(frags) > 2 and "".join(frags) == done.arguments and json.loads(done.arguments)["city"]
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments


def test_store_is_bounded_lru():
    from sgrt.server.openai.responses import ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")


def test_input_items_to_messages():
    from sgrt.errors import InvalidRequest
    from sgrt.server.openai.responses import input_messages

    msgs = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[0].content == "Weather ?" and msgs[1].content == "Checking."
    assert [c.id for c in msgs[1].tool_calls] == ["c1", "c2"] and msgs[2].tool_call_id == "c1"
    with pytest.raises(InvalidRequest) as e:
        input_messages([{"type": "file_search_call", "id": "x"}])
    assert e.value.field == "input[0].type"
