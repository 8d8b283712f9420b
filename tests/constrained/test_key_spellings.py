"""Issue 20, the soundness hole: an object key or an enum value written with JSON escapes.

Whatever spelling an instance uses, the grammar either applies the schema of the name the key
decodes to, or forbids that spelling. For every (schema, text) below, the grammar may accept the
text only if jsonschema says the decoded instance is valid; the texts that spell a named or
pattern-matched key with escapes are invalid here, so they must be rejected. Both backends.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sgrt.constrained import GrammarOptions, normalize_schema
from sgrt.constrained.schema import PLAIN_ESCAPES_KEY

from .util import BACKENDS, compile_or_refuse, feed

NAMED = {"properties": {"foo": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
PATTERN = {"patternProperties": {"^f": {"type": "integer"}}}
OPEN_TRUE = {"properties": {"foo": {"type": "integer"}}, "additionalProperties": True}
COMPOSED = {"allOf": [{"properties": {"foo": {"type": "integer"}}}, {"required": ["foo"]}]}
BOTH = {"properties": {"foo": {"type": "integer"}}, "patternProperties": {"^b": {"type": "boolean"}},
        "additionalProperties": {"type": "string"}}
SLASH = {"properties": {"a/b": {"type": "integer"}, 'q"': {"type": "integer"}}, "additionalProperties": {"type": "string"}}

# (schema, texts): each text is judged against jsonschema on its decoded value.
CASES = [
    (NAMED, ['{"foo":1}', '{"bar":"x"}', '{"\\u0066oo":"x"}', '{"fo\\u006f":"x"}', '{"\\u0066\\u006f\\u006f":"x"}',
             '{"foo":1,"\\u0066oo":"x"}', '{"foo":1,"foo":2}', '{"\\u0066oo":1}']),
    (PATTERN, ['{"foo":1}', '{"bar":"x"}', '{"\\u0066oo":"x"}', '{"\\u0066x":true}']),
    (OPEN_TRUE, ['{"foo":1}', '{"\\u0066oo":"x"}', '{"\\u0066oo":[1]}']),
    (COMPOSED, ['{"foo":1}', '{"foo":1,"\\u0066oo":"x"}', '{"\\u0066oo":"x"}']),
    (BOTH, ['{"foo":1,"bar":true}', '{"\\u0062ar":"x"}', '{"b\\u0061r":"x"}', '{"\\u0066oo":"x"}', '{"zed":"x"}']),
    (SLASH, ['{"a/b":1}', '{"a\\/b":"x"}', '{"a\\u002fb":"x"}', '{"q\\"":1}', '{"q\\u0022":"x"}']),
    ({"enum": ["foo", "a/b"]}, ['"foo"', '"\\u0066oo"', '"a/b"', '"a\\/b"']),
    ({"not": {"enum": ["foo"]}}, ['"bar"', '"\\u0066oo"', '"foo"']),
    ({"const": {"foo": 1}}, ['{"foo":1}', '{"\\u0066oo":1}']),
]
MUST_ACCEPT = {'{"foo":1}', '{"bar":"x"}', '{"foo":1,"bar":true}', '{"zed":"x"}', '"foo"', '"bar"', '{"a/b":1}'}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema,texts", CASES, ids=[json.dumps(c[0])[:40] for c in CASES])
def test_escaped_spellings_never_escape_their_schema(compiler, tokenizer, backend, schema, texts):
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    if g is None:
        return  # outlines-core refused it with our own check
    validator = jsonschema.Draft202012Validator(schema)
    for text in texts:
        accepted = feed(g, tokenizer.encode(text))
        if accepted:
            assert validator.is_valid(json.loads(text)), (backend, text)
        if backend == "llguidance" and text in MUST_ACCEPT and validator.is_valid(json.loads(text)):
            assert accepted, text


def test_duplicate_named_keys_are_never_accepted(compiler, tokenizer):
    g = compile_or_refuse(compiler, "llguidance", json_schema=NAMED)
    for text in ('{"foo":1,"foo":2}', '{"foo":1,"bar":"x","foo":2}', '{"foo":1,"\\u0066oo":2}'):
        assert not feed(g, tokenizer.encode(text)), text


def test_plain_escapes_only_where_keys_mix():
    """The escape restriction is put only on schemas with an object that mixes named or
    pattern keys with free ones; plain maps and closed objects keep ``\\uXXXX`` escapes."""
    opts = GrammarOptions()
    for schema in (NAMED, PATTERN, OPEN_TRUE, {"type": "array", "items": BOTH}):
        assert normalize_schema(schema, opts).schema.get(PLAIN_ESCAPES_KEY) is True, schema
    for schema in ({"properties": {"foo": {"type": "integer"}}}, {"additionalProperties": {"type": "integer"}},
                   {"type": "string"}, {"enum": ["foo"]}):
        assert PLAIN_ESCAPES_KEY not in normalize_schema(schema, opts).schema, schema


def test_escapes_stay_allowed_in_unmixed_schemas(compiler, tokenizer):
    g = compile_or_refuse(compiler, "llguidance", json_schema={"properties": {"s": {"type": "string"}}})
    assert feed(g, tokenizer.encode('{"s":"\\u0066oo"}'))
    assert not feed(g, tokenizer.encode('{"\\u0073":"x"}'))  # closed object: the escaped key is refused


def test_object_const_and_enum_take_keys_in_the_grammar_order(compiler, tokenizer):
    """An object const / enum written with keys in one order matches the same object: keys come
    in the grammar's order (the schema's ``properties`` order, here the const's own)."""
    schema = {"const": {"foo": "bar", "baz": [{"b": 1, "a": 2}]}}
    out = normalize_schema(schema, GrammarOptions()).schema
    assert "const" not in json.dumps(out).split('"properties"')[0]
    g = compile_or_refuse(compiler, "llguidance", json_schema=schema)
    assert feed(g, tokenizer.encode('{"foo":"bar","baz":[{"b":1,"a":2}]}'))
    for wrong in ('{"foo":"bar","baz":[{"b":1,"a":3}]}', '{"foo":"bar"}', '{"foo":"bar","baz":[{"b":1,"a":2}],"x":1}'):
        assert not feed(g, tokenizer.encode(wrong)), wrong
    g = compile_or_refuse(compiler, "llguidance", json_schema={"enum": [{"a": 1}, "x", 2]})
    for text, ok in (('{"a":1}', True), ('"x"', True), ("2", True), ('{"a":2}', False), ('"y"', False)):
        assert feed(g, tokenizer.encode(text)) is ok, text


def test_documented_spelling_departures(compiler, tokenizer):
    """Valid JSON that a generator never needs, rejected by design (docs/DESIGN.md): ``\\/``,
    numbers in exponent form or signed zero under a bound, integral numbers with a fraction
    under a const. The canonical spelling of each is accepted."""
    g = compile_or_refuse(compiler, "llguidance", json_schema={"type": "string"})
    assert not feed(g, tokenizer.encode('"a\\/b"')) and feed(g, tokenizer.encode('"a/b"'))
    g = compile_or_refuse(compiler, "llguidance", json_schema={"type": "number", "minimum": 4})
    assert not feed(g, tokenizer.encode("4e0")) and feed(g, tokenizer.encode("4"))
    assert feed(g, tokenizer.encode("1000")) and feed(g, tokenizer.encode("4.5"))
    g = compile_or_refuse(compiler, "llguidance", json_schema={"type": "number", "maximum": 0})
    assert not feed(g, tokenizer.encode("-0")) and feed(g, tokenizer.encode("0"))
    g = compile_or_refuse(compiler, "llguidance", json_schema={"const": 9007199254740992})
    assert feed(g, tokenizer.encode("9007199254740992"))
