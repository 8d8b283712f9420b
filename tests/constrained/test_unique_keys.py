"""Issue 18, item 7: JSON output never repeats a key in one object (``json_object`` and every
schema whose objects take free keys), on the grammar (matcher and mask) and in generation.

The model-backed test gives the default model prompts that repeat a key in every line; with the
key check off, greedy decoding under ``{"type": "object"}`` copies the repeated key.
"""
from __future__ import annotations

import json

import pytest

from sgrt.constrained.unique_keys import KeyTracker, may_repeat_keys

from .util import compile_or_refuse, feed, mask_of

FREE = {"type": "object"}  # what response_format json_object compiles to


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("text,ok", [
    ('{"a":1}', True),
    ('{"a":1,"a":2}', False),
    ('{"a":1,"\\u0061":2}', False),  # the same name, escaped
    ('{"a":{"a":1,"b":2},"b":[{"a":1},{"a":2}]}', True),  # the same key in other objects
    ('{"a":{"a":1,"a":2}}', False),
    ('{"a":"\\"a\\"","b":"a","c":["a"]}', True),  # "a" as values is no key
    ('{"a\\"b":1,"a\\"b":2}', False),
])
def test_free_object_never_repeats_a_key(compiler, tokenizer, text, ok):
    g = compile_or_refuse(compiler, "llguidance", json_schema=FREE)
    assert feed(g, tokenizer.encode(text)) is ok
    # a token at a time too: the closing quote of the repeat is what is refused
    assert feed(g, [t for ch in text for t in tokenizer.encode(ch)]) is ok


def test_maps_and_nested_free_values(compiler, tokenizer):
    g = compile_or_refuse(compiler, "llguidance", json_schema={"type": "object", "additionalProperties": {"type": "integer"}})
    assert feed(g, tokenizer.encode('{"x":1,"y":2}')) and not feed(g, tokenizer.encode('{"x":1,"x":2}'))
    g = compile_or_refuse(compiler, "llguidance", json_schema={
        "type": "object", "properties": {"meta": {}}, "required": ["meta"]})
    assert feed(g, tokenizer.encode('{"meta":{"k":1,"j":2}}'))
    assert not feed(g, tokenizer.encode('{"meta":{"k":1,"k":2}}'))


def test_mask_clears_the_closing_quote_of_a_used_key(compiler, tokenizer):
    g = compile_or_refuse(compiler, "llguidance", json_schema=FREE).copy()
    for t in tokenizer.encode('{"ab":1,"ab'):
        assert g.accept_token(t)
    allowed = mask_of(g, tokenizer.vocab_size)
    # every token that would close the key as "ab" ('"', '":', '","' ...) is gone
    closing = [i for i in allowed if compiler.vocab.token_bytes[i].startswith(b'"')]
    assert closing == [], [compiler.vocab.token_bytes[i] for i in closing]
    assert tokenizer.encode(' "')[0] in allowed  # "ab " is another key
    assert tokenizer.encode("c")[0] in allowed  # the key can still go on: "abc"
    # every allowed token is accepted (mask and matcher agree)
    for t in sorted(allowed)[:400]:
        assert g.copy().accept_token(t), t


def test_rollback_restores_the_used_keys(compiler, tokenizer):
    g = compile_or_refuse(compiler, "llguidance", json_schema=FREE).copy()
    first = tokenizer.encode('{"a":1,')
    for t in first:
        assert g.accept_token(t)
    before = mask_of(g, tokenizer.vocab_size)
    more = tokenizer.encode('"b":2,')
    for t in more:
        assert g.accept_token(t)
    g.rollback(len(more))
    assert mask_of(g, tokenizer.vocab_size) == before
    assert feed(g, tokenizer.encode('"b":3}'))  # "b" is free again
    assert not feed(g, tokenizer.encode('"a":3}'))


def test_closed_schemas_carry_no_tracker():
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False, "$defs": {"x": {"type": "string"}}}
    assert not may_repeat_keys(closed)
    assert may_repeat_keys(FREE) and may_repeat_keys(True)
    assert may_repeat_keys({"type": "object", "properties": {"a": {}}, "additionalProperties": False})
    assert not may_repeat_keys({"type": "array", "items": {"type": "string"}})


def test_tracker_copy_is_independent():
    t = KeyTracker([])
    t.push(b'{"a":1,')
    c = t.copy()
    c.push(b'"b":2,')
    assert not c.allows(b'"b"') and t.allows(b'"b"') and not t.allows(b'"a"')


def test_generation_with_prompts_that_repeat_keys(loaded_model):
    """Greedy generation under json_object from prompts whose every line repeats a key (without
    the check the model copies ``{"a":1,"a":2,"b":3}`` and ``{"id":4,"id":4}``): each output
    parses, and object_pairs_hook sees each key once per object."""
    from sgrt.engine import Engine, SamplingParams

    prompts = ['Data:\n{"a":1,"a":2,"b":3}\n{"a":1,"a":2,"b":3}\n{"a":1,"a":2,"b":3}\n',
               'Data:\n{"id":1,"id":1}\n{"id":2,"id":2}\n{"id":3,"id":3}\n']
    eng = Engine(model=loaded_model, max_total_tokens=2048)
    try:
        outs = eng.generate_batch(prompts, SamplingParams(max_tokens=40, temperature=0, json_schema=FREE))
    finally:
        eng.shutdown()
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text, object_pairs_hook=_no_duplicates)
        assert isinstance(value, dict) and len(value) >= 2, out.text
