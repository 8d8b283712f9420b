"""The fused CPU layer operators (sgrt/kernels/layer_ops_cpu/) against the PyTorch code they
replace: same values (bit-identical or within float32 rounding of sums), errors that name the
argument, and the default model giving the same logits and greedy text with and without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgrt.engine.attention import decode_attention
from sgrt.kernels import layer_ops
from sgrt.models.llama import LayerOps, NativeLayerOps, RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="sgrt_layer operators could not be built here")

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """bfloat16: at most one bfloat16 step apart, and 99% of values identical (a float32 sum in a
    different order can move a value across a rounding boundary); float32: a few ulps."""
    if dtype == torch.bfloat16:
        diff = (got.float() - ref.float()).abs()
        step = ref.float().abs().clamp_min(1e-30) * 2.0 ** -7
        assert bool((diff <= step).all()), float((diff / step).max())
        assert (got == ref).float().mean().item() >= 0.99
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _norm(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], 1e-5)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_eager(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(5, 576, generator=g).to(dtype)
    norm = _norm((torch.rand(576, generator=g) + 0.5).to(dtype))
    _close(NativeLayerOps().add_norm(x, None, norm)[1], LayerOps().add_norm(x, None, norm)[1], dtype)
    ref_x, ref_h = LayerOps().add_norm(x, delta, norm)
    x_native = x.clone()
    out_x, out_h = NativeLayerOps().add_norm(x_native, delta, norm)
    assert out_x is x_native and torch.equal(x_native, ref_x)  # the residual add is in place and exact
    _close(out_h, ref_h, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_eager_and_leaves_v(dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 960, generator=g).to(dtype)
    pos = torch.tensor([0, 5, 77, 2047])
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref = apply_rotary(qkv[:, :768].view(4, 12, 64), cos, sin)
    work = qkv.clone()
    out = NativeLayerOps().rotary(work[:, :768].view(4, 12, 64), cos, sin)
    assert out.data_ptr() == work.data_ptr()
    assert torch.equal(out, ref)  # elementwise: same roundings, bit-identical
    assert torch.equal(work[:, 768:], qkv[:, 768:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager(dtype):
    gate_up = (torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp range ends
    _close(NativeLayerOps().silu_mul(gate_up), LayerOps().silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_eager(dtype):
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(5, 2 * 2048, generator=g) * 3).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -5.5, 1e-4]).to(dtype)  # tails, zero, tiny
    got, ref = NativeLayerOps().gelu_mul(gate_up), LayerOps().gelu_mul(gate_up)
    # tanh through exp is off by a few ulps of tanh, i.e. of 1 where 1 + tanh(u) cancels (g < -2),
    # as float32's own tanh can be there: within |g * up| * 2**-20 absolute, plus a step of the dtype
    # (bfloat16: rounding the gelu and the product; float32: a few ulps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    rel = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    bound = ref.float().abs() * rel + (gate * up).abs() * 2.0 ** -20 + 1e-30
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= bound).all()), float((diff / bound).max())
    assert (got == ref).float().mean().item() >= (0.95 if dtype == torch.bfloat16 else 0.5)  # most bit-identical
    assert got[0, 0] == 0 and got[0, 1] == gate_up[0, 1] * gate_up[0, 2049]  # gelu's tails: 0 and g itself
    gate_up[1, 3] = float("nan")
    assert torch.isnan(torch.ops.sgrt_layer.gelu_tanh_mul(gate_up)[1, 3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 32])  # 64 / 128: AVX-512 paths; 32: portable loops
def test_decode_attention_matches_gather_and_sdpa(dtype, head_dim):
    g = torch.Generator().manual_seed(3)
    slots_n, n_heads, n_kv = 512, 9, 3
    k_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 200, 5])
    max_kv = int(lens.max())
    slots = torch.zeros(4, max_kv, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = torch.randperm(slots_n, generator=g)[:n]
    q = torch.randn(4, n_heads, head_dim, generator=g).to(dtype)
    mask = (torch.arange(max_kv).view(1, -1) < lens.view(-1, 1)).view(4, 1, 1, max_kv)
    keys = k_cache.index_select(0, slots.view(-1)).view(4, max_kv, n_kv, head_dim)
    values = v_cache.index_select(0, slots.view(-1)).view(4, max_kv, n_kv, head_dim)
    ref = decode_attention(q, keys, values, mask)
    got = torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, lens)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    # one row alone gives the same bits as in the batch (no cross-row state)
    alone = torch.ops.sgrt_layer.decode_attention(q[2:3], k_cache, v_cache, slots[2:3], lens[2:3])
    assert torch.equal(alone, got[2:3])


def _ragged_case(dtype, lens, n_heads, n_kv, head_dim, seed, slots_n=3000):
    """A pool layer, random slots per row (ragged), queries, and the plain PyTorch attention
    (gather + SDPA with a padding mask) the native operator must agree with: computed in float32
    from the same (possibly bfloat16) numbers, rounded to their dtype at the end as the operator
    rounds (SDPA in bfloat16 rounds its probabilities to bfloat16 too, a coarser reference)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lens)
    b, max_kv = len(lens), int(lens.max())
    slots = torch.zeros(b, max_kv, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = torch.randperm(slots_n, generator=g)[:n]
    # scores spread enough that a chunk's max differs from the row's (the merge's weights matter)
    q = (torch.randn(b, n_heads, head_dim, generator=g) * 2).to(dtype)
    mask = (torch.arange(max_kv).view(1, -1) < lens.view(-1, 1)).view(b, 1, 1, max_kv)
    keys = k_cache.index_select(0, slots.view(-1)).view(b, max_kv, n_kv, head_dim)
    values = v_cache.index_select(0, slots.view(-1)).view(b, max_kv, n_kv, head_dim)
    ref = decode_attention(q.float(), keys.float(), values.float(), mask).to(dtype)
    return (q, k_cache, v_cache, slots, lens), ref


# Lengths around the 256-key chunks of the split (flash-decoding) path, in one ragged batch.
CHUNK_EDGE_LENS = [1, 255, 256, 257, 511, 512, 513, 1100]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 1, 256), (8, 2, 32)])
def test_decode_attention_split_into_chunks_matches_sdpa(dtype, n_heads, n_kv, head_dim):
    """Contexts longer than one chunk are attended chunk by chunk and merged by log-sum-exp:
    the same as PyTorch's attention over the whole context (GQA groups of 3, 4 and 4 query
    heads; head_dim 64: the specialised loops, 256 (Gemma 3) and 32: the portable ones)."""
    args, ref = _ragged_case(dtype, CHUNK_EDGE_LENS, n_heads, n_kv, head_dim, seed=head_dim)
    got = torch.ops.sgrt_layer.decode_attention(*args)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    else:  # both round (nearly) the same float32 value to bfloat16: at most one bfloat16 step apart
        diff = (got.float() - ref.float()).abs()
        assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-5).all())
        assert (got == ref).float().mean().item() >= 0.98
    # every row alone gives the same bits as in the ragged batch
    q, k_cache, v_cache, slots, lens = args
    for r in (0, 3, 7):
        alone = torch.ops.sgrt_layer.decode_attention(q[r:r + 1], k_cache, v_cache, slots[r:r + 1], lens[r:r + 1])
        assert torch.equal(alone, got[r:r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(4, 1, 64), (9, 3, 64), (4, 1, 256)])
def test_decode_attention_does_not_depend_on_the_thread_count(dtype, n_heads, n_kv, head_dim):
    """Chunks are fixed in size (not one per thread) and merged in chunk order, and where the
    (row, chunk, kv head) items do not divide evenly among the threads each query head is an item
    of its own (Gemma 3's one kv head, SmolLM2's three, on 2 or 3 threads): 1, 2 and 3 threads
    give the same bits, for one short row, one long row, rows of 2-3 chunks and a ragged batch,
    and match PyTorch's attention."""
    threads = torch.get_num_threads()
    try:
        for lens in ([80], [2000], [513], [300, 3], CHUNK_EDGE_LENS):
            args, ref = _ragged_case(dtype, lens, n_heads, n_kv, head_dim, seed=len(lens))
            out = {}
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                out[n] = torch.ops.sgrt_layer.decode_attention(*args)
            assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3]), lens
            if dtype == torch.float32:
                torch.testing.assert_close(out[2], ref, rtol=1e-5, atol=2e-6)
    finally:
        torch.set_num_threads(threads)


def _float64_attention(q, k_cache, v_cache, slots, lens) -> torch.Tensor:
    """Softmax attention (scale 1/sqrt(head_dim), GQA) in float64 from the same numbers as the
    operator's inputs: [B, H * D] float64."""
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for r in range(b):
        s = slots[r, : int(lens[r])]
        k, v = k_cache[s].double(), v_cache[s].double()  # [n, hkv, d]
        qr = q[r].double().view(hkv, h // hkv, d)
        p = (torch.einsum("kgd,nkd->kgn", qr, k) / d ** 0.5).softmax(-1)
        out[r] = torch.einsum("kgn,nkd->kgd", p, v).reshape(h, d)
    return out.view(b, h * d)


# Long split contexts: many chunks, ragged last chunks, a one-token and a one-chunk row.
LONG_LENS = [3000, 1, 700, 2049, 256]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [
    (9, 3, 64),    # SmolLM2: groups of 3 query heads, head_dim 64
    (4, 1, 256),   # Gemma 3: one group of 4, head_dim 256
    (3, 3, 64),    # g = 1
    (8, 2, 64),    # g = 4
    (6, 2, 48),    # head_dim a multiple of 16, not of 64 (AVX-512: the 16-lane loops, one vector at a time)
    (10, 2, 40),   # g = 5: a group of 4 and one of 1; head_dim not a multiple of 16 (the 8-lane loops)
    (4, 2, 36),    # head_dim not a multiple of 8: the portable loops
])
def test_long_split_contexts_match_float64_attention(dtype, n_heads, n_kv, head_dim):
    """Contexts of up to 3,000 keys (12 chunks, ragged last chunks) against softmax attention in
    float64 from the same numbers: float32 outputs within float32 rounding of sums, bfloat16
    outputs within half a bfloat16 step (one rounding of a float32 value); 1 and 2 threads give
    the same bits."""
    args, _ = _ragged_case(dtype, LONG_LENS, n_heads, n_kv, head_dim, seed=n_heads * head_dim, slots_n=4000)
    ref = _float64_attention(*args)
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = torch.ops.sgrt_layer.decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1], out[2])
    got = out[1].double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=3e-6, atol=1e-6)
    else:
        assert bool(((got - ref).abs() <= ref.abs() * 2.0 ** -8 * 1.001 + 2e-6).all())
        assert (out[1] == ref.to(dtype)).double().mean().item() >= 0.99  # mostly the rounded float64 value


def test_long_split_context_propagates_nan():
    """A NaN key in a later chunk of a long context makes its kv head's outputs NaN (as PyTorch's
    attention does), and only those; a NaN query makes its own head NaN."""
    args, _ = _ragged_case(torch.bfloat16, [2000, 900], 9, 3, 64, seed=5, slots_n=3000)
    q, k_cache, v_cache, slots, lens = args
    k_cache[slots[0, 1500], 2, 7] = float("nan")  # row 0, kv head 2, chunk 5
    q[1, 4, 0] = float("nan")  # row 1, query head 4 (kv head 1)
    out = torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, lens).view(2, 9, 64)
    nan = torch.isnan(out).all(-1)
    expect = torch.zeros(2, 9, dtype=torch.bool)
    expect[0, 6:9] = True
    expect[1, 4] = True
    assert torch.equal(nan, expect) and not torch.isnan(out[~expect]).any()


def test_decode_attention_rejects_a_bad_slot_in_a_later_chunk():
    q, k_cache, v_cache = torch.randn(1, 2, 8), torch.randn(600, 1, 8), torch.randn(600, 1, 8)
    slots = torch.arange(1, 601).view(1, 600) % 600
    slots[0, 530] = 600
    with pytest.raises(RuntimeError, match="slot 600 outside the pool's 600 slots"):
        torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, torch.tensor([600]))
    slots[0, 530] = -3
    with pytest.raises(RuntimeError, match="slot -3 outside the pool's 600 slots"):
        torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, torch.tensor([600]))


def test_decode_attention_reads_a_strided_query():
    qkv = torch.randn(2, 960)
    q = qkv[:, :576].view(2, 9, 64)  # a view into the projection's output, as in the model
    k_cache, v_cache = torch.randn(16, 3, 64), torch.randn(16, 3, 64)
    slots, lens = torch.tensor([[3, 4, 9], [1, 0, 0]]), torch.tensor([3, 1])
    got = torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, lens)
    assert torch.equal(got, torch.ops.sgrt_layer.decode_attention(q.contiguous(), k_cache, v_cache, slots, lens))


def test_store_kv_writes_slots_and_rejects_bad_ones():
    k_cache, v_cache = torch.zeros(10, 3, 64), torch.zeros(10, 3, 64)
    qkv = torch.randn(2, 960)
    k, v = qkv[:, 576:768].view(2, 3, 64), qkv[:, 768:].view(2, 3, 64)
    torch.ops.sgrt_layer.store_kv_(k_cache, v_cache, torch.tensor([7, 2]), k, v)
    ref_k, ref_v = torch.zeros(10, 3, 64), torch.zeros(10, 3, 64)
    ref_k.index_copy_(0, torch.tensor([7, 2]), k)
    ref_v.index_copy_(0, torch.tensor([7, 2]), v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot 10 outside the pool's 10 slots"):
        torch.ops.sgrt_layer.store_kv_(k_cache, v_cache, torch.tensor([1, 10]), k, v)
    assert torch.equal(k_cache, before)  # checked before any write


def test_errors_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        torch.ops.sgrt_layer.rms_norm(x.double(), torch.ones(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[hidden\\]"):
        torch.ops.sgrt_layer.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="kv_lens\\[0\\] = 4 outside 1..3"):
        torch.ops.sgrt_layer.decode_attention(torch.randn(1, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8),
                                              torch.zeros(1, 3, dtype=torch.long), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="slot 9 outside the pool's 4 slots"):
        torch.ops.sgrt_layer.decode_attention(torch.randn(1, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8),
                                              torch.tensor([[0, 9]]), torch.tensor([2]))


def test_default_model_same_logits_and_greedy_text(loaded_model):
    """float32: the native path's logits within float32 rounding of the PyTorch path's, and the
    engine's greedy continuation identical."""
    from sgrt.engine import Engine, SamplingParams

    model = loaded_model.model
    assert model.native_ops  # load_model's default where the operators build
    ids = torch.tensor(loaded_model.tokenizer.encode("The three primary colours are red, yellow and"))
    native = model.forward_simple(ids)
    texts = {}
    prompt = loaded_model.tokenizer.encode("Write one sentence about the sea.")
    try:
        model.use_native_ops(False)
        eager = model.forward_simple(ids)
        for native_on in (False, True):
            model.use_native_ops(native_on)
            engine = Engine(model=loaded_model, max_total_tokens=512)
            try:
                texts[native_on] = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
            finally:
                engine.shutdown()
    finally:
        model.use_native_ops(True)
    torch.testing.assert_close(native, eager, rtol=0, atol=1e-3)
    assert torch.equal(native.argmax(-1), eager.argmax(-1))
    assert texts[True] == texts[False] and len(texts[True]) == 24


def test_nan_propagates_as_in_pytorch():
    """A NaN input gives NaN outputs where PyTorch's ops give NaN, not a finite value."""
    q = torch.randn(2, 9, 64)
    k_cache, v_cache = torch.randn(8, 3, 64), torch.randn(8, 3, 64)
    slots, lens = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])
    q[0, 0, 0] = float("nan")
    out = torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, lens)
    assert torch.isnan(out[0, :64]).all() and not torch.isnan(out[1]).any()
    k_cache[5, 1, 3] = float("nan")  # a key of row 1, kv head 1
    out = torch.ops.sgrt_layer.decode_attention(q, k_cache, v_cache, slots, lens)
    assert torch.isnan(out[1, 3 * 64: 6 * 64]).all() and not torch.isnan(out[1, :3 * 64]).any()
    gate_up = torch.randn(1, 8)
    gate_up[0, 1] = float("nan")
    assert torch.isnan(torch.ops.sgrt_layer.silu_mul(gate_up)[0, 1])


def test_zero_kv_heads_is_an_error_not_a_crash():
    with pytest.raises(RuntimeError, match="kv_heads and head_dim must be positive"):
        torch.ops.sgrt_layer.decode_attention(torch.randn(1, 4, 64), torch.randn(10, 0, 64), torch.randn(10, 0, 64),
                                              torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qkv_rotates_q_and_k_in_place_and_matches_eager(dtype):
    """The native rotary_qkv (rotary_heads_ on the QKV output, then one split) gives the eager
    path's q, k and v bit for bit, as views into the projection's output."""
    g = torch.Generator().manual_seed(4)
    t, n_heads, n_kv, d = 3, 9, 3, 64
    qkv = torch.randn(t, n_heads + 2 * n_kv, d, generator=g).to(dtype)
    emb = torch.outer(torch.tensor([0.0, 9.0, 1500.0]), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref = LayerOps().rotary_qkv(qkv.clone(), cos, sin, n_heads, n_kv)
    work = qkv.clone()
    got = NativeLayerOps().rotary_qkv(work, cos, sin, n_heads, n_kv)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert all(x.data_ptr() >= work.data_ptr() and x._base is work for x in got)  # views, no copies
    assert torch.equal(got[2], qkv[:, n_heads + n_kv:])  # v untouched
    with pytest.raises(RuntimeError, match="heads must be in 0..15, got 16"):
        torch.ops.sgrt_layer.rotary_heads_(work, cos, sin, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_in_place_matches_eager_and_leaves_v(dtype):
    """The native qk_norm (qk_norm_, in place on the QKV output) gives the eager per-head RMSNorm
    of q and k (RMSNorm.forward's ops and a cat) within a sum order's rounding, each head equal to
    rms_norm of that head as a row bit for bit, and v untouched; over a decode row and a prefill
    of 70 rows (past the operator's thread grain)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(5)
    n_heads, n_kv, d = 4, 1, 256
    layer = SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv, head_dim=d,
                            q_norm=_norm((torch.rand(d, generator=g) + 0.5).to(dtype)),
                            k_norm=_norm((torch.rand(d, generator=g) + 0.5).to(dtype)))
    layer._modules = {"q_norm": layer.q_norm, "k_norm": layer.k_norm}
    for t in (1, 70):
        qkv = (torch.randn(t, (n_heads + 2 * n_kv) * d, generator=g) * 4).to(dtype)
        ref = LayerOps().qk_norm(layer, qkv.clone())
        work = qkv.clone()
        got = NativeLayerOps().qk_norm(layer, work)
        assert got.shape == (t, n_heads + 2 * n_kv, d) and got.data_ptr() == work.data_ptr()  # in place
        _close(got, ref, dtype)
        heads = qkv.view(t, -1, d)
        for h, norm in ((0, layer.q_norm), (n_heads - 1, layer.q_norm), (n_heads, layer.k_norm)):
            assert torch.equal(got[:, h], torch.ops.sgrt_layer.rms_norm(heads[:, h].contiguous(), norm.weight, 1e-5))
        assert torch.equal(got[:, n_heads + n_kv:], heads[:, n_heads + n_kv:])  # v untouched
    with pytest.raises(RuntimeError, match="qkv's 6 heads must be n_heads=5 plus twice the kv heads"):
        torch.ops.sgrt_layer.qk_norm_(work, layer.q_norm.weight, layer.k_norm.weight, 5, 1e-5)
    with pytest.raises(RuntimeError, match="q_weight and k_weight must be contiguous"):
        torch.ops.sgrt_layer.qk_norm_(work, layer.q_norm.weight[:128], layer.k_norm.weight, n_heads, 1e-5)


def _two_row_decode_case(dtype: torch.dtype, n_heads: int, n_kv: int, d: int, seed: int):
    """Two decode rows (contexts of 40 and 700 slots), their fused q / k / v ``[2, n_heads + 2 n_kv,
    d]`` and the rotary cos / sin at positions 39 and 699."""
    from sgrt.engine.attention import RowSpec

    g = torch.Generator().manual_seed(seed)
    rows = [RowSpec(list(range(1, 41)), 1), RowSpec(list(range(100, 800)), 1)]
    qkv = torch.randn(2, n_heads + 2 * n_kv, d, generator=g).to(dtype)
    emb = torch.outer(torch.tensor([39.0, 699.0]), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    emb = torch.cat((emb, emb), dim=-1)
    return rows, qkv, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_scale,window", [(1.0, None), (0.7, None), (1.0, 5), (0.7, 300)])
def test_fused_decode_attention_equals_the_unfused_steps(dtype, q_scale, window):
    """NativeLayerOps.attention on a decode-only forward (one decode_attention_qkv_ call) writes
    the same K/V into the pool and returns the same output, bit for bit, as rotary_heads_, the
    q pre-scale, store_kv_ and decode_attention called one by one; rows of 40 and 700 tokens
    (the latter split into chunks), with and without a sliding window."""
    from types import SimpleNamespace

    from sgrt.engine.attention import PagedAttention
    from sgrt.engine.kv_pool import KVPool

    n_heads, n_kv, d = 9, 3, 64
    rows, qkv, cos, sin = _two_row_decode_case(dtype, n_heads, n_kv, d, seed=7)
    layer = SimpleNamespace(layer_id=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, q_scale=q_scale, window=window)
    out, pools = {}, {}
    for fused in (True, False):
        pool = KVPool(1000, 2, n_kv, d, dtype, "cpu")
        pool.k.copy_(torch.randn(pool.k.shape, generator=torch.Generator().manual_seed(1)))
        pool.v.copy_(torch.randn(pool.v.shape, generator=torch.Generator().manual_seed(2)))
        attn = PagedAttention(pool, rows, cascade=False, native=True)
        assert attn.native_decode(1, window) is not None
        ops = NativeLayerOps()
        work = qkv.clone().view(2, -1) if fused else qkv.clone()  # (the layer passes the 2-D projection output)
        out[fused] = ops.attention(layer, work, cos, sin, attn) if fused else \
            LayerOps.attention(ops, layer, work, cos, sin, attn)
        pools[fused] = pool
    assert torch.equal(out[True], out[False])
    assert torch.equal(pools[True].k, pools[False].k) and torch.equal(pools[True].v, pools[False].v)
    assert not torch.equal(pools[True].k[1, 40], torch.zeros_like(pools[True].k[1, 40]))


def test_fused_decode_attention_rejects_a_wrong_head_count():
    k_cache = torch.zeros(8, 3, 64)
    with pytest.raises(RuntimeError, match="qkv must have n_heads \\+ 2 \\* kv_heads = 15 heads, got 14"):
        torch.ops.sgrt_layer.decode_attention_qkv_(
            torch.randn(1, 14, 64), torch.ones(1, 64), torch.zeros(1, 64), 9, 1.0, k_cache, k_cache.clone(),
            torch.tensor([1]), torch.tensor([[1]]), torch.tensor([1]))


def test_decode_attention_qkv_checks_its_tables_before_writing_the_caches():
    """A bad table (kv_lens outside the slot table, a slot table of the wrong batch, heads that
    are not a multiple of the kv heads) raises before the K/V store: the caches keep their bits
    (found by a review helper: the new K/V were stored first)."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(16, 3, 64, generator=g), torch.randn(16, 3, 64, generator=g)
    cos, sin = torch.ones(2, 64), torch.zeros(2, 64)
    slots, lens = torch.tensor([[3, 4, 9], [1, 0, 0]]), torch.tensor([3, 1])
    before = (k_cache.clone(), v_cache.clone())
    cases = [
        (9, slots, torch.tensor([3, 4]), "kv_lens\\[1\\] = 4 outside 1..3"),
        (9, slots[:1], lens, "slots must be contiguous int64 \\[B, max_kv\\]"),
        (8, slots, lens, "heads must be a multiple of kv_heads"),
    ]
    for n_heads, sl, ln, message in cases:
        qkv = torch.randn(2, (n_heads + 6) * 64, generator=g)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.sgrt_layer.decode_attention_qkv_(qkv, cos, sin, n_heads, 1.0, k_cache, v_cache,
                                                       torch.tensor([5, 6]), sl, ln)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), message


# ---- an int8 KV pool (sgrt/engine/kv_pool.py: codes and a float32 scale per slot and kv head) ----

def _at_thread_counts(call):
    """``call()``'s result at 1, 2 and 3 torch threads, ``{n: result}`` (the count restored after)."""
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out[n] = call()
        return out
    finally:
        torch.set_num_threads(threads)


def _int8_case(dtype, lens, n_heads, n_kv, head_dim, seed, slots_n=3000):
    """_ragged_case's rows over an int8 pool (its K/V quantized by kv_pool.quantize_int8), and the
    attention over the dequantized K/V (code * scale, in float32) in PyTorch, rounded to dtype."""
    from sgrt.engine.kv_pool import dequantize_int8, quantize_int8

    (q, k_cache, v_cache, slots, lens), _ = _ragged_case(dtype, lens, n_heads, n_kv, head_dim, seed, slots_n)
    (kc, ks), (vc, vs) = quantize_int8(k_cache), quantize_int8(v_cache)
    b, max_kv = slots.shape
    mask = (torch.arange(max_kv).view(1, -1) < lens.view(-1, 1)).view(b, 1, 1, max_kv)
    keys = dequantize_int8(kc, ks, torch.float32).index_select(0, slots.view(-1)).view(b, max_kv, n_kv, head_dim)
    values = dequantize_int8(vc, vs, torch.float32).index_select(0, slots.view(-1)).view(b, max_kv, n_kv, head_dim)
    ref = decode_attention(q.float(), keys, values, mask).to(dtype)
    return (q, kc, vc, slots, lens, ks, vs), ref


def _integer_int8_path(head_dim: int) -> bool:
    """Whether decode attention over an int8 pool runs its integer dot products here (a CPU with
    AVX-512 VNNI, which the library's -march=native build then uses, and head_dim a multiple of 64)."""
    from sgrt.kernels.build import cpu_flags

    return head_dim % 64 == 0 and all(f in cpu_flags() for f in ("avx512f", "avx512bw", "avx512_vnni"))


def _quantized_query(q: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] as the integer path reads it, float64: scaled by 1/sqrt(D) in float32, then
    per head x ~ dx * (254 q1 + q2) (t = x * 127 / max|x|, q1 = round(t), q2 = round((t - q1) * 254),
    dx = max|x| / 32258), and scaled back by sqrt(D) (so the reference's own 1/sqrt(D) undoes it)."""
    d = q.shape[-1]
    x = q.float() * torch.tensor(1.0 / d ** 0.5, dtype=torch.float32)
    a = x.abs().amax(-1, keepdim=True)
    t = x * (127.0 / a)
    q1 = torch.round(t)
    q2 = torch.round((t - q1) * 254.0)
    return (254.0 * q1.double() + q2.double()) * (a.double() / (127.0 * 254.0)) * d ** 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 1, 256), (8, 2, 128), (8, 2, 32), (4, 2, 24)])
def test_int8_decode_attention_matches_the_dequantized_reference(dtype, n_heads, n_kv, head_dim):
    """The native kernel on int8 codes against attention over code * scale; rows of one chunk and
    of several (the split loops), head_dim 64 / 128 / 256 (AVX-512 lanes), 32 (8 lanes), 24 (portable
    loops); 1, 2 and 3 threads give the same bits. Float loops (codes widened in registers, scores
    times K scales, weights times V scales): float32 within a few ulps of PyTorch's attention over
    the dequantized K/V, bfloat16 at most one bfloat16 step apart. Integer loops (AVX-512 VNNI,
    head_dim a multiple of 64): against a float64 reference over the query quantized as the kernel
    quantizes it (scores exact up to float32 rounding), float32 within 2^-13 of the largest value
    (the weights' 16-bit step), bfloat16 at most one bfloat16 step apart."""
    from sgrt.engine.kv_pool import dequantize_int8

    args, ref = _int8_case(dtype, CHUNK_EDGE_LENS, n_heads, n_kv, head_dim, seed=head_dim + 1)
    out = _at_thread_counts(lambda: torch.ops.sgrt_layer.decode_attention(*args))
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])
    got = out[2]
    q, kc, vc, slots, lens, ks, vs = args
    if _integer_int8_path(head_dim):
        keys, values = dequantize_int8(kc, ks, torch.float64), dequantize_int8(vc, vs, torch.float64)
        exact = _float64_attention(_quantized_query(q), keys, values, slots, lens)
        bound = 2.0 ** -13 * float(values.abs().max())
        if dtype == torch.float32:
            assert float((got.double() - exact).abs().max()) <= bound
        else:
            assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + bound).all())
        # and within the int8 cache's own error of the unquantized query's attention
        assert float((got.double() - ref.double()).abs().max()) <= 2.0 ** -7 * float(values.abs().max())
    elif dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    else:
        diff = (got.float() - ref.float()).abs()
        assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-5).all())
        assert (got == ref).float().mean().item() >= 0.98
    # wrong scales are seen: the same codes with V scales halved, or K scales doubled, give another output
    assert not torch.allclose(torch.ops.sgrt_layer.decode_attention(q, kc, vc, slots, lens, ks, vs * 0.5).float(),
                              ref.float(), atol=1e-3)
    assert not torch.allclose(torch.ops.sgrt_layer.decode_attention(q, kc, vc, slots, lens, ks * 2, vs).float(),
                              ref.float(), atol=1e-3)


@pytest.mark.parametrize("n_kv", [1, 2, 3, 4, 8])
def test_int8_decode_attention_over_runs_of_consecutive_slots(n_kv):
    """Rows whose slots run consecutively (a request's own tokens, as the engine allocates them),
    where the integer loops read 16 keys' K / V scales of one kv head from their rows at once
    (hkv <= 4: loads and permutes; 8: a gather), against the float64 reference over the query as the
    kernel quantizes it: every kv head's scales must be its own (two kv heads' scales swapped, or
    a neighbour's read, move outputs far beyond the 2^-13 bound). One row breaks its run midway, so
    its blocks of 16 mix both paths; one starts at the pool's last slots (no read past the scales)."""
    from sgrt.engine.kv_pool import dequantize_int8, quantize_int8

    head_dim, n_heads, slots_n = 64, 2 * n_kv, 2000
    g = torch.Generator().manual_seed(n_kv)
    (kc, ks), (vc, vs) = (quantize_int8(torch.randn(slots_n, n_kv, head_dim, generator=g)) for _ in range(2))
    # scales far apart between kv heads and slots, so that any wrong pick shows
    ks.mul_(torch.rand(slots_n, n_kv, generator=g) * 4 + 0.25)
    vs.mul_(torch.rand(slots_n, n_kv, generator=g) * 4 + 0.25)
    lens = torch.tensor([300, 600, 70])
    slots = torch.zeros(3, 600, dtype=torch.long)
    slots[0, :300] = torch.arange(101, 401)
    slots[1, :600] = torch.cat([torch.arange(900, 1237), torch.arange(500, 763)])
    slots[2, :70] = torch.arange(slots_n - 70, slots_n)
    q = torch.randn(3, n_heads, head_dim, generator=g) * 2
    args = (q, kc, vc, slots, lens, ks, vs)
    out = _at_thread_counts(lambda: torch.ops.sgrt_layer.decode_attention(*args))
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])
    keys, values = dequantize_int8(kc, ks, torch.float64), dequantize_int8(vc, vs, torch.float64)
    if _integer_int8_path(head_dim):
        exact = _float64_attention(_quantized_query(q), keys, values, slots, lens)
        assert float((out[2].double() - exact).abs().max()) <= 2.0 ** -13 * float(values.abs().max())
    else:
        exact = _float64_attention(q, keys, values, slots, lens)
        assert float((out[2].double() - exact).abs().max()) <= 1e-5 * float(values.abs().max())


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256), (5, 5, 64)])
@pytest.mark.parametrize("length", [40, 300, 700, 1100, 1700])
def test_int8_decode_attention_of_one_row_at_any_thread_count(n_heads, n_kv, head_dim, length):
    """One row of 1 to 7 chunks, where the integer loops' items (a chunk's every query head, its
    keys' whole rows) are too few for the threads and are cut into ranges of query heads that
    split kv heads (9 heads on 2 threads: 0-3 and 4-8; 4 threads: 2-3 heads each), and a thread's
    items follow one another across chunks: at 1-4 threads the same bits, within the 2^-13 bound
    of a float64 reference over the query as the kernel quantizes it (a range that read another
    kv head's keys, values or scales, or summed the wrong heads' values, would be far outside)."""
    from sgrt.engine.kv_pool import dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(length * n_heads + head_dim)
    slots_n = 2000
    (kc, ks), (vc, vs) = (quantize_int8(torch.randn(slots_n, n_kv, head_dim, generator=g)) for _ in range(2))
    ks.mul_(torch.rand(slots_n, n_kv, generator=g) * 4 + 0.25)  # (kv heads' scales far apart)
    vs.mul_(torch.rand(slots_n, n_kv, generator=g) * 4 + 0.25)
    slots = torch.arange(150, 150 + length).view(1, length)
    q = torch.randn(1, n_heads, head_dim, generator=g) * 2
    args = (q, kc, vc, slots, torch.tensor([length]), ks, vs)
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            out[n] = torch.ops.sgrt_layer.decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3, 4):
        assert torch.equal(out[n], out[1]), n
    keys, values = dequantize_int8(kc, ks, torch.float64), dequantize_int8(vc, vs, torch.float64)
    if _integer_int8_path(head_dim):
        exact = _float64_attention(_quantized_query(q), keys, values, slots, torch.tensor([length]))
        assert float((out[2].double() - exact).abs().max()) <= 2.0 ** -13 * float(values.abs().max())
    else:
        exact = _float64_attention(q, keys, values, slots, torch.tensor([length]))
        assert float((out[2].double() - exact).abs().max()) <= 1e-5 * float(values.abs().max())


@pytest.mark.parametrize("bad_slot", [1100, -3, 2 ** 62, -(2 ** 62)])
def test_int8_decode_attention_rejects_a_bad_slot_in_a_later_chunk(bad_slot):
    """A slot outside the pool in a row's later chunk (where the integer loops fetch the next
    item's first rows before that item checks its slots) raises the typed error at 1-3 threads,
    far slots too, and the same call with the slot mended then runs."""
    g = torch.Generator().manual_seed(3)
    kc = torch.randint(-127, 128, (1100, 3, 64), generator=g, dtype=torch.int8)
    vc = kc.flip(0).contiguous()
    ks, vs = torch.rand(1100, 3, generator=g), torch.rand(1100, 3, generator=g)
    q = torch.randn(1, 9, 64, generator=g)
    slots = torch.arange(1000).view(1, 1000)
    slots[0, 530] = bad_slot
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with pytest.raises(RuntimeError, match=f"slot {bad_slot} outside the pool's 1100 slots"):
                torch.ops.sgrt_layer.decode_attention(q, kc, vc, slots, torch.tensor([1000]), ks, vs)
    finally:
        torch.set_num_threads(threads)
    slots[0, 530] = 530
    assert torch.isfinite(torch.ops.sgrt_layer.decode_attention(q, kc, vc, slots, torch.tensor([1000]), ks, vs)).all()


@pytest.mark.parametrize("bad", ["query", "k_scale"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,length", [(4, 1, 64, 17), (9, 3, 64, 300), (8, 2, 128, 256)])
def test_int8_decode_attention_a_non_finite_head_leaves_its_group_alone(bad, n_heads, n_kv, head_dim, length):
    """A NaN in one query head (or an infinite K scale, which makes some heads' scores infinite)
    gives NaN where it reaches, and every other head the same bits at 1, 2, 3 and 4 threads: the
    threads cut a kv head's query heads into items differently, so the integer loops' groups of
    heads differ, and a group that met a head whose weights are not finite had sent all its heads
    to the float loops (found by a helper: finite heads moved by ~2e-4 between thread counts)."""
    from sgrt.engine.kv_pool import quantize_int8

    g = torch.Generator().manual_seed(length)
    (kc, ks), (vc, vs) = (quantize_int8(torch.randn(length, n_kv, head_dim, generator=g)) for _ in range(2))
    q = torch.randn(1, n_heads, head_dim, generator=g)
    if bad == "query":
        q[0, 0, 5] = float("nan")
    else:
        ks[1, 0] = float("inf")  # (a key whose score is +inf for some heads of kv head 0, -inf for others)
    args = (q, kc, vc, torch.arange(length).view(1, length), torch.tensor([length]), ks, vs)
    out = {n: o.view(n_heads, head_dim) for n, o in _at_thread_counts(lambda: torch.ops.sgrt_layer.decode_attention(*args)).items()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        out[4] = torch.ops.sgrt_layer.decode_attention(*args).view(n_heads, head_dim)
    finally:
        torch.set_num_threads(threads)
    nan_heads = out[1].isnan().any(-1)
    assert bool(nan_heads.any()) and not bool(nan_heads.all())  # the fallback ran, and for some heads only
    assert bad != "query" or bool(nan_heads[0])
    for n in (2, 3, 4):
        assert torch.equal(out[n].isnan(), out[1].isnan())
        assert torch.equal(out[n][~nan_heads], out[1][~nan_heads]), n


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_int8_stores_the_bits_of_quantize_int8(dtype):
    """store_kv_ into an int8 pool writes the codes and scales kv_pool.quantize_int8 gives, bit for
    bit (the torch and native writers agree), at the given slots only; an all-zero row gets scale 0
    and codes 0; a scale without its pair or a float cache beside scales is refused."""
    from sgrt.engine.kv_pool import quantize_int8

    g = torch.Generator().manual_seed(3)
    k = (torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)).to(dtype)
    v = torch.randn(5, 3, 64, generator=g).to(dtype)
    k[2, 1] = 0
    kc, vc = torch.zeros(10, 3, 64, dtype=torch.int8), torch.zeros(10, 3, 64, dtype=torch.int8)
    ks, vs = torch.zeros(10, 3), torch.zeros(10, 3)
    slots = torch.tensor([9, 1, 4, 7, 2])
    torch.ops.sgrt_layer.store_kv_(kc, vc, slots, k, v, ks, vs)
    (qk, sk), (qv, sv) = quantize_int8(k), quantize_int8(v)
    assert torch.equal(kc[slots], qk) and torch.equal(ks[slots], sk)
    assert torch.equal(vc[slots], qv) and torch.equal(vs[slots], sv)
    assert float(ks[4, 1]) == 0.0 and not kc[4, 1].any()
    assert not kc[[0, 3, 5, 6, 8]].any() and not ks[[0, 3, 5, 6, 8]].any()
    with pytest.raises(RuntimeError, match="both or neither"):
        torch.ops.sgrt_layer.store_kv_(kc, vc, slots, k, v, ks, None)
    with pytest.raises(RuntimeError, match="must be int8"):
        torch.ops.sgrt_layer.store_kv_(kc.to(dtype), vc.to(dtype), slots, k, v, ks, vs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_attention_over_an_int8_pool_equals_the_unfused_steps(dtype):
    """decode_attention_qkv_ over an int8 pool (the layer's one call) against rotary, pre-scale,
    store_kv_ and decode_attention one by one: the same codes, scales and output, bit for bit."""
    from types import SimpleNamespace

    from sgrt.engine.attention import PagedAttention
    from sgrt.engine.kv_pool import KVPool

    n_heads, n_kv, d = 9, 3, 64
    rows, qkv, cos, sin = _two_row_decode_case(dtype, n_heads, n_kv, d, seed=8)
    layer = SimpleNamespace(layer_id=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, q_scale=0.7, window=None)
    out, pools = {}, {}
    for fused in (True, False):
        pool = KVPool(1000, 2, n_kv, d, dtype, "cpu", kv_cache_dtype="int8")
        for i, t in enumerate((pool.k, pool.v)):
            t.copy_(torch.randint(-127, 128, t.shape, generator=torch.Generator().manual_seed(i), dtype=torch.int8))
        for t in (pool.k_scale, pool.v_scale):
            t.fill_(0.01)
        attn = PagedAttention(pool, rows, cascade=False, native=True)
        ops = NativeLayerOps()
        work = qkv.clone().view(2, -1) if fused else qkv.clone()
        out[fused] = ops.attention(layer, work, cos, sin, attn) if fused else \
            LayerOps.attention(ops, layer, work, cos, sin, attn)
        pools[fused] = pool
    assert torch.equal(out[True], out[False])
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(pools[True], name), getattr(pools[False], name)), name
    assert float(pools[True].k_scale[1, 40, 0]) != 0.01  # the new token's scale was written


# ---- extend_attention: rows of several new queries after a cached prefix (bfloat16) --------------

needs_extend = pytest.mark.skipif(not layer_ops.extend_attention_available(),
                                  reason="extend_attention needs a CPU with AVX-512 BF16")


def _extend_case(q_lens, prefixes, n_heads, n_kv, head_dim, seed, slots_n=3000):
    """Rows of ``q_lens`` new queries after ``prefixes`` cached keys, slots scattered in a bfloat16
    pool layer: the operator's arguments ``(q [T, H, D], k_cache, v_cache, slots, kv_lens, q_lens)``."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(slots_n, n_kv, head_dim, generator=g).to(torch.bfloat16)
    lens = [a + b for a, b in zip(q_lens, prefixes)]
    slots = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        slots[i, :n] = torch.randperm(slots_n, generator=g)[:n]
    # scores spread enough that later key blocks raise the running max (the online rescale matters)
    q = (torch.randn(sum(q_lens), n_heads, head_dim, generator=g) * 2).to(torch.bfloat16)
    return q, k_cache, v_cache, slots, torch.tensor(lens), torch.tensor(q_lens)


def _extend_reference(q, k_cache, v_cache, slots, kv_lens, q_lens, dtype) -> torch.Tensor:
    """Gather + SDPA per row in ``dtype`` (float64: the exact attention of the same numbers;
    bfloat16: what PagedAttention runs without the operator): query i of a row at position
    kv_len - q_len + i sees keys 0..that position. -> [T, H * D] in ``dtype``."""
    outs, t0 = [], 0
    h, d = q.shape[1:]
    for r in range(len(kv_lens)):
        n, m = int(kv_lens[r]), int(q_lens[r])
        keys = k_cache[slots[r, :n]].to(dtype).transpose(0, 1)[None]
        values = v_cache[slots[r, :n]].to(dtype).transpose(0, 1)[None]
        mask = torch.arange(n).view(1, -1) <= (n - m + torch.arange(m)).view(-1, 1)
        o = F.scaled_dot_product_attention(q[t0:t0 + m].to(dtype).transpose(0, 1)[None], keys, values,
                                           attn_mask=mask, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(m, h * d))
        t0 += m
    return torch.cat(outs)


@needs_extend
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 1, 256)])
def test_extend_attention_matches_float64_and_sdpa(n_heads, n_kv, head_dim):
    """Ragged rows (q_len 1..70 after prefixes of 0..300 keys: not multiples of the 64-key blocks
    or the 16-key vectors) in one call against attention in float64 from the same bfloat16
    numbers: within 2^-8 |ref| + 2^-8 (the output's one bfloat16 rounding, half a step, plus the
    weights rounded to bfloat16 before the product with V, as SDPA rounds them), and on average
    no further from it than SDPA in bfloat16 on the gathered tensors. A row alone gives the same
    bits as in the batch."""
    import random

    rng = random.Random(n_heads * head_dim)
    cases = [([1, 70, 2], [0, 0, 300]), ([64, 65, 17], [63, 1, 129])]
    cases += [([rng.randint(1, 70) for _ in range(4)], [rng.randint(0, 300) for _ in range(4)]) for _ in range(3)]
    for seed, (q_lens, prefixes) in enumerate(cases):
        args = _extend_case(q_lens, prefixes, n_heads, n_kv, head_dim, seed)
        got = torch.ops.sgrt_layer.extend_attention(*args)
        assert got.shape == (sum(q_lens), n_heads * head_dim) and got.dtype == torch.bfloat16
        exact = _extend_reference(*args, torch.float64)
        sdpa = _extend_reference(*args, torch.bfloat16).double()
        err = (got.double() - exact).abs()
        assert bool((err <= exact.abs() * 2.0 ** -8 + 2.0 ** -8).all()), (q_lens, prefixes, err.max().item())
        assert err.mean().item() <= 1.1 * (sdpa - exact).abs().mean().item(), (q_lens, prefixes)
        q, k_cache, v_cache, slots, kv_lens, q_lens_t = args
        t0 = q_lens[0]
        alone = torch.ops.sgrt_layer.extend_attention(q[t0:t0 + q_lens[1]], k_cache, v_cache, slots[1:2],
                                                      kv_lens[1:2], q_lens_t[1:2])
        assert torch.equal(alone, got[t0:t0 + q_lens[1]])


@needs_extend
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 1, 128)])
def test_extend_attention_does_not_depend_on_the_thread_count(n_heads, n_kv, head_dim):
    """Items (row, kv head, block of queries) and each item's order of sums are fixed by the
    shapes; threads only pick which items they run: 1, 2 and 3 threads give the same bits."""
    args = _extend_case([170, 5, 33], [990, 300, 0], n_heads, n_kv, head_dim, seed=7)
    out = _at_thread_counts(lambda: torch.ops.sgrt_layer.extend_attention(*args))
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])


@needs_extend
def test_extend_attention_rescales_when_later_blocks_raise_the_max():
    """Keys whose scores grow along the context (from about -64 to 64: each 64-key block's max
    ~18 above the last's), so every block rescales the running sum and output (online softmax),
    and keys whose scores fall (the first block holds the max): both within bfloat16 rounding of
    float64."""
    q, k_cache, v_cache, slots, kv_lens, q_lens = _extend_case([50], [400], 9, 3, 64, seed=11)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(1))
    for sign in (1.0, -1.0):
        ramp = sign * torch.linspace(-4, 4, 450).view(450, 1, 1)
        k_cache[slots[0]] = (direction.view(1, 1, 64) * ramp).to(torch.bfloat16)
        q_ramp = (direction * 2).view(1, 1, 64).expand(50, 9, 64).to(torch.bfloat16).contiguous()
        got = torch.ops.sgrt_layer.extend_attention(q_ramp, k_cache, v_cache, slots, kv_lens, q_lens).double()
        exact = _extend_reference(q_ramp, k_cache, v_cache, slots, kv_lens, q_lens, torch.float64)
        assert bool(((got - exact).abs() <= exact.abs() * 2.0 ** -8 + 2.0 ** -8).all()), sign


@needs_extend
def test_extend_attention_reads_a_strided_query():
    """q as the layer hands it over: a [T, H, D] view of the QKV projection's output."""
    q, k_cache, v_cache, slots, kv_lens, q_lens = _extend_case([40, 9], [100, 0], 9, 3, 64, seed=3)
    qkv = torch.cat([q, torch.randn(q.shape[0], 6, 64).to(torch.bfloat16)], dim=1)
    got = torch.ops.sgrt_layer.extend_attention(qkv[:, :9], k_cache, v_cache, slots, kv_lens, q_lens)
    assert torch.equal(got, torch.ops.sgrt_layer.extend_attention(q, k_cache, v_cache, slots, kv_lens, q_lens))


@needs_extend
def test_extend_attention_errors_name_the_argument():
    q, k_cache, v_cache, slots, kv_lens, q_lens = _extend_case([4, 3], [2, 0], 4, 2, 64, seed=1, slots_n=50)
    op = torch.ops.sgrt_layer.extend_attention
    with pytest.raises(RuntimeError, match="q must be a bfloat16 CPU tensor"):
        op(q.float(), k_cache, v_cache, slots, kv_lens, q_lens)
    with pytest.raises(RuntimeError, match="q must be \\[T, heads, head_dim\\]"):
        op(q.view(7, -1), k_cache, v_cache, slots, kv_lens, q_lens)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256, got 32"):
        op(q[..., :32], k_cache[..., :32], v_cache[..., :32], slots, kv_lens, q_lens)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be contiguous"):
        op(q, k_cache.float(), v_cache.float(), slots, kv_lens, q_lens)
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        op(q[:, :3], k_cache, v_cache, slots, kv_lens, q_lens)
    with pytest.raises(RuntimeError, match="kv_lens\\[0\\] = 7 outside 1..6"):
        op(q, k_cache, v_cache, slots, torch.tensor([7, 3]), q_lens)
    with pytest.raises(RuntimeError, match="q_lens\\[1\\] = 4 outside 1..kv_lens\\[1\\] = 3"):
        op(q, k_cache, v_cache, slots, kv_lens, torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match="q_lens must sum to q's 7 rows, got 6"):
        op(q, k_cache, v_cache, slots, kv_lens, torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match="q_lens must be contiguous int64 \\[B\\]"):
        op(q, k_cache, v_cache, slots, kv_lens, q_lens.int())
    bad = slots.clone()
    bad[1, 2] = 50
    with pytest.raises(RuntimeError, match="slot 50 outside the pool's 50 slots"):
        op(q, k_cache, v_cache, bad, kv_lens, q_lens)
    bad[1, 2] = -1
    with pytest.raises(RuntimeError, match="slot -1 outside the pool's 50 slots"):
        op(q, k_cache, v_cache, bad, kv_lens, q_lens)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_int8_decode_attention_propagates_nan(head_dim):
    """A NaN in a query head, or in the V scale of a slot a row reads, makes exactly the outputs
    that depend on it NaN, on the integer loops (head_dim 64 on AVX-512 VNNI) and the float ones:
    NaN is never rounded into an integer code."""
    args, _ = _int8_case(torch.bfloat16, [40, 700, 300], 9, 3, head_dim, seed=5)
    q, kc, vc, slots, lens, ks, vs = args
    q = q.clone()
    q[0, 4, 7] = float("nan")  # row 0, query head 4
    vs = vs.clone()
    vs[int(slots[2, 100]), 1] = float("nan")  # a slot of row 2's, kv head 1 (query heads 3-5)
    out = torch.ops.sgrt_layer.decode_attention(q, kc, vc, slots, lens, ks, vs).float().view(3, 9, head_dim)
    nan = torch.isnan(out).all(-1)
    expected = torch.zeros(3, 9, dtype=torch.bool)
    expected[0, 4] = True
    expected[2, 3:6] = True
    assert torch.equal(nan, expected)
    assert not torch.isnan(out[~expected]).any()
