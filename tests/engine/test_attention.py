"""Paged attention over the KV pool (sgrt/engine/attention.py): cascade attention for decode rows
that share a prefix equals attention over each row's whole context."""
from __future__ import annotations

import random

import pytest
import torch

from sgrt.engine import Engine, SamplingParams
from sgrt.engine import attention as attention_mod
from sgrt.engine.attention import CASCADE_MIN_PREFIX, PagedAttention, RowSpec
from sgrt.engine.kv_pool import KVPool

from .conftest import assert_same_greedy

# How far apart two tokens' logprobs may be for a bfloat16 model's near-tie
# (test_native_extend_attention_gives_the_greedy_tokens_of_gather_and_sdpa).
BF16_TIE = 0.3


def _pool(dtype: torch.dtype) -> KVPool:
    pool = KVPool(4000, 2, 3, 64, dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def _decode_rows(prefix_len: int, n: int, rng: random.Random) -> list[RowSpec]:
    prefix = list(range(1, prefix_len + 1))
    return [RowSpec(prefix + list(range(2000 + 60 * i, 2000 + 60 * i + rng.randint(1, 50))), 1) for i in range(n)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cascade_equals_attention_over_the_whole_context(dtype, tol):
    rng = random.Random(1)
    pool = _pool(dtype)
    rows = _decode_rows(CASCADE_MIN_PREFIX + 100, 6, rng)
    q, k, v = (torch.randn(6, h, 64).to(dtype) for h in (9, 3, 3))
    cascade = PagedAttention(pool, rows, cascade=True)
    (group,) = cascade.groups
    assert group.shared_index is not None and len(group.shared_index) == CASCADE_MIN_PREFIX + 100
    got = cascade.forward(0, q, k, v).float()
    pool_plain = _pool(dtype)
    want = PagedAttention(pool_plain, rows, cascade=False).forward(0, q, k, v).float()
    assert got.shape == (6, 9 * 64)
    assert (got - want).abs().max().item() <= tol
    # The new K/V were written to the pool all the same.
    assert torch.equal(pool.k[0, [r.slots[-1] for r in rows]], k)


def test_cascade_needs_a_long_shared_prefix_and_leaves_every_row_a_suffix():
    pool = _pool(torch.float32)
    short = _decode_rows(CASCADE_MIN_PREFIX - 1, 4, random.Random(2))
    assert PagedAttention(pool, short).groups[0].shared_index is None
    alone = _decode_rows(CASCADE_MIN_PREFIX + 10, 1, random.Random(3))
    assert PagedAttention(pool, alone).groups[0].shared_index is None
    # Identical contexts: the newest slot of each row still goes through its own suffix.
    same = [RowSpec(list(range(1, CASCADE_MIN_PREFIX + 20)), 1)] * 3
    (group,) = PagedAttention(pool, same).groups
    assert len(group.shared_index) == CASCADE_MIN_PREFIX + 18 and group.max_kv == 1
    # Extend rows never cascade.
    extend = [RowSpec(list(range(1, CASCADE_MIN_PREFIX + 20)) + [3000 + i, 3100 + i], 2) for i in range(3)]
    assert PagedAttention(pool, extend).groups[0].shared_index is None


@pytest.mark.parametrize("native", [False, True])
def test_batched_requests_on_one_long_prefix_match_their_runs_alone(loaded_model, monkeypatch, native):
    """PyTorch path: the batched decode rows share the prefix through cascade attention. Native
    operators: they read it in place, no cascade. Either way each output equals its run alone."""
    calls = []
    real = attention_mod.cascade_decode_attention
    monkeypatch.setattr(attention_mod, "cascade_decode_attention", lambda *a: calls.append(1) or real(*a))
    shared = "You are a careful assistant who answers in one short sentence. " * 20
    prompts = [shared + f"Question {i}: name a colour that starts with the letter {c}." for i, c in enumerate("BGRY")]
    params = SamplingParams(max_tokens=12, return_logprob=True, top_logprobs_num=5)
    was_native = loaded_model.model.native_ops
    if native and not was_native:
        pytest.skip("the native layer operators are not built here")
    loaded_model.model.use_native_ops(native)
    eng = Engine(model=loaded_model, max_total_tokens=8192)
    try:
        assert len(eng.tokenizer.encode(shared)) >= CASCADE_MIN_PREFIX
        alone = [eng.generate(p, params) for p in prompts]
        assert not calls  # one row at a time: plain attention
        eng.flush_cache()
        batched = eng.generate_batch(prompts, params)
        assert bool(calls) == (not native)  # cascade only on the PyTorch path
    finally:
        eng.shutdown()
        loaded_model.model.use_native_ops(was_native)
    for a, b in zip(alone, batched):
        assert_same_greedy(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_native_long_context_and_window_match_the_pytorch_path(dtype, tol):
    """A batch-1 decode row of 1,500 tokens (split into chunks by the native operator) and a
    ragged second row: the native path equals gather + SDPA, for full attention and for a
    512-token window, whose slot table holds only the window's slots."""
    from sgrt.kernels import layer_ops

    if not layer_ops.available():
        pytest.skip("the native layer operators are not built here")
    rows = [RowSpec(list(range(1, 1501)), 1), RowSpec(list(range(2000, 2300)), 1)]
    q, k, v = (torch.randn(2, h, 64, generator=torch.Generator().manual_seed(h)).to(dtype) for h in (9, 3, 3))
    for window in (None, 512):
        native = PagedAttention(_pool(dtype), rows, native=True)
        got = native.forward(0, q, k, v, window=window).float()
        want = PagedAttention(_pool(dtype), rows, native=False).forward(0, q, k, v, window=window).float()
        assert (got - want).abs().max().item() <= tol
        if window is not None:
            slots, lens = native._window_groups(window)[1]
            assert slots.shape == (2, 512) and lens.tolist() == [512, 300]
            assert slots[0].tolist() == list(range(989, 1501))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cached,q_len", [(0, 700), (300, 450), (900, 333)])
def test_windowed_extend_in_bands_matches_one_masked_call(dtype, tol, cached, q_len, monkeypatch):
    """A sliding-window layer's extend row (a prefill chunk after ``cached`` tokens already in the
    pool) attended in blocks of queries over the keys each block's window reaches equals one SDPA
    call over the whole masked score matrix."""
    window = 256
    rows = [RowSpec(list(range(1, cached + q_len + 1)), q_len)]
    q, k, v = (torch.randn(q_len, h, 64, generator=torch.Generator().manual_seed(h)).to(dtype) for h in (9, 3, 3))
    banded = PagedAttention(_pool(dtype), rows)
    (group,) = banded._window_groups(window)[0]
    assert group.bands is not None and group.bands[0][:2] == (0, attention_mod.BAND_QUERIES)
    assert all(hi - lo <= window + attention_mod.BAND_QUERIES - 1 for _, _, lo, hi in group.bands)
    got = banded.forward(0, q, k, v, window=window).float()
    monkeypatch.setattr(attention_mod, "BAND_QUERIES", 1 << 30)
    whole = PagedAttention(_pool(dtype), rows)
    assert whole._window_groups(window)[0][0].bands is None
    want = whole.forward(0, q, k, v, window=window).float()
    assert got.shape == (q_len, 9 * 64) and (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banded_extend_with_its_additive_mask_equals_the_boolean_mask(dtype):
    """The bands read one additive mask (0 / -inf in q's dtype) built once per forward: bit for
    bit what SDPA gives each band given the boolean mask (which it converts per call)."""
    import torch.nn.functional as F

    window, cached, q_len = 256, 300, 450
    rows = [RowSpec(list(range(1, cached + q_len + 1)), q_len)]
    q, k, v = (torch.randn(q_len, h, 64, generator=torch.Generator().manual_seed(h)).to(dtype) for h in (9, 3, 3))
    pool = _pool(dtype)
    att = PagedAttention(pool, rows)
    got = att.forward(0, q, k, v, window=window)
    (g,) = att._window_groups(window)[0]
    assert g.additive_mask(dtype).dtype == dtype and len(g.bands) > 1
    keys = pool.k_layers[0].index_select(0, g.kv_index).view(1, g.max_kv, 3, 64).transpose(1, 2)
    values = pool.v_layers[0].index_select(0, g.kv_index).view(1, g.max_kv, 3, 64).transpose(1, 2)
    qh = q.transpose(0, 1).unsqueeze(0)
    for a, b, lo, hi in g.bands:
        o = F.scaled_dot_product_attention(qh[:, :, a:b], keys[:, :, lo:hi], values[:, :, lo:hi],
                                           attn_mask=g.mask[:, :, a:b, lo:hi], enable_gqa=True)
        assert torch.equal(got[a:b], o[0].transpose(0, 1).reshape(b - a, 9 * 64)), (a, b)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_decode_tables_equal_the_groups_slot_tables(window):
    """A decode-only native forward builds its slot tables in one buffer (_decode_tables); they
    hold the values of the general path's group tables: new slots, slot rows padded with 0 to
    the longest (cut to the window), context lengths."""
    rng = random.Random(3)
    rows = [RowSpec(rng.sample(range(1, 4000), n), 1) for n in (7, 30, 1, 12)]
    for batch in (rows[:1], rows):
        general = PagedAttention(_pool(torch.float32), batch, cascade=False)  # (not native: groups)
        (group,) = general.groups if window is None else general._window_groups(window)[0]
        new_slots, table, kv_lens = attention_mod._decode_tables(
            [r.slots if window is None else r.slots[max(0, len(r.slots) - window):] for r in batch])
        assert new_slots.tolist() == general.out_slots.tolist() == [r.slots[-1] for r in batch]
        assert table.is_contiguous() and new_slots.is_contiguous() and table.dtype == torch.long
        assert table.tolist() == group.kv_index.view(group.size, group.max_kv).tolist()
        assert kv_lens.tolist() == group.kv_lens.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_extend_rows_match_the_pytorch_path(dtype, monkeypatch):
    """A mixed forward (decode rows, two extend rows of one q_len after cached prefixes, one after
    a longer prefix, a fresh prefill) on the native path equals the PyTorch path within bfloat16
    rounding; bfloat16 extend groups go to ``extend_attention`` (where it runs), float32 ones and
    sliding-window layers keep gather + SDPA."""
    from sgrt.kernels import layer_ops

    if not layer_ops.available():
        pytest.skip("the native layer operators are not built here")
    gathered = []
    real = PagedAttention._attend_gathered
    monkeypatch.setattr(PagedAttention, "_attend_gathered",
                        staticmethod(lambda g, *a: gathered.append(g.q_len) or real(g, *a)))
    rng = random.Random(4)
    slots = rng.sample(range(1, 4000), 1500)
    rows = [RowSpec(slots[0:300], 1), RowSpec(slots[300:420], 7), RowSpec(slots[420:427], 7),
            RowSpec(slots[427:1100], 150), RowSpec(slots[1100:1101], 1), RowSpec(slots[1101:1140], 39)]
    t = sum(r.q_len for r in rows)
    q, k, v = (torch.randn(t, h, 64, generator=torch.Generator().manual_seed(h)).to(dtype) for h in (9, 3, 3))
    extend_native = dtype == torch.bfloat16 and layer_ops.extend_attention_available()
    for window in (None, 100):
        gathered.clear()
        got = PagedAttention(_pool(dtype), rows, native=True).forward(0, q, k, v, window=window).float()
        assert any(n > 1 for n in gathered) != (extend_native and window is None)
        want = PagedAttention(_pool(dtype), rows, native=False).forward(0, q, k, v, window=window).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert got.shape == (t, 9 * 64) and (got - want).abs().max().item() <= tol


def test_native_extend_falls_back_to_sdpa_where_the_cpu_lacks_it(monkeypatch):
    """A CPU without AVX-512 BF16 (extend_attention_available False): native PagedAttention keeps
    gather + SDPA for extend rows: the PyTorch path's bits for them (the decode row takes the
    native decode operator either way)."""
    from sgrt.kernels import layer_ops

    if not layer_ops.available():
        pytest.skip("the native layer operators are not built here")
    monkeypatch.setattr(layer_ops, "extend_attention_available", lambda: False)
    rows = [RowSpec(list(range(1, 301)), 40), RowSpec(list(range(400, 410)), 1)]
    q, k, v = (torch.randn(41, h, 64, generator=torch.Generator().manual_seed(h)).to(torch.bfloat16)
               for h in (9, 3, 3))
    native = PagedAttention(_pool(torch.bfloat16), rows, native=True)
    assert native._extend_attention is None
    got = native.forward(0, q, k, v)
    want = PagedAttention(_pool(torch.bfloat16), rows, native=False).forward(0, q, k, v)
    assert torch.equal(got[:40], want[:40]) and (got[40:].float() - want[40:].float()).abs().max().item() <= 1e-2


def test_native_extend_attention_gives_the_greedy_tokens_of_gather_and_sdpa(monkeypatch):
    """The packaged model in bfloat16 on the native path: extend rows through ``extend_attention``
    (NATIVE_EXTEND_ATTENTION) or through gather + SDPA give the same greedy tokens, or diverge at a
    near-tie, for prompts alone, one that reuses another's long cached prefix (an extend row after
    ~500 cached tokens) and a batch of them; with the switch on, no extend row reaches gather +
    SDPA.

    NOTE: near-tie here means within BF16_TIE of each other: the two attentions round differently
    (as any two orders of float32 sums do), and a bfloat16 model's logits (0.125 apart at 16-32)
    then move by a few tenths: against the float32 model's first-token logprobs on six prompts
    (2026-12-07), gather + SDPA was 0.08-0.27 off, extend_attention 0.09-0.25; the haiku prompt's
    top two tokens are 0.21 apart in float32 and come out in either order."""
    from sgrt.kernels import layer_ops
    from sgrt.models import load_model

    if not layer_ops.extend_attention_available():
        pytest.skip("extend_attention needs a CPU with AVX-512 BF16")
    model = load_model("smollm2-135m-instruct", dtype="bfloat16", device="cpu")
    assert model.model.native_ops
    gathered = []
    real = PagedAttention._attend_gathered
    monkeypatch.setattr(PagedAttention, "_attend_gathered",
                        staticmethod(lambda g, *a: gathered.append(g.q_len) or real(g, *a)))
    shared = "You are a careful assistant who answers in one short sentence. " * 40
    prompts = ["Write a haiku about the sea.", shared + "Question: which planet is the largest?",
               shared + "Question: name a colour that starts with the letter G."]
    params = SamplingParams(max_tokens=16, return_logprob=True, top_logprobs_num=5)
    results = {}
    for native_extend in (False, True):
        monkeypatch.setattr(attention_mod, "NATIVE_EXTEND_ATTENTION", native_extend)
        gathered.clear()
        eng = Engine(model=model, max_total_tokens=8192)
        try:
            alone = [eng.generate(p, params) for p in prompts]
            assert alone[2].cached_tokens >= 400  # the shared prefix came from the cache
            eng.flush_cache()
            batched = eng.generate_batch(prompts[::-1], params)[::-1]
        finally:
            eng.shutdown()
        assert any(q > 1 for q in gathered) != native_extend
        results[native_extend] = alone + batched
    for a, b in zip(results[False], results[True]):
        assert_same_greedy(a, b, tol=BF16_TIE)
