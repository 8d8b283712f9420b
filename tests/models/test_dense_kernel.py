"""The native dense float32 / bfloat16 GEMV kernel (sgrt/kernels/dense.py, dense_avx2.cpp) and
DenseLinear (sgrt/models/packed.py): results against a float64 reference, odd shapes, row and
thread independence, argument errors, the loader's choice, and a bfloat16 model's greedy output.

Error bound (``_check``), per output ``y[m, n]`` against the exact float64 ``ref`` over the same
(float32 or bfloat16) values, with ``A = |x| @ |W|.T`` (the magnitudes that are rounded):

    float32:   |y - ref| <= (ceil(K / 16) + 5) * 2**-24 * A
    bfloat16:  |y - ref| <= 2**-8 * |ref| + (1 + 2**-8) * (ceil(K / 16) + 5) * 2**-24 * A

Each fp32 accumulator takes ``ceil(K / 16)`` FMA roundings (one per 16-input step), adding the
two accumulators one more, the 8-lane horizontal sum three (standard ``gamma_n ~ n u`` bound,
unit roundoff 2**-24); bfloat16 then rounds that float32 value once to nearest (half an ulp,
2**-8 relative). The smallest faults this must catch (a weight row from the wrong place, a lost
tail input, a misplaced odd/even input of a bfloat16 pair) change a result by far more:
:func:`test_bound_rejects_wrong_results` checks that such faults fail it.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sgrt.errors import InvalidRequest
from sgrt.kernels import dense

if not dense.available():
    pytest.skip("the dense kernel is unavailable here (needs an AVX2 + FMA CPU and a C++ compiler; "
                "SGRT_NATIVE_KERNELS=0 disables it)", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (5, 16), (17, 17), (33, 50), (960, 576), (576, 1536)]
ROWS = [0, 1, 2, 3, 16, 17]


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _violations(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elements of ``y`` outside the module docstring's bound (a boolean mask)."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    a = xd.abs() @ wd.abs().T
    acc = (math.ceil(w.shape[1] / 16) + 5) * 2.0 ** -24 * a
    bound = acc if y.dtype == torch.float32 else 2.0 ** -8 * ref.abs() + (1 + 2.0 ** -8) * acc
    return (y.double() - ref).abs() > bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_within_bound(dtype, n, k):
    w = _rand(n, k, dtype=dtype, seed=n * 1000 + k)
    for m in ROWS:
        x = _rand(m, k, dtype=dtype, seed=m)
        y = dense.linear(x, w)
        assert y.shape == (m, n) and y.dtype == dtype
        if m == 0:
            continue
        assert not _violations(y, x, w).any(), (dtype, n, k, m)
        # and close to F.linear itself (same values, another order of float32 sums)
        want = F.linear(x.float(), w.float())
        rel = ((y.float() - want).norm() / want.norm()).item()
        assert rel <= (1e-6 if dtype == torch.float32 else 4e-3), (dtype, n, k, m, rel)


def test_bfloat16_is_the_rounded_float32_sum():
    """bfloat16 output = the float32 sum rounded once to nearest even: nearly every element equals
    the exact result rounded to bfloat16 (the rest are one step off, where float32 summation
    moved the value across a rounding boundary)."""
    w = _rand(960, 576, dtype=torch.bfloat16, seed=1)
    x = _rand(4, 576, dtype=torch.bfloat16, seed=2)
    y = dense.linear(x, w)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)
    same = (y == exact).float().mean().item()
    assert same >= 0.99, same
    steps = (y.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    assert steps.max().item() <= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_rejects_wrong_results(dtype):
    """The bound is tight enough to catch the kernel's plausible faults."""
    n, k = 64, 50
    w = _rand(n, k, dtype=dtype, seed=3)
    x = _rand(2, k, dtype=dtype, seed=4)
    y = dense.linear(x, w)
    assert not _violations(y, x, w).any()
    faults = {
        "row from the wrong place": torch.roll(w, 1, 0),
        "lost tail input": torch.cat([w[:, :-1], torch.zeros(n, 1, dtype=dtype)], 1),
        "even/odd inputs swapped": w.reshape(n, k // 2, 2).flip(-1).reshape(n, k),
    }
    for name, wrong in faults.items():
        assert _violations(F.linear(x.float(), wrong.float()).to(dtype), x, w).any(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_and_threads_independent_bitwise(dtype):
    """A row's result is the same alone or in a batch of 16, with 1 thread or 2."""
    w = _rand(3072, 576, dtype=dtype, seed=5)
    x = _rand(16, 576, dtype=dtype, seed=6)
    batch = dense.linear(x, w)
    for i in (0, 7, 15):
        assert torch.equal(dense.linear(x[i:i + 1], w), batch[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = dense.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batch)


def _kernel_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic for every output, replayed with torch's float32 operations: K padded
    with zeros to 16-input steps; two accumulators of 8 lanes (float32: inputs 0-7 and 8-15 of a
    step; bfloat16: the even and the odd inputs), one FMA each a step; then acc0 + acc1, lanes
    i + (i + 4), (0 + 1) + (2 + 3); one rounding to the dtype. An FMA is replayed in float64
    (a float32 product is exact there) and rounded to float32, which can differ from one fused
    rounding only at a double-rounding tie (~2**-29 a step; none with these fixed inputs)."""
    m, k = x.shape
    n = w.shape[0]
    kp = -(-k // 16) * 16
    xp = torch.zeros(m, kp, dtype=torch.float64)
    wp = torch.zeros(n, kp, dtype=torch.float64)
    xp[:, :k], wp[:, :k] = x.double(), w.double()
    xs, ws = xp.view(m, kp // 16, 16), wp.view(n, kp // 16, 16)
    halves = ((slice(0, 8), slice(8, 16)) if x.dtype == torch.float32
              else (slice(0, 16, 2), slice(1, 16, 2)))
    accs = []
    for half in halves:
        acc = torch.zeros(m, n, 8, dtype=torch.float32)
        for step in range(kp // 16):
            prod = xs[:, None, step, half] * ws[None, :, step, half]  # exact
            acc = (acc.double() + prod).float()
        accs.append(acc)
    v = accs[0] + accs[1]
    s = v[..., :4] + v[..., 4:]
    return ((s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])).to(x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_output_in_the_documented_order_bitwise(dtype):
    """Every output equals the docstring's order of float32 operations bit for bit, whatever
    the group of weight rows it falls in: N from 1 to past two threads' grains (each thread's
    range cut into 4 streams, 0-3 rows left over for a last group), K with and without a tail,
    1 to 5 rows of x, 1 and 2 threads."""
    threads = torch.get_num_threads()
    # K = 576: a thread's share is at least 65536 / (576 * itemsize) rows (28 float32, 56
    # bfloat16), so N = 61 and 123 are split between 2 threads
    cases = [(n, 40) for n in (1, 2, 3, 4, 5, 7, 8, 9, 13)] + [(61, 576), (123, 576), (66, 23)]
    try:
        for n, k in cases:
            w = _rand(n, k, dtype=dtype, seed=100 + n)
            for m in (1, 2, 5):
                x = _rand(m, k, dtype=dtype, seed=200 + m)
                want = _bits(_kernel_order(x, w))
                for t in (1, 2):
                    torch.set_num_threads(t)
                    got = dense.linear(x, w)
                    assert torch.equal(_bits(got), want), (dtype, n, k, m, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_handled(dtype):
    """x may have any row stride (a slice of a wider tensor): same result as its contiguous copy."""
    w = _rand(40, 24, dtype=dtype, seed=7)
    wide = _rand(5, 40, dtype=dtype, seed=8)
    x = wide[:, 8:32]
    assert not x.is_contiguous()
    assert torch.equal(dense.linear(x, w), dense.linear(x.contiguous(), w))


def test_errors_are_typed():
    w = _rand(8, 16, dtype=torch.float32, seed=9)
    x = _rand(2, 16, dtype=torch.float32, seed=10)
    cases = [
        ((x.bfloat16(), w), "x", "x must have weight's dtype torch.float32"),
        ((x.half(), w.half()), "x", "x must be float32 or bfloat16"),
        ((x[0], w), "x", "x must be a 2-D tensor"),
        ((x[:, :8], w), "x", r"x must be \[M, K=16\]"),
        ((_rand(16, 2, dtype=torch.float32, seed=11).T, w), "x", "x's rows must be contiguous"),
        ((x, w.T.contiguous().T), "weight", "weight must be contiguous"),
        ((torch.zeros(2, 0), torch.zeros(8, 0)), "weight", "N, K >= 1"),
    ]
    for args, field, message in cases:
        with pytest.raises(InvalidRequest, match=message) as info:
            dense.linear(*args)
        assert info.value.field == field
    # the raw operator checks too (a RuntimeError naming the limit), so no bad call reaches the loops
    with pytest.raises(RuntimeError, match="x's rows must be contiguous"):
        dense.kernel()(_rand(16, 2, dtype=torch.float32, seed=11).T, w)
    with pytest.raises(RuntimeError, match="x must have the weight's dtype"):
        dense.kernel()(x.bfloat16(), w)


def _within_one_bf16_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """got (bfloat16) is the exact x @ w.T rounded once to bfloat16, up to float32 summation
    error: within half a bfloat16 step (at most 2**-8 relative) plus 2**-20 of sum |x| |w|."""
    want = F.linear(x.double(), w.double())
    mag = F.linear(x.double().abs(), w.double().abs())
    return bool(((got.double() - want).abs() <= want.abs() * 2.0**-8 + mag * 2.0**-20).all())


def test_dense_linear_module_falls_back_past_max_rows():
    from sgrt.models.packed import DENSE_MAX_ROWS, DenseLinear

    w = _rand(48, 32, dtype=torch.bfloat16, seed=12)
    layer = DenseLinear(w)
    x = _rand(DENSE_MAX_ROWS + 1, 32, dtype=torch.bfloat16, seed=13)
    # past max_rows, bfloat16: a float32 matmul on the widened weight, rounded once to bfloat16
    assert _within_one_bf16_rounding(layer(x), x, w)
    assert torch.equal(layer(x), F.linear(x.float(), w.float()).bfloat16())
    # float32 past max_rows: F.linear itself
    w32, x32 = w.float(), x.float()
    assert torch.equal(DenseLinear(w32)(x32), F.linear(x32, w32))
    assert torch.equal(layer(x[:DENSE_MAX_ROWS]), dense.linear(x[:DENSE_MAX_ROWS], w))
    with pytest.raises(RuntimeError, match="dtype"):  # another dtype: F.linear's own error, as nn.Linear
        layer(x[:1].float())
    assert layer(x.reshape(1, DENSE_MAX_ROWS + 1, 32)).shape == (1, DENSE_MAX_ROWS + 1, 48)


def test_disabled_by_environment(monkeypatch):
    """SGRT_NATIVE_KERNELS=0: the kernel is off and the loader keeps torch's layers."""
    from sgrt.models.packed import dense_kernel_for

    monkeypatch.setenv("SGRT_NATIVE_KERNELS", "0")
    assert not dense.available()
    assert not dense_kernel_for(torch.zeros(16, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="unavailable"):
        dense.linear(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(16, 16, dtype=torch.bfloat16))
    monkeypatch.delenv("SGRT_NATIVE_KERNELS")
    assert dense.available()


# ---- the default model in bfloat16 -------------------------------------------------------------

# A divergence at a near-tie is allowed (DESIGN.md's rule): in bfloat16 the logits themselves are
# rounded to 8 significant bits, one step is 0.125 at the default model's top logits (16..32), so
# the two tokens' log-probabilities must be within that step.
BF16_NEAR_TIE = 0.125


@pytest.fixture(scope="module")
def bf16_pair():
    from sgrt.models import load_model

    return (load_model("smollm2-135m-instruct", dtype="bfloat16"),
            load_model("smollm2-135m-instruct", dtype="bfloat16", prepack=False))


def test_loader_puts_the_kernel_on_bfloat16_layers(bf16_pair):
    """bfloat16 projections and the tied LM head run the kernel for decode rows on every CPU where
    it loads; where oneDNN prepacks bfloat16 each also holds a prepacked copy for more than
    DENSE_ROWS_BESIDE_ONEDNN rows (oneDNN's matmul is the faster one there from ~4 rows)."""
    from sgrt.models.packed import (DENSE_MAX_ROWS, DENSE_ROWS_BESIDE_ONEDNN, DenseLinear, PackedLinear,
                                    _onednn_packs)

    lm, _ = bf16_pair
    model = lm.model
    beside = _onednn_packs(model.embed_tokens.weight)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        layers = [getattr(l, name) for l in model.layers]
        assert all(isinstance(m, DenseLinear) for m in layers), name
        assert all(isinstance(m.above, PackedLinear) == beside for m in layers), name
        assert {m.max_rows for m in layers} == {DENSE_ROWS_BESIDE_ONEDNN if beside else DENSE_MAX_ROWS}
    # the tied LM head reads the embedding table itself (no plain copy)
    assert isinstance(model.logits_head, DenseLinear)
    assert model.logits_head.weight is model.embed_tokens.weight
    # every row count goes to the layer: past its kernel's rows the prepacked copy or
    # linear_bf16_via_f32 (not F.linear)
    assert model.logits_head_max_rows > 1 << 40
    # the one-call decode step is built over the kernel's rows
    assert model.native_step is not None and model.native_step.max_rows == layers[0].max_rows


def test_rows_above_the_kernel_go_to_the_prepacked_copy():
    """A DenseLinear beside a prepacked copy: up to max_rows rows are the kernel's bits, more rows
    the copy's (oneDNN's) bits; both near F.linear in float32."""
    from sgrt.models.packed import DenseLinear, PackedLinear, _onednn_packs

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    if not _onednn_packs(w):
        pytest.skip("oneDNN does not prepack bfloat16 on this CPU")
    packed = PackedLinear(w)
    layer = DenseLinear(w, 4, packed)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(layer(x[:4]), dense.linear(x[:4], w))
    assert torch.equal(layer(x), packed(x))
    want = F.linear(x.float(), w.float())
    assert ((layer(x).float() - want).abs().max() <= 2 ** -7 * want.abs().max())


def test_float32_model_uses_the_kernel(loaded_model):
    """The session's float32 model: projections and the tied LM head on the kernel, the head
    reading the embedding table itself (its float32 outputs are checked against transformers
    by tests/models/test_llama_matches_hf.py and the engine tests)."""
    from sgrt.models.packed import DENSE_DTYPES_OVER_ONEDNN, DenseLinear

    if torch.float32 not in DENSE_DTYPES_OVER_ONEDNN:
        pytest.skip("float32 keeps oneDNN here")
    model = loaded_model.model
    assert all(isinstance(l.gate_up_proj, DenseLinear) for l in model.layers)
    assert model.logits_head.weight is model.embed_tokens.weight


def test_bfloat16_greedy_within_near_tie(bf16_pair):
    """Greedy outputs through the kernel equal torch's plain bfloat16 layers', or diverge only at
    a near-tie (see ``BF16_NEAR_TIE``)."""
    from sgrt.engine import Engine
    from sgrt.engine.sampling_params import SamplingParams

    results = []
    for lm in bf16_pair:
        eng = Engine(model=lm, max_total_tokens=2048)
        try:
            prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": t}])
                       for t in ("What is the capital of France?", "Name three prime numbers.")]
            params = SamplingParams(max_tokens=20, return_logprob=True, top_logprobs_num=5)
            results.append(eng.generate_batch(prompts, params))
        finally:
            eng.shutdown()
    for a, b in zip(*results):
        if a.token_ids == b.token_ids:
            continue
        n = min(len(a.token_ids), len(b.token_ids))
        i = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
        assert i < n, f"one output is a prefix of the other: {a.text!r} vs {b.text!r}"
        tops = dict(b.output_top_logprobs[i])
        assert a.token_ids[i] in tops, f"diverged at {i}: not in the reference's top logprobs"
        assert abs(tops[a.token_ids[i]] - tops[b.token_ids[i]]) <= BF16_NEAR_TIE, f"diverged at {i} without a near-tie"


def test_bf16_via_f32_tiles_match_one_piece(monkeypatch):
    """Past max_rows a bfloat16 weight larger than a tile (an LM head) is widened tile by tile
    (N not a multiple of the tile: the last tile is partial); every output is the same one
    rounding of its float32 sum, within the bound of the exact product, for 2-D and 3-D x."""
    from sgrt.models import packed

    w = _rand(100, 64, dtype=torch.bfloat16, seed=14)
    x = _rand(40, 64, dtype=torch.bfloat16, seed=15)
    whole = packed.linear_bf16_via_f32(x, w)
    monkeypatch.setattr(packed, "F32_TILE_ELEMENTS", 16 * 64)  # 16-row tiles: 7 of them
    tiled = packed.linear_bf16_via_f32(x, w)
    assert tiled.dtype == torch.bfloat16 and tiled.shape == (40, 100)
    assert _within_one_bf16_rounding(tiled, x, w) and _within_one_bf16_rounding(whole, x, w)
    # a float32 sum differs between the tilings at most by summation order: one bfloat16 step
    assert ((tiled.float() - whole.float()).abs() <= whole.float().abs() * 2.0**-7 + 1e-6).all()
    assert torch.equal(packed.linear_bf16_via_f32(x.reshape(2, 20, 64), w), tiled.reshape(2, 20, 100))


def test_bandwidth_bytes_leave_out_the_prepacked_copies(bf16_pair):
    """bench/vs_llamacpp.py's bytes a batch-1 step reads: the same for the loaded bfloat16 model
    (kernel layers, beside prepacked copies where oneDNN packs bfloat16) as for its plain-layer
    twin (every parameter once, the tied head being the embedding table): the copies serve larger
    batches only. 134.5M bfloat16 parameters: ~269 MB."""
    from bench.vs_llamacpp import bytes_per_token

    packed_lm, plain_lm = bf16_pair
    assert bytes_per_token(packed_lm, 0) == bytes_per_token(plain_lm, 0)
    assert 265e6 < bytes_per_token(plain_lm, 0) < 275e6


def test_the_prepacked_copy_follows_the_weight():
    """A weight changed in place after load (load_state_dict, a merged delta) reaches the copy
    above the kernel's rows too: 4 and 5 rows compute with the same, new weight."""
    from sgrt.models.packed import DenseLinear, PackedLinear, _onednn_packs

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    if not _onednn_packs(w):
        pytest.skip("oneDNN does not prepack bfloat16 on this CPU")
    layer = DenseLinear(w.clone(), 4, PackedLinear(w))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        layer.weight.mul_(0.5)
    want = F.linear(x.float(), layer.weight.float())
    for rows in (4, 5):
        got = layer(x[:rows]).float()
        assert (got - want[:rows]).abs().max() <= 2 ** -7 * want.abs().max(), rows
    with torch.no_grad():
        layer.load_state_dict({"weight": w, "above.packed": layer.above.packed}, strict=True)
    assert torch.equal(layer(x), PackedLinear(w)(x))
