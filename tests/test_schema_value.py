"""One reading of a json_schema value (sgrt/schema_value.py) for the grammar compiler and the HTTP
backend's dialects."""
from __future__ import annotations

import dataclasses

import pytest

from sgrt.backends.dialects import schema_dict
from sgrt.constrained.schema import load_schema
from sgrt.errors import GrammarError, InvalidRequest
from sgrt.schema_value import schema_value


@dataclasses.dataclass
class Point:
    x: int
    y: int


def test_every_input_form_reads_the_same_in_both_places():
    for spec in ({"type": "integer"}, '{"type": "integer"}', b'{"type": "integer"}', True, Point):
        assert schema_dict(spec) == load_schema(spec) == schema_value(spec)
    assert schema_value(Point)["$defs"]["Point"]["required"] == ["x", "y"]


def test_load_schema_copies_what_schema_dict_passes_through():
    spec = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert schema_dict(spec) is spec
    copied = load_schema(spec)
    assert copied == spec and copied is not spec and copied["properties"] is not spec["properties"]


@pytest.mark.parametrize("bad, words", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object or a boolean"),
                                        (3, "got int"), (int, "got type")])
def test_bad_values_are_named_grammar_errors(bad, words):
    for read in (schema_dict, load_schema):
        with pytest.raises(GrammarError, match=words) as e:
            read(bad)
        assert isinstance(e.value, InvalidRequest) and e.value.field == "json_schema"
