"""programs/extract.py: text to JSON that always validates against the schema."""
from __future__ import annotations

from dataclasses import dataclass

import jsonschema

from programs.extract import DEFAULT_SCHEMA, extract

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "born": {"type": "integer", "minimum": 0, "maximum": 2100},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "born", "city"],
}


def test_json_validates_against_the_schema(runtime):
    st = extract.run(text="Ada Lovelace was born in London in 1815.", schema=PERSON,
                     instructions="Extract the person.", max_tokens=48)
    meta = st.get_meta_info("json")
    assert (meta["finish_reason"], meta["incomplete"]) == ({"type": "stop", "matched": "grammar"}, False)
    data = st["data"]
    jsonschema.validate(data, PERSON)
    assert set(data) == {"name", "born", "city"}  # closed by default: no other keys
    # The keys and punctuation are forced by the grammar: jump-forward takes them without sampling.
    assert meta["forced_tokens"] >= 3
    assert st.messages()[-1] == {"role": "assistant", "content": st["json"]}


def test_cut_short_reply_is_reported_not_parsed(runtime):
    @dataclass
    class Event:
        title: str
        year: int

    st = extract.run(text="The first moon landing was in 1969.", schema=Event, max_tokens=3)
    meta = st.get_meta_info("json")
    assert meta["finish_reason"]["type"] == "length" and meta["incomplete"] is True
    assert st["data"] is None and meta["completion_tokens"] <= 3
    assert st["json"].startswith("{")


def test_default_schema_is_valid_and_bounded():
    jsonschema.Draft202012Validator.check_schema(DEFAULT_SCHEMA)
    props = DEFAULT_SCHEMA["properties"]
    strings = [props["topic"], props["summary"], props["entities"]["items"]["properties"]["name"]]
    assert all("maxLength" in x for x in strings) and "maxItems" in props["entities"]
