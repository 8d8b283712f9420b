"""Issue 5, "inputs that other engines got wrong", at the token level (items 2-7, 9, 11 and the
mask / EOS behaviour of 7 and 8), on both backends.

llguidance must behave as stated. outlines-core must behave as stated or be refused with a
GrammarError by our own check; it must never give a wrong answer.
"""
from __future__ import annotations

import pytest

from sgrt.constrained import allocate_token_bitmask, fill_vocab_masks
from sgrt.constrained.bitmask import allowed_tokens
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

from .util import BACKENDS, compact, compile_or_refuse, encode_pieces, feed, mask_of, splits


@pytest.mark.parametrize("backend", BACKENDS)
def test_2_string_escapes_any_split(compiler, tokenizer, backend):
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    assert g is not None, "plain strings must compile on both backends"
    value = 'a "b" \\ c\nd é'
    texts = [
        compact({"note": value}),
        '{"note":"a \\"b\\" \\\\ c\\nd \\u00e9"}',  # the issue's text, with a \u escape
    ]
    for text in texts:
        for ids in splits(tokenizer, text):
            assert feed(g, ids), (text, ids)
    assert not feed(g, tokenizer.encode('{"note":"a"b"}'))
    assert not feed(g, tokenizer.encode('{"note":"a\\qb"}'))


@pytest.mark.parametrize("backend", BACKENDS)
def test_3_any_of_null_boolean(compiler, tokenizer, backend):
    schema = {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
        "required": ["v"],
    }
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    assert g is not None
    assert feed(g, tokenizer.encode('{"v":null}'))
    assert feed(g, tokenizer.encode('{"v":true}'))
    assert feed(g, encode_pieces(tokenizer, ['{"v":', "t", "rue", "}"]))
    assert not feed(g, tokenizer.encode('{"v":nulltrue}'))
    assert not feed(g, encode_pieces(tokenizer, ['{"v":', "null", "true}"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_4_min_length_with_pattern(compiler, tokenizer, backend):
    for schema, good, bad in [
        ({"type": "string", "minLength": 2, "pattern": "^[0-9]+$"}, ['"12"'], ['"ab"', '"1"']),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ['"abc"'], ['"abcd"', '"ab1"']),
    ]:
        g = compile_or_refuse(compiler, backend, json_schema=schema)
        if g is None:  # outlines-core ignores pattern next to a length bound: we refuse it
            with pytest.raises(GrammarError) as err:
                compiler.compile(SamplingParams(json_schema=schema, grammar_backend=backend))
            assert err.value.path.endswith("/pattern")
            continue
        for text in good:
            assert feed(g, tokenizer.encode(text)), text
        for text in bad:
            for ids in splits(tokenizer, text):
                assert not feed(g, ids), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_5_pattern_is_a_search_unless_anchored(compiler, tokenizer, backend):
    g = compile_or_refuse(compiler, backend, json_schema={"type": "string", "pattern": "abc"})
    assert g is not None
    for text in ['"xxabcxx"', '"abc"', '"abcx"', '"xabc"']:
        assert feed(g, tokenizer.encode(text)), text
    for text in ['"ab"', '"xxabxcx"', '""']:
        assert not feed(g, tokenizer.encode(text)), text
    g = compile_or_refuse(compiler, backend, json_schema={"type": "string", "pattern": "^[A-Z]{3}$"})
    assert g is not None
    assert feed(g, tokenizer.encode('"ABC"'))
    for text in ['"ABCD"', '"AB"', '"abc"', '"xABC"']:
        assert not feed(g, tokenizer.encode(text)), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_6_numbers(compiler, tokenizer, backend):
    # With the default digit bounds (issue 20) llguidance's range grammar takes no exponent
    # form: a counted departure (DESIGN.md, "Constraints"). Without them every JSON number is in.
    from sgrt.constrained import GrammarCompiler
    from sgrt.constrained.options import GrammarOptions

    unbounded = GrammarCompiler(tokenizer, tokenizer.vocab_size, compile_timeout_s=30.0,
                                options=GrammarOptions(max_integer_digits=None, max_fraction_digits=None))
    for comp, valid in ((compiler, ["0", "-12.25", "3", "-0.5"]),
                        (unbounded, ["1e5", "1E5", "1e+5", "-0.5e-3", "0", "-12.25", "3"])):
        g = compile_or_refuse(comp, backend, json_schema={"type": "number"})
        assert g is not None
        for text in valid:
            for ids in splits(tokenizer, text):
                assert feed(g, ids), text
        for text in ["01", "1.", ".5", "+1", "1e", "--1"]:
            for ids in splits(tokenizer, text):
                assert not feed(g, ids), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_7_bounded_repeat_eos_and_termination(compiler, tokenizer, backend):
    eos = sorted(tokenizer.eos_token_ids)
    one = tokenizer.encode("1")[0]
    start = compiler.compile(SamplingParams(regex="[1]{1,3}", grammar_backend=backend))
    early = start.copy()
    assert early.accept_token(one)
    # A batch: row 0 reached "1" early, row 1 has not started.
    bm = allocate_token_bitmask(2, compiler.vocab.vocab_size)
    fill_vocab_masks([(early, 0), (start, 1)], bm)
    row0, row1 = set(allowed_tokens(bm, 0)), set(allowed_tokens(bm, 1))
    assert set(eos) <= row0 and one in row0
    assert not set(eos) & row1 and one in row1
    assert early.is_accepting() and not early.is_terminated()
    assert early.accept_token(one) and early.accept_token(one)
    assert early.is_terminated()
    assert mask_of(early, compiler.vocab.vocab_size) == set(eos)
    assert not early.accept_token(one)
    assert early.accept_token(eos[0])
    # A finished row never grows.
    assert not early.accept_token(one)
    assert mask_of(early, compiler.vocab.vocab_size) == set(eos)


@pytest.mark.parametrize("backend", BACKENDS)
def test_8_star_allows_stop_and_continue(compiler, tokenizer, backend):
    eos = set(tokenizer.eos_token_ids)
    a = tokenizer.encode("a")[0]
    g = compiler.compile(SamplingParams(regex="a*", grammar_backend=backend))
    for _ in range(6):
        allowed = mask_of(g, compiler.vocab.vocab_size)
        assert eos <= allowed and a in allowed
        assert g.is_accepting() and not g.is_terminated()
        assert g.accept_token(a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_9_recursive_schema(compiler, tokenizer, backend):
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["name", "children"],
            }
        },
        "$ref": "#/$defs/node",
    }
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    if g is None:  # outlines-core cuts recursion at depth 3, dropping properties: refused
        with pytest.raises(GrammarError) as err:
            compiler.compile(SamplingParams(json_schema=schema, grammar_backend=backend))
        assert "$ref" in str(err.value)
        return
    tree = {"name": "l1", "children": []}
    node = tree
    for depth in range(2, 6):
        child = {"name": f"l{depth}", "children": []}
        node["children"].append(child)
        node = child
    tree["children"].append({"name": "sibling", "children": []})
    assert feed(g, tokenizer.encode(compact(tree)))
    node["children"].append({"name": "bad"})  # missing "children" at level 6
    assert not feed(g, tokenizer.encode(compact(tree)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_11_lookahead_is_a_clear_error(compiler, backend):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(?=.{3,8}$)[a-z]+$"}}}
    with pytest.raises(GrammarError) as err:
        compiler.compile(SamplingParams(json_schema=schema, grammar_backend=backend))
    assert err.value.path == "/properties/p/pattern"
    assert "lookahead" in str(err.value) and err.value.field == "json_schema"
    # The compiler keeps serving the other requests.
    ok = compiler.compile(SamplingParams(json_schema={"type": "string", "pattern": "^[a-z]{3,8}$"}, grammar_backend=backend))
    assert ok is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_10_no_eos_inside_the_object(compiler, tokenizer, backend):
    """Grammar-level half of item 10: EOS is masked at every step until the object closes."""
    eos = set(tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    ids = tokenizer.encode('{"s":"hello world"}')
    for t in ids:
        assert not eos & mask_of(g, compiler.vocab.vocab_size)
        assert not g.is_accepting()
        assert not g.accept_token(sorted(eos)[0])
        assert g.accept_token(t)
    assert eos <= mask_of(g, compiler.vocab.vocab_size)
    assert g.is_terminated()
