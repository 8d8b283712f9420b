"""Issue 20, "bounded by default": numbers get a default maximum of digits and formatted strings
the default string cap, so a small model cannot loop inside one; both configurable."""
from __future__ import annotations

import pytest

from sgrt.constrained import GrammarCompiler, GrammarOptions, normalize_schema
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

from .util import feed, mask_of


def _number(out: dict) -> dict:
    """The number schema ``out`` stands for: the caps of a number schema live in one shared
    definition that each number refers to (schema._shared_number)."""
    ref = out.get("$ref", "")
    return out["$defs"][ref.split("/")[-1]] if ref.startswith("#/$defs/x-sgrt-number-") else out


def test_number_bounds_are_added_only_on_open_sides():
    opts = GrammarOptions()
    out = _number(normalize_schema({"type": "number"}, opts).schema)
    assert out["exclusiveMaximum"] == 10**15 and out["exclusiveMinimum"] == -(10**15) and out["multipleOf"] == 1e-10
    out = _number(normalize_schema({"type": "integer", "minimum": 3}, opts).schema)
    assert out["minimum"] == 3 and out["maximum"] == 10**15 - 1 and "multipleOf" not in out
    out = _number(normalize_schema({"type": "number", "exclusiveMaximum": -(10**15)}, opts).schema)
    assert "minimum" not in out and "exclusiveMinimum" not in out  # would make the schema unsatisfiable
    with pytest.raises(GrammarError) as err:  # past what llguidance reads (numbers.BOUND_LIMIT)
        normalize_schema({"type": "number", "exclusiveMaximum": -(10**20)}, opts)
    assert err.value.path == "/exclusiveMaximum"
    out = _number(normalize_schema({"type": "number", "multipleOf": 0.5}, opts).schema)
    assert out["multipleOf"] == 0.5
    # Negations see the user's schema: `not` of a bounded number stays exact.
    out = normalize_schema({"not": {"type": "number"}}, opts).schema
    assert "maximum" not in str(out)
    assert normalize_schema({"enum": [1, 2]}, opts).schema == {"enum": [1, 2]}
    # Off on request, and never for outlines-core (its own number regex).
    free = normalize_schema({"type": "number"}, GrammarOptions(max_integer_digits=None, max_fraction_digits=None)).schema
    assert free == {"type": "number"}
    assert normalize_schema({"type": "number"}, opts, backend="outlines").schema == {"type": "number"}


def test_equal_capped_numbers_share_one_definition(compiler):
    """llguidance builds a bounded number lexeme per occurrence but a $ref target once: equal
    capped number schemas become one shared definition (issue 42: ten of them compiled in 4.4
    ms inline, 0.9 ms shared)."""
    props = {f"n{i}": {"type": "number", "description": str(i)} for i in range(10)}
    props.update({f"i{i}": {"type": ["integer", "null"], "minimum": 0} for i in range(3)})
    schema = {"type": "object", "properties": props, "required": ["n0", "i0"]}
    out = normalize_schema(schema, GrammarOptions()).schema
    shared = {k for k in out["$defs"] if k.startswith("x-sgrt-number-")}
    assert len(shared) == 2
    assert all(out["properties"][f"n{i}"] == out["properties"]["n0"] for i in range(10))
    assert out["properties"]["i1"]["anyOf"][1] == {"type": ["null"]}
    g = compiler.compile(SamplingParams(json_schema=schema))
    assert feed(g, compiler.vocab.encode('{"n0":1.5,"i0":null}'))
    assert feed(g, compiler.vocab.encode('{"n0":-2,"i0":7}'))
    assert not feed(g, compiler.vocab.encode('{"n0":1e30,"i0":7}'))
    assert not feed(g, compiler.vocab.encode('{"n0":1,"i0":-1}'))


def test_bad_digit_options_are_refused():
    for kw in ({"max_integer_digits": 0}, {"max_fraction_digits": 11}, {"max_fraction_digits": True}):
        with pytest.raises(GrammarError) as err:
            GrammarOptions(**kw)
        assert err.value.field == next(iter(kw))


def test_long_numbers_end(compiler, tokenizer):
    g = compiler.compile_spec("json_schema", {"type": "array", "items": {"type": "number"}}).new_grammar()
    assert feed(g, tokenizer.encode("[3.14,-2,123456789012345,0.0000000001]"))
    assert not feed(g, tokenizer.encode("[1234567890123456]"))
    assert not feed(g, tokenizer.encode("[0.12345678901]"))
    # After 15 integer digits no digit is allowed: the model must close the number.
    g2 = g.copy()
    assert all(g2.accept_token(t) for t in tokenizer.encode("[" + "9" * 15))
    digits = {tokenizer.encode(str(d))[0] for d in range(10)}
    assert not digits & mask_of(g2, compiler.vocab.vocab_size)


def test_unbounded_numbers_on_request(tokenizer):
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size,
                           options=GrammarOptions(max_integer_digits=None, max_fraction_digits=None))
    g = comp.compile_spec("json_schema", {"type": "number"}).new_grammar()
    assert feed(g, tokenizer.encode("1" * 40 + "." + "1" * 40))


def test_formatted_strings_are_capped(compiler, tokenizer):
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]}
    out = normalize_schema(schema, GrammarOptions(max_string_length=64)).schema
    assert out["properties"]["e"]["maxLength"] == 64
    g = compiler.compile_spec("json_schema", schema).new_grammar()
    assert feed(g, tokenizer.encode('{"e":"ada@example.com"}'))
    assert not feed(g, tokenizer.encode('{"e":"' + "a" * 250 + '@example.com"}'))  # 262 > 256
    uri = compiler.compile_spec("json_schema", {"type": "string", "format": "uri"}).new_grammar()
    assert feed(uri, tokenizer.encode('"https://example.com/a"'))
    assert not feed(uri, tokenizer.encode('"https://example.com/' + "a" * 300 + '"'))
