"""The Grammar interface on both backends: rollback exactness, forced tokens, copies, masks
past the tokenizer, the compile cache, threads and time limits."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from sgrt.constrained import GrammarCompiler, GrammarOptions, allocate_token_bitmask, fill_vocab_masks
from sgrt.constrained.bitmask import allowed_tokens
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

from .util import BACKENDS, compact, feed, mask_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
    },
    "required": ["name", "age", "tags"],
}
INSTANCE = {"name": "Ada \"L\" é", "age": 36, "tags": ["bb", "a"]}


def _mask_bytes(g, vocab_size):
    bm = allocate_token_bitmask(1, vocab_size)
    g.fill_vocab_mask(bm, 0)
    return bm.clone()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_is_exact(compiler, tokenizer, backend):
    g = compiler.compile(SamplingParams(json_schema=SCHEMA, grammar_backend=backend))
    ids = tokenizer.encode(compact(INSTANCE))
    vocab = compiler.vocab.vocab_size
    seen = [_mask_bytes(g, vocab)]
    for t in ids:
        assert g.accept_token(t)
        seen.append(_mask_bytes(g, vocab))
    eos = sorted(tokenizer.eos_token_ids)[0]
    assert g.accept_token(eos)
    n = len(ids) + 1
    for k in (1, 2, 5, len(ids) // 2):
        g.rollback(k)
        assert torch.equal(_mask_bytes(g, vocab), seen[min(n - k, len(ids))]), k
        for t in (ids + [eos])[n - k :]:
            assert g.accept_token(t)
    g.rollback(n)
    assert torch.equal(_mask_bytes(g, vocab), seen[0])
    with pytest.raises(ValueError):
        g.rollback(1)
    with pytest.raises(ValueError):
        g.rollback(-1)
    # Rejected tokens leave the state unchanged.
    assert not g.accept_token(tokenizer.encode("]")[0])
    assert torch.equal(_mask_bytes(g, vocab), seen[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tokens_after_brace(compiler, tokenizer, backend):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    g = compiler.compile(SamplingParams(json_schema=schema, grammar_backend=backend))
    assert g.accept_token(tokenizer.encode("{")[0])
    forced = g.forced_tokens()
    text = tokenizer.decode(forced)
    assert text.startswith('"name') and '"name":"'.startswith(text), text
    for t in forced:  # the run is accepted as it is
        assert g.accept_token(t)
    assert not g.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tokens_none_when_free(compiler, tokenizer, backend):
    g = compiler.compile(SamplingParams(regex="[a-z]+", grammar_backend=backend))
    assert g.forced_tokens() == []
    g = compiler.compile(SamplingParams(regex="abc[0-9]", grammar_backend=backend))
    text = tokenizer.decode(g.forced_tokens())
    assert "abc".startswith(text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_is_independent(compiler, tokenizer, backend):
    g = compiler.compile(SamplingParams(json_schema=SCHEMA, grammar_backend=backend))
    ids = tokenizer.encode(compact(INSTANCE))
    for t in ids[:5]:
        assert g.accept_token(t)
    c = g.copy()
    before = _mask_bytes(c, compiler.vocab.vocab_size)
    for t in ids[5:10]:
        assert g.accept_token(t)
    assert torch.equal(_mask_bytes(c, compiler.vocab.vocab_size), before)
    assert c.num_accepted == 5 and g.num_accepted == 10
    for t in ids[5:]:
        assert c.accept_token(t)
    assert c.is_accepting()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_sized_to_logits_width(tokenizer, backend):
    wide = tokenizer.vocab_size + 40  # a model whose logits are wider than its tokenizer
    comp = GrammarCompiler(tokenizer, wide, backend=backend)
    g = comp.compile(SamplingParams(regex="(?:[a-z]|[0-9])*"))
    bm = allocate_token_bitmask(1, wide)
    assert bm.shape == (1, (wide + 31) // 32)
    g.fill_vocab_mask(bm, 0)
    allowed = set(allowed_tokens(bm, 0, wide))
    assert not {t for t in allowed if t >= tokenizer.vocab_size}
    special = set(tokenizer.special_token_ids) - set(tokenizer.eos_token_ids)
    assert not allowed & special
    assert set(tokenizer.eos_token_ids) <= allowed
    assert not g.accept_token(tokenizer.vocab_size + 3)


def test_batch_fill_equals_row_fill(compiler, tokenizer):
    grammars = [compiler.compile(SamplingParams(json_schema=SCHEMA)) for _ in range(3)]
    grammars.append(compiler.compile(SamplingParams(regex="a*", grammar_backend="outlines")))
    ids = tokenizer.encode(compact(INSTANCE))
    for i, g in enumerate(grammars[:3]):
        for t in ids[: 3 * i + 1]:
            assert g.accept_token(t)
    vocab = compiler.vocab.vocab_size
    batch = allocate_token_bitmask(5, vocab)
    fill_vocab_masks([(g, i) for i, g in enumerate(grammars)], batch)
    for i, g in enumerate(grammars):
        assert torch.equal(batch[i], _mask_bytes(g, vocab)[0])
    assert bool((batch[4] == -1).all())  # an unconstrained row stays all-allowed


def test_compile_cache_and_fresh_copies(compiler):
    params = SamplingParams(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    hits = compiler.stats["hits"]
    a, b = compiler.compile(params), compiler.compile(params)
    assert a is not b and compiler.stats["hits"] >= hits + 1
    assert a.accept_token(compiler.vocab.encode("{")[0])
    assert b.num_accepted == 0
    assert compiler.compile(SamplingParams()) is None
    with pytest.raises(GrammarError):
        compiler.compile(SamplingParams(regex="a", grammar_backend="xgrammar"))
    with pytest.raises(GrammarError) as err:
        compiler.compile(SamplingParams(grammar="json", grammar_backend="outlines"))
    assert err.value.field == "grammar"


def test_compile_from_threads(compiler, tokenizer):
    errors, grammars = [], []

    def work(i):
        try:
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i}}, "required": [f"k{i}"]}
            grammars.append((i, compiler.compile(SamplingParams(json_schema=schema))))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i % 4,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, g in grammars:
        assert all(g.accept_token(t) for t in tokenizer.encode(f'{{"k{i}":{i + 1}}}')) and g.is_accepting()


def test_compile_time_limit(tokenizer):
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, compile_timeout_s=0.2)

    def slow():
        time.sleep(1.0)
        raise AssertionError("unreachable")

    # The job would raise AssertionError after its sleep: a GrammarError naming the timeout
    # means the caller stopped waiting at the limit.
    with pytest.raises(GrammarError) as err:
        comp._cached(("llguidance", "regex", "slow", None), slow, "regex")
    assert "compile_timeout_s" in str(err.value)


def test_outlines_worker_is_killed_on_timeout(tokenizer):
    """A pathological outlines-core input (a bounded top-level string) is stopped, not waited on."""
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend="outlines", compile_timeout_s=3.0)
    with pytest.raises(GrammarError) as err:
        comp.compile(SamplingParams(json_schema={"type": "string", "maxLength": 400}))
    # A timeout, from the compiler's wait or the worker's own (whichever fires first under load):
    # stopped at the limit, not waited on.
    assert "compile_timeout_s" in str(err.value) or "took too long" in str(err.value), err.value
    # The worker comes back for the next request.
    g = comp.compile(SamplingParams(regex="[0-9]{2}"))
    assert g is not None and g.accept_token(comp.vocab.encode("4")[0])


def test_whitespace_options(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    for mode, good, bad in [
        ("compact", ['{"a":1,"b":2}'], ['{"a": 1,"b":2}', '{ "a":1,"b":2}']),
        ("one_space", ['{"a":1,"b":2}', '{"a": 1, "b": 2}'], ['{"a":  1,"b":2}', '{"a":1,\n"b":2}']),
        ("flexible", ['{"a":1,"b":2}', '{\n  "a": 1,\n  "b": 2\n}'], ['{"a":' + " " * 30 + "1}"]),
    ]:
        comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, options=GrammarOptions(whitespace=mode))
        for backend in BACKENDS:
            compiled = comp.compile_spec("json_schema", schema, backend)
            for text in good:
                g = compiled.new_grammar()
                assert all(g.accept_token(t) for t in tokenizer.encode(text)) and g.is_accepting(), (mode, backend, text)
            for text in bad:
                g = compiled.new_grammar()
                assert not (all(g.accept_token(t) for t in tokenizer.encode(text)) and g.is_accepting()), (mode, backend, text)


def test_lark_grammar_may_name_special_tokens(compiler, tokenizer):
    """Issue 20: a Lark grammar naming the EOS id (``<[2]>``) gets it in its mask, takes it,
    and ends there; another special id it names works the same way; one it does not name stays
    forbidden."""
    eos = compiler.vocab.eos_token_id
    other = next(i for i in sorted(compiler.vocab.special_token_ids) if i not in compiler.vocab.eos_token_ids)
    vs = compiler.vocab.vocab_size
    g = compiler.compile_spec("grammar", f"start: <[{eos}]>").new_grammar()
    assert mask_of(g, vs) == {eos}
    assert g.accept_token(eos) and g.is_accepting() and g.is_terminated()
    g = compiler.compile_spec("grammar", f'start: "yes" <[{eos}]>').new_grammar()
    assert all(g.accept_token(t) for t in tokenizer.encode("yes"))
    assert mask_of(g, vs) == {eos}
    assert not g.copy().accept_token(other)
    assert g.accept_token(eos) and g.is_terminated()
    g.rollback(1)
    assert mask_of(g, vs) == {eos} and not g.is_accepting()
    g = compiler.compile_spec("grammar", f'start: "yes" <[{other}]>').new_grammar()
    assert all(g.accept_token(t) for t in tokenizer.encode("yes"))
    assert mask_of(g, vs) == {other}
    assert not g.copy().accept_token(eos)  # not accepting, and the grammar does not name it
    assert g.accept_token(other) and g.is_accepting()


def test_a_schema_is_loaded_once_per_compile(tokenizer, monkeypatch):
    # The compiler reads the request's json_schema once (limits, cache key, normalization all
    # work on that one copy); the copy is its own, so the caller's dict is left as it was.
    import copy

    import sgrt.constrained.compiler as compiler_mod
    import sgrt.constrained.schema as schema_mod

    calls = []
    real = schema_mod.load_schema

    def counting(spec):
        calls.append(spec)
        return real(spec)

    monkeypatch.setattr(compiler_mod, "load_schema", counting)
    monkeypatch.setattr(schema_mod, "load_schema", counting)
    spec = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    before = copy.deepcopy(spec)
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    g = comp.compile(SamplingParams(json_schema=spec))
    assert len(calls) == 1
    assert spec == before
    assert feed(g, tokenizer.encode(compact({"n": 4}), add_special_tokens=False))
    assert not feed(g, tokenizer.encode(compact({"n": 2}), add_special_tokens=False))  # minimum kept
