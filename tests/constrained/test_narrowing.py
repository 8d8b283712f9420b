"""Issue 20, soundness: the narrowing sgrt adds for generation (closed objects, the default
string cap, unevaluated* and contains subsets) never reaches a negation or a disjointness proof.

Narrowing a positive position only rejects more; negating a narrowed schema accepts more than
the complement of the user's. Each case below was accepted before the fix: a long string under
``not: {$ref: string}`` (the target had the string cap), a string of 257+ characters under a
oneOf whose other branch was capped, an object matching both oneOf branches (one was closed).
Every text is judged by jsonschema on the user's schema (llguidance).
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sgrt.constrained import GrammarOptions, normalize_schema
from sgrt.constrained.schema import NARROWED_KEY, relax

from .util import compile_or_refuse, feed

LONG = '"' + "a" * 300 + '"'
CASES = [
    # (schema, texts that must be judged right, texts among them that must be accepted)
    ({"$defs": {"s": {"type": "string"}}, "not": {"$ref": "#/$defs/s"}}, ["1", '"abc"', LONG, "null"], ["1", "null"]),
    ({"oneOf": [{"type": "string"}, {"minLength": 2}]}, ['"b"', '"ab"', "1", LONG], ['"b"', "1"]),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "required": ["b"]}]},
     ['{"a":1}', '{"b":2}', '{"a":1,"b":2}', '{"b":2,"a":1}'], []),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"type": "object", "required": ["b"]}]},
     ['{"a":"x"}', '{"b":2}', '{"a":"x","b":2}', '{"b":2,"a":"x"}', '{"a":1,"b":2}'], ['{"a":"x"}', '{"b":2}']),
    ({"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
      "oneOf": [{"$ref": "#/$defs/A"}, {"type": "object", "required": ["b"]}]},
     ['{"a":1}', '{"b":2}', '{"a":1,"b":2}', '{"b":2,"a":1}'], []),
    ({"if": {"$ref": "#/$defs/s"}, "then": {"const": "x"}, "else": {"type": "integer"}, "$defs": {"s": {"type": "string"}}},
     ['"x"', '"y"', "3", LONG], ['"x"', "3"]),
]


@pytest.mark.parametrize("schema,texts,must", CASES, ids=[json.dumps(c[0])[:50] for c in CASES])
def test_negations_see_the_users_schema(compiler, tokenizer, schema, texts, must):
    try:
        g = compile_or_refuse(compiler, "llguidance", json_schema=schema)
    except Exception as e:  # a refusal is sound; the ones listed in `must` say which must compile
        assert not must, e
        return
    validator = jsonschema.Draft202012Validator(schema)
    for text in texts:
        accepted = feed(g, tokenizer.encode(text))
        if accepted:
            assert validator.is_valid(json.loads(text)), text
        if text in must:
            assert accepted, text


def test_relax_drops_only_what_we_added():
    schema = {"type": "object", "properties": {"s": {"type": "string"}},
              "unevaluatedProperties": False, "allOf": [{"properties": {"t": {}}}]}
    out = normalize_schema(schema, GrammarOptions()).schema
    assert NARROWED_KEY not in json.dumps(out)  # backends never see the marker
    # the marks, before they are stripped, undo exactly the cap and the closing
    marked = {"type": "string", "maxLength": 256, NARROWED_KEY: ["maxLength"]}
    assert relax(marked) == {"type": "string"}
    assert relax({"allOf": [{"minLength": 1}, {"anyOf": [{"items": False}], NARROWED_KEY: True}]}) == \
        {"allOf": [{"minLength": 1}, True]}
