"""A fixed subset of the validity corpus (every 8th JSONSchemaBench schema: 40 of 313, plus a
few JSON Schema Test Suite groups), fed token by token on both backends.

llguidance: every instance of a compiled schema is judged right (valid accepted unless it breaks
a chosen departure; invalid rejected), and masks never allow a token the grammar rejects.
outlines-core (on the 40, 3 s per schema): never accepts an invalid instance; it may refuse
schemas and reject some valid instances (its JSON regexes allow only two levels of nesting where
a schema leaves values free). The whole corpus runs in bench/schema_corpus.py.
"""
from __future__ import annotations

import pytest

from sgrt.constrained import GrammarCompiler
from sgrt.constrained.validity import load_maskbench, load_test_suite, run_case

SUBSET = load_maskbench()[::8]
SUITE = load_test_suite(files=["anyOf.json", "enum.json", "items.json", "minLength.json", "pattern.json", "required.json"])


@pytest.fixture(scope="module")
def outlines_compiler(tokenizer):
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend="outlines", compile_timeout_s=3.0)
    yield comp
    comp.backend_for("outlines").worker.close()


def test_subset_is_fixed():
    assert len(SUBSET) == 40
    assert SUBSET[0].name == "Glaiveai2K/calculate_area_4f2bd9b6.json"


def test_llguidance_subset(compiler):
    results = [run_case(compiler, "llguidance", case) for case in SUBSET + SUITE]
    compiled = [r for r in results if r.compiled]
    assert len([r for r in results[: len(SUBSET)] if r.compiled]) >= 34  # 85%: this subset is harder than the whole (91%)
    problems = [(r.name, r.notes) for r in compiled if r.invalid_accepted or r.valid_rejected or r.mask_mismatch]
    assert not problems
    assert sum(r.valid_accepted for r in compiled) > 60
    assert sum(r.invalid_rejected for r in compiled) > 100


def test_outlines_subset_never_accepts_invalid(outlines_compiler):
    results = [run_case(outlines_compiler, "outlines", case) for case in SUBSET]
    compiled = [r for r in results if r.compiled]
    assert len(compiled) >= 6  # ~11 of 40 on an idle machine; the rest refused or timed out
    wrong = [(r.name, r.notes) for r in compiled if r.invalid_accepted or r.mask_mismatch]
    assert not wrong
    refused = [r for r in results if not r.compiled]
    assert all("json_schema" in (r.error or "") or "outlines" in (r.error or "") for r in refused)
