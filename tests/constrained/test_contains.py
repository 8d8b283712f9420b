"""Issue 20: ``contains`` / ``minContains`` / ``maxContains`` compiled as a sound subset.

The first ``minContains`` items (default 1) must match ``contains``; with ``maxContains`` the
items after them must not match it (when it has an exact negation) or the array is at most
``maxContains`` long. Valid arrays whose matches come later are rejected (a departure); invalid
ones never pass. Negated ``contains`` (``not``, ``if``) is rewritten exactly.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sgrt.constrained import GrammarOptions, normalize_schema
from bench.validity import load_test_suite, run_case
from sgrt.errors import GrammarError

from .util import BACKENDS, compile_or_refuse, feed, mask_of

# Every group of the three keyword files, and the unevaluatedItems groups that use contains.
SUITE = load_test_suite(files=["contains.json", "minContains.json", "maxContains.json"]) + \
    [c for c in load_test_suite(files=["unevaluatedItems.json"]) if int(c.name.split("#")[1]) in (21, 22, 23, 24)]


@pytest.mark.parametrize("serialization", ["compact", "flexible"])
def test_suite_groups_compile_and_judge_right(compiler, serialization):
    results = [run_case(compiler, "llguidance", case, measure_masks=serialization == "compact",
                        serialization=serialization) for case in SUITE]
    assert len(SUITE) == 24
    assert [r.name for r in results if not r.compiled] == []
    wrong = [(r.name, r.notes) for r in results if r.invalid_accepted or r.valid_rejected or r.mask_mismatch]
    assert not wrong
    assert sum(r.invalid_rejected for r in results) >= 40
    assert sum(r.valid_accepted for r in results) >= 25 and sum(r.departures for r in results) <= 16


# (schema, texts judged by jsonschema, texts that must be accepted)
CASES = [
    ({"contains": {"minimum": 5}}, ["[5,4,3]", "[2,3,4]", "[]", "{}", "[3,4,5]"], ["[5,4,3]", "{}"]),
    ({"items": {"multipleOf": 2}, "contains": {"multipleOf": 3}}, ["[6,12]", "[2,4,8]", "[3,6,9]", "[1,5]"], ["[6,12]"]),
    ({"contains": {"const": 1}, "maxContains": 1}, ["[1]", "[1,1]", "[1,2]", "[1,2,1]", "[]"], ["[1]", "[1,2]"]),
    ({"contains": {"const": 1}, "minContains": 2, "maxContains": 3}, ["[1,1]", "[1]", "[1,1,1,1]", "[1,1,2]"], ["[1,1]", "[1,1,2]"]),
    # no exact negation of a pattern: the array is bounded by maxContains instead
    ({"contains": {"type": "string", "pattern": "^a"}, "maxContains": 1}, ['["ab"]', '["ab","ac"]', '["ab","b"]'], ['["ab"]']),
    ({"contains": {"const": 1}, "minContains": 3, "maxContains": 1}, ["[]", "[1,1,1]", "3"], ["3"]),
    ({"contains": False}, ["[]", '["a"]', '"s"'], ['"s"']),
    ({"not": {"contains": {"const": 1}}}, ["[]", "[1]", "[2,3]", "[2,1]", "7"], ["[]", "[2,3]"]),
    ({"if": {"contains": {"const": "a"}}, "then": {"maxItems": 2}, "else": {"minItems": 1}},
     ['["a"]', '["a","b","c"]', '["b"]', "[]", '["b","a","c"]'], ['["a"]', '["b"]']),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                "contains": {"const": "urgent"}}}, "required": ["tags"]},
     ['{"tags":["urgent","x"]}', '{"tags":["x"]}', '{"tags":[]}'], ['{"tags":["urgent","x"]}']),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema,texts,must", CASES, ids=[json.dumps(c[0])[:50] for c in CASES])
def test_contains_cases(compiler, tokenizer, backend, schema, texts, must):
    g = compile_or_refuse(compiler, backend, json_schema=schema)
    if g is None:
        return  # outlines-core refused it with our own check
    validator = jsonschema.Draft202012Validator(schema)
    for text in texts:
        accepted = feed(g, tokenizer.encode(text))
        if accepted:
            assert validator.is_valid(json.loads(text)), (backend, text)
        if backend == "llguidance" and text in must:
            assert accepted, text


def test_mask_forbids_a_second_match(compiler, tokenizer):
    """maxContains 1 with an exact negation: after ``[true,`` the mask allows ``false`` only."""
    g = compile_or_refuse(compiler, "llguidance", json_schema={"type": "array", "items": {"type": "boolean"},
                                                                 "contains": {"const": True}, "maxContains": 1})
    assert feed(g, tokenizer.encode("[true,false]"))
    assert not feed(g, tokenizer.encode("[true,true]"))
    h = g.copy()
    assert all(h.accept_token(t) for t in tokenizer.encode("[true,"))
    allowed = mask_of(h, tokenizer.vocab_size)
    yes, no = tokenizer.encode("true"), tokenizer.encode("false")
    assert len(yes) == 1 and len(no) == 1
    assert yes[0] not in allowed and no[0] in allowed
    # and the first item must match: after "[" only "true" starts an accepted array
    first = g.copy()
    assert first.accept_token(tokenizer.encode("[")[0])
    allowed = mask_of(first, tokenizer.vocab_size)
    assert yes[0] in allowed and no[0] not in allowed


def test_generated_instance_is_valid(compiler, tokenizer):
    """Following the mask greedily from the lowest allowed token ends in a valid instance."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "contains": {"const": 7}, "minContains": 2, "maxItems": 4}
    g = compile_or_refuse(compiler, "llguidance", json_schema=schema).copy()
    ids: list[int] = []
    for _ in range(40):
        if g.is_accepting() and g.is_terminated():
            break
        allowed = sorted(mask_of(g, tokenizer.vocab_size))
        eos = [t for t in allowed if t in compiler.vocab.eos_token_ids]
        if eos and g.is_accepting():
            break
        t = [t for t in allowed if t not in compiler.vocab.eos_token_ids][0]
        assert g.accept_token(t)
        ids.append(t)
    value = json.loads(tokenizer.decode(ids))
    jsonschema.validate(value, schema)
    assert value[:2] == [7, 7]


def test_bad_counts_and_limits_are_refused():
    with pytest.raises(GrammarError, match="minContains"):
        normalize_schema({"contains": {"const": 1}, "minContains": -1}, GrammarOptions())
    with pytest.raises(GrammarError, match="minContains"):
        normalize_schema({"contains": {"const": 1}, "minContains": 10_000}, GrammarOptions())
    # minContains / maxContains alone constrain nothing
    assert normalize_schema({"type": "array", "minContains": 2}, GrammarOptions()).schema == {"type": "array"}
