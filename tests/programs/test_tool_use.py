"""programs/tool_use.py: one call under an ``anyOf`` of tool schemas always validates."""
from __future__ import annotations

import jsonschema
import pytest

from programs.tool_use import DEFAULT_TOOLS, call_schema, tool_use


def check_call(st, tools):
    meta = st.get_meta_info("call")
    assert meta["finish_reason"] == {"type": "stop", "matched": "grammar"}
    call = {"name": st["name"], "arguments": st["arguments"]}
    jsonschema.validate(call, call_schema(tools))
    tool = next(t for t in tools if t["name"] == call["name"])
    jsonschema.validate(call["arguments"], tool["parameters"])
    return call


def test_default_tools(runtime):
    call = check_call(tool_use.run(request="What's the weather in Lisbon, in celsius?"), DEFAULT_TOOLS)
    assert call["name"] in {t["name"] for t in DEFAULT_TOOLS}


def test_custom_tools_with_enums_and_numbers(runtime):
    tools = [
        {"name": "set_alarm", "description": "Set an alarm",
         "parameters": {"type": "object", "properties": {
             "hour": {"type": "integer", "minimum": 0, "maximum": 23},
             "minute": {"type": "integer", "minimum": 0, "maximum": 59}}, "required": ["hour", "minute"]}},
        {"name": "play_music", "description": "Play music of a genre",
         "parameters": {"type": "object", "properties": {"genre": {"enum": ["jazz", "rock", "classical"]}},
                        "required": ["genre"]}},
    ]
    st = tool_use.run(request="Wake me up at half past seven.", tools=tools, max_tokens=40)
    check_call(st, tools)
    assert st.get_meta_info("call")["forced_tokens"] >= 2  # {"name":" is forced


def test_call_schema_checks_names():
    schema = call_schema(DEFAULT_TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert len(schema["anyOf"]) == len(DEFAULT_TOOLS)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"expression": "1+1"}}, schema)
    for bad in ([], [{"name": "a"}, {"name": "a"}], [{"description": "no name"}]):
        with pytest.raises(ValueError):
            call_schema(bad)
