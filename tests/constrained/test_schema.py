"""sgrt/constrained/schema.py: input forms, generation options, rewrites, fail-closed checks."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import msgspec
import pydantic
import pytest

from bench.validity import normalized_validator
from sgrt.constrained import GrammarOptions, load_schema, normalize_schema
from sgrt.errors import GrammarError

OPEN = GrammarOptions(additional_properties_default="open", max_string_length=None,
                      max_integer_digits=None, max_fraction_digits=None)


class PydPoint(pydantic.BaseModel):
    x: int
    label: str


class MsgPoint(msgspec.Struct):
    x: int
    label: str


@dataclasses.dataclass
class DcPoint:
    x: int
    label: str


@pytest.mark.parametrize("spec", [PydPoint, MsgPoint, DcPoint, '{"type":"object","properties":{"x":{"type":"integer"},"label":{"type":"string"}}}'])
def test_load_schema_inputs(spec):
    schema = load_schema(spec)
    text = json.dumps(schema)
    assert '"x"' in text and '"label"' in text and "integer" in text


def test_load_schema_errors():
    with pytest.raises(GrammarError) as err:
        load_schema("{not json")
    assert err.value.field == "json_schema"
    with pytest.raises(GrammarError):
        load_schema(42)
    with pytest.raises(GrammarError):
        normalize_schema(False, GrammarOptions())


def test_objects_closed_by_default_and_open_on_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert normalize_schema(schema, GrammarOptions()).schema["additionalProperties"] is False
    assert "additionalProperties" not in normalize_schema(schema, OPEN).schema
    # A map without properties stays open; explicit additionalProperties is kept.
    assert "additionalProperties" not in normalize_schema({"type": "object"}, GrammarOptions()).schema
    kept = normalize_schema({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, OPEN)
    assert kept.schema["additionalProperties"]["type"] == "integer"


def test_composed_objects_stay_open():
    schema = {
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"extra": {"type": "integer"}}}],
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
    }
    out = normalize_schema(schema, GrammarOptions()).schema
    assert "additionalProperties" not in out["$defs"]["base"]
    assert "additionalProperties" not in out["allOf"][1]


def test_string_caps():
    out = normalize_schema(
        {"type": "object", "properties": {
            "free": {"type": "string"},
            "long_min": {"type": "string", "minLength": 500},
            "enum": {"type": "string", "enum": ["a"]},
            "date": {"type": "string", "format": "date"},
            "own": {"type": "string", "maxLength": 3},
            "maybe": {"type": ["string", "null"]},
        }},
        GrammarOptions(max_string_length=100),
    ).schema["properties"]
    assert out["free"]["maxLength"] == 100
    assert out["long_min"]["maxLength"] == 500
    assert "maxLength" not in out["enum"] and out["date"]["maxLength"] == 100  # formatted strings too
    assert out["own"]["maxLength"] == 3 and out["maybe"]["maxLength"] == 100
    # outlines-core: no default cap (its index grows with every bounded character)
    outl = normalize_schema({"type": "string"}, GrammarOptions(), backend="outlines").schema
    assert "maxLength" not in outl


def test_formats_known_kept_unknown_dropped_with_warning():
    res = normalize_schema(
        {"type": "object", "properties": {
            "e": {"type": "string", "format": "email"},
            "d": {"type": "string", "format": "date"},
            "c": {"type": "string", "format": "color"},
        }},
        GrammarOptions(),
    )
    props = res.schema["properties"]
    assert props["e"]["format"] == "email"  # llguidance enforces it natively
    # llguidance's own date accepts 2021-02-29: ours replaces it
    assert "format" not in props["d"] and "02-29" in props["d"]["pattern"]
    assert "format" not in props["c"] and "maxLength" in props["c"]
    assert len(res.warnings) == 1 and "'color'" in res.warnings[0] and "/properties/c" in res.warnings[0]


def test_format_regexes_against_the_test_suite():
    import re

    from sgrt.constrained.formats import FORMAT_REGEXES
    from bench.validity import DATA_DIR

    folder = DATA_DIR / "json-schema-test-suite" / "draft2020-12" / "optional" / "format"
    for name, rx in FORMAT_REGEXES.items():
        compiled = re.compile(rx)
        for group in json.loads((folder / f"{name}.json").read_text()):
            for test in group["tests"]:
                if isinstance(test["data"], str) and not test["valid"]:
                    assert not compiled.fullmatch(test["data"]), (name, test["description"])


@pytest.mark.parametrize("schema, path", [
    ({"type": "object", "properties": {"tags": {"type": "array", "contains": {"const": 1}, "minContains": 100}}},
     "/properties/tags/minContains"),  # a plain contains compiles since issue 20 (test_contains.py)
    ({"not": {"contains": {"const": 1}, "maxContains": 2}}, "/not"),
    ({"type": "array", "uniqueItems": True}, "/uniqueItems"),
    ({"properties": {"p": {"type": "string", "pattern": "(a)\\1"}}}, "/properties/p/pattern"),
    ({"$ref": "https://example.com/schema.json"}, "/$ref"),
    ({"type": "strung"}, "/type"),
    ({"not": {"pattern": "^a"}}, "/not"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^a", "maxLength": 3}}, "/propertyNames"),
])
def test_unsupported_fails_closed_with_path(schema, path):
    with pytest.raises(GrammarError) as err:
        normalize_schema(schema, GrammarOptions())
    assert err.value.path == path and err.value.field == "json_schema"


def test_unique_items_trivially_satisfied_is_dropped():
    out = normalize_schema({"type": "array", "uniqueItems": True, "maxItems": 1}, OPEN).schema
    assert "uniqueItems" not in out


def test_old_drafts_are_upgraded():
    out = normalize_schema({
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {
            "t": {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
            "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            "r": {"$ref": "#/definitions/x", "type": "string"},
        },
        "definitions": {"x": {"type": "integer"}},
    }, OPEN).schema["properties"]
    assert out["t"]["prefixItems"] == [{"type": "integer"}] and out["t"]["items"] is False
    assert out["n"] == {"type": "number", "exclusiveMinimum": 0}
    assert out["r"] == {"$ref": "#/definitions/x"}  # siblings of $ref are ignored before 2019-09


# Rewrites must not change which instances are valid: compare with jsonschema on samples.
REWRITES = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "not": {"required": ["a", "b"]}},
    {"not": {"type": ["string", "null"]}},
    {"not": {"enum": [1, "x", None, True]}},
    {"type": "integer", "not": {"minimum": 3}},
    {"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
     "if": {"properties": {"kind": {"const": "num"}}, "required": ["kind"]}, "then": {"required": ["n"]},
     "else": {"not": {"required": ["n"]}}},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}, "dependentSchemas": {"a": {"properties": {"b": {"minimum": 5}}}}},
    {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 1}]},
    {"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^k"}},
    {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["x", "y"]}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
    # oneOf made exclusive with negations, pruned by the node's own properties (issue 42)
    {"type": "object", "properties": {"shape": {"enum": ["c", "r"]}, "radius": {"type": "number"},
                                      "length": {"type": "number"}},
     "oneOf": [{"properties": {"shape": {"const": "c"}}, "required": ["radius"]},
               {"properties": {"shape": {"const": "r"}}, "required": ["length"]}]},
    {"type": "object", "required": ["shape"],
     "properties": {"shape": {"enum": ["c", "r"]}, "radius": {"type": "number"}, "length": {"type": "number"}},
     "oneOf": [{"properties": {"shape": {"const": "c"}}, "required": ["radius"]},
               {"properties": {"shape": {"const": "r"}}, "required": ["length"]}]},
]
SAMPLES = [None, True, False, 0, 1, 2.5, 3, 7, -1, -3, "", "x", "xy", [], [1], {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2},
           {"a": 1, "b": 7}, {"kind": "num", "n": 1}, {"kind": "num"}, {"kind": "str"}, {"kind": "str", "n": 2},
           {"c": 1}, {"a": 1, "c": 2}, {"k1": 1, "k2": 2}, {"k1": "s"}, {"z": 1}, {"x": 1}, {"x": 1, "y": 2}, {"x": 1, "z": 2},
           {"radius": 1}, {"radius": 1, "length": 2}, {"shape": "c", "radius": 1}, {"shape": "c", "radius": 1, "length": 2},
           {"shape": "r", "radius": 1, "length": 2}, {"shape": "r", "radius": 1}, {"shape": "c", "length": "x"},
           {"radius": "x"}, {"shape": "x", "radius": 1}, {"shape": "r", "length": 2}]


@pytest.mark.parametrize("schema", REWRITES)
def test_rewrites_preserve_validity(schema):
    out = normalize_schema(schema, OPEN).schema
    text = json.dumps(out)
    for kw in ("\"not\"", "\"if\"", "dependentRequired", "dependentSchemas", "\"oneOf\"", "propertyNames", "unevaluated"):
        assert kw not in text, (kw, out)
    original = jsonschema.Draft202012Validator(schema)
    rewritten = normalized_validator(out)  # its patterns are written for llguidance (Rust syntax)
    for sample in SAMPLES:
        assert original.is_valid(sample) == rewritten.is_valid(sample), (sample, out)


def test_one_of_negations_leave_out_what_the_node_excludes():
    """A negation's alternatives that the branch or the node itself rules out are not built (the
    'radius is not a number' alternative under properties.radius: number), and one the context
    implies (shape present and not 'r', where shape is required and can only be 'c' in branch c)
    drops the whole negation: the output stays equivalent (test_rewrites_preserve_validity) and
    small."""
    schema = REWRITES[-1]
    out = normalize_schema(schema, OPEN).schema
    text = json.dumps(out)
    assert '"null", "boolean"' not in text  # no "value of another type" alternatives
    assert out["anyOf"] == [schema["oneOf"][0], schema["oneOf"][1]]  # exclusive once pruned


def test_complement_regex():
    import re

    from sgrt.constrained.schema_algebra import complement_regex

    words = ["a", "ab", "x.y", "", "[q]"]
    rx = re.compile("^(?:" + complement_regex(words) + ")$", re.S)
    for w in words:
        assert not rx.match(w)
    for w in ["b", "abc", "x", "xzy", "aa", "x.yz", "[q", "q]", "\n"]:
        assert rx.match(w), w


def test_refs_into_embedded_resources_are_localized():
    """Issue 20: a $ref resolved against the base URI of where it sits (nested $id) becomes a
    local pointer; anchors are per resource; a $ref to anything else stays refused."""
    schema = {
        "$id": "http://example.com/root.json",
        "properties": {"n": {"$ref": "node"}, "b": {"$ref": "#big"}},
        "$defs": {
            "node": {"$id": "node", "type": "integer", "$defs": {"x": {"type": "string"}}},
            "big": {"$anchor": "big", "maximum": 10},
            "other": {"$id": "http://example.com/other/", "$anchor": "big", "maximum": 2},
        },
    }
    out = normalize_schema(schema, OPEN).schema
    assert out["properties"]["n"]["$ref"] == "#/$defs/node"
    assert out["properties"]["b"]["$ref"] == "#/$defs/big"  # the root resource's anchor, not other's
    assert "$id" not in out["$defs"]["node"] and out["$id"] == "http://example.com/root.json"
    with pytest.raises(GrammarError) as err:
        normalize_schema({"$id": "http://example.com/a.json", "$ref": "b.json"}, OPEN)
    assert "remote" in str(err.value)
