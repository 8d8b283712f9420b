"""The native weight-only quantized linear kernel (sgrt/kernels/woq.py, woq_cpu.cpp): results
against a float64 reference, the packed layout, argument errors, and batch independence.

Error bound (``_check``), per output element ``y[m, n]`` against the exact float64 ``ref``:

    |y - ref| <= 2**-8 * |ref| + (group + 2 G + 4) * 2**-24 * A[m, n]

- ``2**-8 |ref|``: the final rounding to bfloat16 (8 significant bits, round to nearest: at most
  half an ulp, 2**-8 relative), applied to a float32 value that is itself within the second term.
- The second term bounds float32 accumulation (unit roundoff 2**-24): a group's partial sum
  takes ``group`` roundings (vdpbf16ps: two per pair), the group's sum of x as many, and each of
  the ``G = K / group`` groups adds two FMA roundings to the running sum (standard
  ``gamma_n ~ n u`` bound). ``A[m, n] = sum_k (|scale| (code + c) + |offset| + c |scale|) |x|``
  with ``c = 128`` for 4-bit codes (the kernel sums ``128 + code`` and subtracts ``128 scale
  sum(x)``), else 0: the magnitudes that are rounded.

For the shapes here the second term is ~0.3-1% of a typical |ref|, while the smallest mistakes
the test must catch change a result by several percent: :func:`test_bound_rejects_wrong_weights`
checks that a wrong scale, a scale from the wrong group, a swapped pair of codes or a missing
row each fail it. An RMS check (``rms(err) <= 2**-8 rms(ref)``) backs it up with a bound that
does not loosen where ``A`` is large.

The AVX2 build (``woq_avx2.cpp``) multiplies activations quantized per block of 32 inputs (an
int8 as llama.cpp's plus an int8 remainder) with integer dot products: there ``ref`` is
``xhat @ W.T`` with ``xhat`` the
quantized x (:func:`_quantize_x`; the rounding of x itself is checked separately), the integer
sums are exact, and :func:`_avx2_reference` reproduces the kernel's float32 epilogue bit for bit.
"""
from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from sgrt.kernels import woq
from sgrt.kernels.build import cpu_flags

if not woq.available():
    pytest.skip("the native kernel is unavailable here (needs an AVX-512 BF16 or AVX2 + FMA CPU and "
                "a C++ compiler; SGRT_NATIVE_KERNELS=0 disables it)", allow_module_level=True)


def test_isa_names_the_build_that_runs():
    """The AVX2 build runs by default, on AVX-512 CPUs too; the AVX-512 BF16 one only where
    SGRT_WOQ_ISA=avx512_bf16 asks for it and the CPU has its flags."""
    asked = os.environ.get("SGRT_WOQ_ISA", "") == "avx512_bf16"
    want = "avx512_bf16" if asked and all(f in cpu_flags() for f in woq.REQUIRED_CPU_FLAGS) else "avx2"
    assert woq.isa() == want

SHAPES = [(16, 32), (960, 576), (576, 1536), (3072, 576)]
ROWS = [1, 2, 3, 4, 5, 8, 11, 12, 13, 16, 17, 33]


@functools.lru_cache(maxsize=None)
def _layer(n: int, k: int, bits: int, group: int, seed: int = 0):
    """Random codes / scales / offsets of realistic size (Q4_1-like: scale 1e-3..1e-2, offset
    ~ -8 scale for 4 bits, ~ -128 scale for 8), the packed weight and the exact W (float64)."""
    g = torch.Generator().manual_seed(seed * 1000 + n + k + bits + group)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 9e-3 + 1e-3).half()
    mid = 8 if bits == 4 else 128
    offsets = (-mid * scales.double() * (1 + 0.2 * torch.randn(n, k // group, generator=g,
                                                                 dtype=torch.float64))).half()
    w = _weight(codes, scales, offsets, group)
    return codes, woq.pack(codes, bits), scales, offsets, w


def _weight(codes, scales, offsets, group):
    n, k = codes.shape
    w = codes.double().reshape(n, k // group, group) * scales.double()[..., None] + offsets.double()[..., None]
    return w.reshape(n, k)


def _quantize_x(x: torch.Tensor, activations: str = "int16") -> tuple[torch.Tensor, torch.Tensor]:
    """The AVX2 kernel's activation quantization, symmetric per row and block of 32 inputs, in
    float32 arithmetic: ``a = max |x|``, ``t = x * (127 / a)``, ``q1 = round(t)`` (int8, as
    llama.cpp's Q8 blocks), ``q2 = round((t - q1) * 254)`` (the remainder, int8), ``Q = 254 q1 +
    q2``, ``dx = a / 32258``: ``x ~ dx * Q``, a step of ``max|x| / 32258`` (rounding half to
    even throughout); ``Q = 0, dx = 0`` where ``a < 2**-100``. ``activations="int8"`` (the opt-in
    ``linear_q8``): ``Q = q1``, ``dx = a / 127``. Returns (Q ``[M, K/32, 32]`` float32 integers, dx
    ``[M, K/32]`` float32)."""
    m, k = x.shape
    xf = x.float().reshape(m, k // 32, 32)
    a = xf.abs().amax(-1)
    tiny = a < 2.0 ** -100
    t = xf * (torch.tensor(127.0) / a)[..., None]
    q1 = torch.round(t)
    q2 = torch.round((t - q1) * torch.tensor(254.0))
    q1[tiny] = q2[tiny] = 0.0
    assert q1.abs().max() <= 127 and q2.abs().max() <= 127
    if activations == "int8":
        return q1, torch.where(tiny, torch.zeros_like(a), a / torch.tensor(127.0))
    q = 254 * q1 + q2
    dx = torch.where(tiny, torch.zeros_like(a), a / torch.tensor(32258.0))
    return q, dx


def _x_ref(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The activations the kernel multiplies by, float64: x itself (AVX-512 BF16: bf16 x is used
    exactly), or its quantization ``dx * q`` (AVX2)."""
    if woq.isa() != "avx2":
        return x.double()
    q, dx = _quantize_x(x)
    return (q.double() * dx.double()[..., None]).reshape(x.shape)


def _avx2_reference(x, codes, scales, offsets, bits, group, activations="int16") -> torch.Tensor:
    """The AVX2 kernel's result, bit for bit: per 32-input block b (scale group g), the exact
    integer sums ``isum = sum code * q`` and ``qsum = sum q``, then in float32 with one rounding
    per operation ``t = scale * float(isum); u = offset * qsum; t = t + u; y = y + dx * t``
    (exact below 2**24 = all 4-bit sums; above it rounds to nearest even), blocks in k order, and
    one round to nearest even to bfloat16."""
    m, k = x.shape
    n = codes.shape[0]
    q, dx = _quantize_x(x, activations)
    isum = torch.einsum("mbk,nbk->mnb", q.to(torch.int64), codes.to(torch.int64).reshape(n, k // 32, 32))
    qsum = q.sum(-1)  # exact: integers below 2**24
    y = torch.zeros(m, n)
    for b in range(k // 32):
        g = b * 32 // group
        t = scales[:, g].float()[None, :] * isum[:, :, b].double().float()
        u = offsets[:, g].float()[None, :] * qsum[:, b, None]
        t = t + u
        y = y + dx[:, b, None] * t
    return y.bfloat16()


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 7 * m + k)).bfloat16()


def _bound(x, codes, scales, offsets, bits, group):
    """Per-element allowed |y - ref| (see the module docstring) and ref itself, float64."""
    n, k = codes.shape
    c = 128.0 if bits == 4 and woq.isa() != "avx2" else 0.0
    s = scales.double().abs()[..., None]
    o = offsets.double().abs()[..., None]
    mag = (s * (codes.double().reshape(n, k // group, group) + c) + o + c * s).reshape(n, k)
    a = _x_ref(x, bits).abs() @ mag.T
    return (group + 2 * (k // group) + 4) * 2.0 ** -24 * a


def _check(y, ref, bound) -> None:
    err = (y.double() - ref).abs()
    allowed = 2.0 ** -8 * ref.abs() + bound
    worst = (err - allowed).max().item()
    assert worst <= 0, (f"error {err.max().item():.3g} exceeds the bound by {worst:.3g} "
                        f"(max |ref| {ref.abs().max().item():.3g})")
    rms_err = err.pow(2).mean().sqrt().item()
    rms_ref = ref.pow(2).mean().sqrt().item()
    assert rms_err <= 2.0 ** -8 * rms_ref, f"rms error {rms_err:.3g} vs rms(ref) {rms_ref:.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_float64_reference(bits, shape):
    n, k = shape
    codes, packed, scales, offsets, w = _layer(n, k, bits, 32)
    for m in ROWS:
        x = _x(m, k)
        y = woq.linear(x, packed, scales, offsets, n, k, bits, 32)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        _check(y, _x_ref(x, bits) @ w.T, _bound(x, codes, scales, offsets, bits, 32))


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_larger_groups(bits, group):
    for n, k in [(960, 576), (576, 1536)]:
        if k % group:
            continue
        codes, packed, scales, offsets, w = _layer(n, k, bits, group)
        for m in (1, 5, 16, 17):
            x = _x(m, k)
            y = woq.linear(x, packed, scales, offsets, n, k, bits, group)
            _check(y, _x_ref(x, bits) @ w.T, _bound(x, codes, scales, offsets, bits, group))


avx2_only = pytest.mark.skipif(woq.isa() != "avx2", reason="the AVX2 build's int8-activation arithmetic")


@avx2_only
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_matches_its_formula_bitwise(bits, group):
    """The AVX2 kernel equals :func:`_avx2_reference` bit for bit: every group size, 4 and 8
    bits, a lone block (16 x 128), row counts that use every row grouping (four rows at a time,
    then two, then one; 4-bit codes with int16 activations read four rows' Q, the rest expand4's
    vectors), two tiles of rows at k = 1,536 (40 rows a tile, the second's 3 left over), and the
    layer shapes; x spans magnitudes (one block tiny, one zero) so every rounding path runs."""
    for n, k in [(16, 128), (48, 384), (960, 576), (576, 1536)]:
        if k % group:
            continue
        codes, packed, scales, offsets, _ = _layer(n, k, bits, group)
        for m in (1, 2, 3, 4, 7, 11) + ((43,) if k == 1536 else ()):
            x = _x(m, k).float()
            x[:, 32:64] *= 1e-3
            x[0, 64:96] = 0.0
            x = x.bfloat16()
            y = woq.linear(x, packed, scales, offsets, n, k, bits, group)
            want = _avx2_reference(x, codes, scales, offsets, bits, group)
            assert torch.equal(y, want), (n, k, m, (y.float() - want.float()).abs().max().item())


@avx2_only
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_match_their_formula_bitwise(bits, group):
    """``activations="int8"`` (``linear_q8``): the same formula with ``Q = q1`` and ``dx = max|x|
    / 127``, bit for bit (odd row counts, a tiny and a zero block, a NaN row), rows independent of
    the batch; its error against the unquantized x is larger than the default's (the step is
    254x larger) and within the int8 step's bound."""
    for n, k in [(16, 128), (960, 576), (576, 1536)]:
        if k % group:
            continue
        codes, packed, scales, offsets, w = _layer(n, k, bits, group)
        for m in (1, 2, 3, 7):
            x = _x(m, k).float()
            x[:, 32:64] *= 1e-3
            x[0, 64:96] = 0.0
            x = x.bfloat16()
            y = woq.linear(x, packed, scales, offsets, n, k, bits, group, activations="int8")
            want = _avx2_reference(x, codes, scales, offsets, bits, group, "int8")
            assert torch.equal(y, want), (n, k, m, (y.float() - want.float()).abs().max().item())
    x = _x(9, k)
    x[4, 3] = float("nan")
    y = woq.linear(x, packed, scales, offsets, n, k, bits, group, activations="int8")
    assert not torch.isfinite(y[4]).any() and torch.isfinite(y[torch.arange(9) != 4]).all()
    for i in (0, 5, 8):
        assert torch.equal(y[i], woq.linear(x[i:i + 1], packed, scales, offsets, n, k, bits, group,
                                            activations="int8")[0])
    x = _x(16, k)
    ref = x.double() @ w.T
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    err8 = rms(woq.linear(x, packed, scales, offsets, n, k, bits, group, activations="int8").double() - ref)
    err16 = rms(woq.linear(x, packed, scales, offsets, n, k, bits, group).double() - ref)
    assert err16 < err8 <= 2.0 ** -6 * rms(ref)


@avx2_only
def test_int8_prefill_switches_on_the_row_count():
    """``activations="int8-prefill"`` (``linear_q8_prefill``): the default's bits below
    ``PREFILL_ROWS`` rows, ``"int8"``'s from there on."""
    n, k = 64, 256
    _, packed, scales, offsets, _ = _layer(n, k, 4, 32)
    for m in (1, woq.PREFILL_ROWS - 1, woq.PREFILL_ROWS, woq.PREFILL_ROWS + 3):
        x = _x(m, k)
        y = woq.linear(x, packed, scales, offsets, n, k, 4, 32, activations="int8-prefill")
        same = "int8" if m >= woq.PREFILL_ROWS else "int16"
        other = "int16" if same == "int8" else "int8"
        assert torch.equal(y, woq.linear(x, packed, scales, offsets, n, k, 4, 32, activations=same))
        assert not torch.equal(y, woq.linear(x, packed, scales, offsets, n, k, 4, 32, activations=other))


def test_activations_errors():
    """An unknown activation precision is a ValueError naming it; ``"int8"`` is one only where the
    AVX2 build runs."""
    _, packed, scales, offsets, _ = _layer(16, 32, 4, 32)
    x = _x(1, 32)
    with pytest.raises(ValueError, match="activations must be one of int16, int8"):
        woq.linear(x, packed, scales, offsets, 16, 32, 4, 32, activations="int4")
    if woq.isa() == "avx2":
        assert woq.op_name("int8") == "sgrt_woq_avx2::linear_q8"
        assert woq.op_name("int8-prefill") == "sgrt_woq_avx2::linear_q8_prefill"
    else:
        with pytest.raises(ValueError, match="needs the AVX2 build"):
            woq.linear(x, packed, scales, offsets, 16, 32, 4, 32, activations="int8")


@avx2_only
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_activation_rounding_is_small(bits):
    """The quantized activations are within half a step (``max|x| / 32258`` per block, plus
    float32's rounding of ``x * 127 / a``) of x, so that against the unquantized x the result
    meets the same rms bound as the exact kernels (the bfloat16 rounding of y dominates)."""
    n, k = 960, 576
    codes, packed, scales, offsets, w = _layer(n, k, bits, 32)
    x = _x(16, k)
    q, dx = _quantize_x(x)
    err = ((q * dx[..., None]).reshape(x.shape) - x.float()).abs()
    assert (err <= dx.repeat_interleave(32, dim=1) * 0.51).all()
    y = woq.linear(x, packed, scales, offsets, n, k, bits, 32).double()
    ref = x.double() @ w.T
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(y - ref) <= 2.0 ** -8 * rms(ref)


@pytest.mark.parametrize("bits", [4, 8])
def test_non_finite_and_zero_rows(bits):
    """A row holding a NaN or an infinity gives a non-finite result in every output of that row
    (as a matmul would) and leaves the other rows as they are alone; an all-zero row gives zeros."""
    n, k = 960, 576
    _, packed, scales, offsets, _ = _layer(n, k, bits, 32)
    x = _x(5, k)
    x[1, 100] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 0.0
    y = woq.linear(x, packed, scales, offsets, n, k, bits, 32)
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()
    assert torch.equal(y[3], torch.zeros(n, dtype=torch.bfloat16))
    for i in (0, 4):
        assert torch.equal(y[i], woq.linear(x[i:i + 1], packed, scales, offsets, n, k, bits, 32)[0])


@pytest.mark.parametrize("bits", [4, 8])
def test_bound_rejects_wrong_weights(bits):
    """The check is tight enough to see the mistakes a layout or epilogue bug makes: each of
    these wrong weights, used as the reference, makes the (correct) kernel output fail it."""
    n, k, group = 576, 1536, 32
    codes, packed, scales, offsets, w = _layer(n, k, bits, group)
    x = _x(16, k)
    y = woq.linear(x, packed, scales, offsets, n, k, bits, group)
    bound = _bound(x, codes, scales, offsets, bits, group)
    _check(y, _x_ref(x, bits) @ w.T, bound)  # the right weights pass

    wrong_scale = scales.clone()
    wrong_scale[:, 5] *= 1.05  # one group's scale 5% off
    shifted = torch.roll(scales, 1, dims=1)  # every group takes its neighbour's scale
    swapped = codes.clone()
    swapped[:, [2, 3]] = swapped[:, [3, 2]]  # one pair of k swapped, every row
    cases = {
        "wrong scale": _weight(codes, wrong_scale, offsets, group),
        "wrong group": _weight(codes, shifted, offsets, group),
        "swapped pair": _weight(swapped, scales, offsets, group),
    }
    ref = _x_ref(x, bits) @ w.T
    missing_row = ref.clone()
    missing_row[7] = 0.0
    for name, wrong in cases.items():
        with pytest.raises(AssertionError):
            _check(y, _x_ref(x, bits) @ wrong.T, bound)
    with pytest.raises(AssertionError):
        _check(y, missing_row, bound)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_do_not_depend_on_the_batch(bits):
    """Row i of a batch equals row i computed alone, bitwise (any M, any tile split, any thread
    split)."""
    n, k = 960, 576
    _, packed, scales, offsets, _ = _layer(n, k, bits, 32)
    x = _x(40, k)
    alone = torch.cat([woq.linear(x[i:i + 1], packed, scales, offsets, n, k, bits, 32) for i in range(40)])
    for m in (2, 3, 5, 8, 12, 16, 17, 31, 33, 40):
        assert torch.equal(woq.linear(x[:m], packed, scales, offsets, n, k, bits, 32), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(woq.linear(x, packed, scales, offsets, n, k, bits, 32), alone)
    finally:
        torch.set_num_threads(threads)


@avx2_only
@pytest.mark.parametrize("group", [32, 128])
def test_avx2_one_row_streams_match_the_formula(group):
    """One row of x against 8-bit codes (decode) reads a thread's row blocks as 4 streams side by
    side: every split of the blocks into streams and left-over blocks (1 to 4 blocks a stream, 0
    to 3 left over, 1 and 2 threads) gives :func:`_avx2_reference`'s bits."""
    k = 256
    threads = torch.get_num_threads()
    try:
        for blocks in (3, 4, 5, 8, 11, 16, 19, 37):
            n = 16 * blocks
            codes, packed, scales, offsets, _ = _layer(n, k, 8, group)
            x = _x(1, k)
            want = _avx2_reference(x, codes, scales, offsets, 8, group)
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(woq.linear(x, packed, scales, offsets, n, k, 8, group), want), (blocks, t)
    finally:
        torch.set_num_threads(threads)


# 16-row blocks of one-row int4 calls: 0-3 blocks a stream at 2-4 streams, every remainder, on
# 1 thread and on each half of 2 (odd counts: halves of unequal size)
INT4_ROW_BLOCKS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 19, 24, 37)


def _check_int4_one_row(linear, activations: str, group: int) -> None:
    """One row of x against 4-bit codes through ``linear`` (an operator with woq.linear's
    positional signature, fed woq.prepare's stream) equals :func:`_avx2_reference` bitwise at
    every INT4_ROW_BLOCKS count, k = 256 and 576, on 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        for k in (256, 576):
            if k % group:
                continue
            for blocks in INT4_ROW_BLOCKS:
                n = 16 * blocks
                codes, packed, scales, offsets, _ = _layer(n, k, 4, group)
                stream, _ = woq.prepare(packed, scales, offsets, n, k, 4, group)
                x = _x(1, k).float()
                x[:, 32:64] *= 1e-3
                x[0, 64:96] = 0.0
                x = x.bfloat16()
                want = _avx2_reference(x, codes, scales, offsets, 4, group, activations)
                empty = torch.empty(0, dtype=torch.half)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    y = linear(x, stream, empty, empty, n, k, 4, group)
                    assert torch.equal(y, want), (activations, k, blocks, t)
    finally:
        torch.set_num_threads(threads)


@avx2_only
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_avx2_int4_one_row_streams_match_the_formula(activations, group):
    """One row of x against 4-bit codes (decode) reads a thread's row blocks as several streams
    side by side (block4_streams): every split of the blocks into streams and left-over blocks
    gives :func:`_avx2_reference`'s bits, with int16 and int8 activations."""
    _check_int4_one_row(woq.kernel(activations), activations, group)


@functools.lru_cache(maxsize=None)
def _avx2_variant(streams: int, prefetch: int):
    """woq_avx2.cpp built with ``SGRT_WOQ4_STREAMS=streams`` and ``SGRT_WOQ4_STREAM_PREFETCH=
    prefetch`` as a library of its own (the bench's variants); its (linear, linear_q8), or None
    where it cannot be built."""
    import tempfile
    from pathlib import Path

    from sgrt.kernels.build import load_library

    lib = f"sgrt_woq_avx2_s{streams}p{prefetch}"
    src = woq.SOURCE_AVX2.read_text().replace("TORCH_LIBRARY(sgrt_woq_avx2,", f"TORCH_LIBRARY({lib},")
    path = Path(tempfile.gettempdir()) / f"{lib}.cpp"
    path.write_text(src)
    flags = [*woq.CFLAGS_AVX2, f"-DSGRT_WOQ4_STREAMS={streams}", f"-DSGRT_WOQ4_STREAM_PREFETCH={prefetch}"]
    if load_library(lib, path, flags, woq.REQUIRED_CPU_FLAGS_AVX2) is not None:
        return None
    ops = getattr(torch.ops, lib)
    return ops.linear.default, ops.linear_q8.default


@avx2_only
def test_avx2_int4_stream_counts_give_the_same_bits():
    """The stream count and per-stream prefetch (build-time macros, for bench variants) change no
    output: the kernel built with 2 streams, each prefetched, gives the formula's bits for one
    row, both activations (one variant build: each costs ~15 s of compiling)."""
    ops = _avx2_variant(2, 4096)
    if ops is None:
        pytest.skip("the variant build failed (see the log)")
    for linear, activations in zip(ops, ("int16", "int8")):
        _check_int4_one_row(linear, activations, 32)


_AVX512_VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
avx512_vnni_only = pytest.mark.skipif(
    not _AVX512_VNNI <= cpu_flags(), reason="the CPU lacks AVX-512 VNNI (the kernels run on AVX2 alone)")

# Runs woq.kernel(act)(x, stream, e, e, n, k, fmt, group) for each case in a subprocess with
# SGRT_WOQ_AVX512=0 (the switch is read once per process): the AVX2 kernels' outputs.
_AVX2_SCRIPT = (
    "import sys, torch\n"
    "from sgrt.kernels import woq\n"
    "cases = torch.load(sys.argv[1])\n"
    "e = torch.empty(0, dtype=torch.half)\n"
    "torch.save([woq.kernel(a)(x, s, e, e, n, k, f, g) for a, x, s, n, k, f, g in cases], sys.argv[2])\n")


def _assert_same_bits_as_avx2(cases: list, tmp_path) -> None:
    """Each case ``(act, x, stream, n, k, fmt, group)`` gives the same bits here (AVX-512 VNNI
    kernels) as in a subprocess with ``SGRT_WOQ_AVX512=0`` (the AVX2 kernels)."""
    import subprocess
    import sys

    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "SGRT_WOQ_AVX512": "0"}
    subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env=env, check=True, timeout=600)
    e = torch.empty(0, dtype=torch.half)
    for (a, x, s, n, k, f, g), want in zip(cases, torch.load(tmp_path / "avx2.pt")):
        assert torch.equal(woq.kernel(a)(x, s, e, e, n, k, f, g), want), (a, x.shape, n, k, f, g)


@avx2_only
@avx512_vnni_only
def test_avx512_tiles_match_the_avx2_path_bitwise(tmp_path):
    """On an AVX-512 VNNI CPU the multi-row tiles (16, 8 and 4 rows a weight load, 4- and 8-bit codes)
    run as 512-bit kernels: their outputs equal the AVX2 kernels' (SGRT_WOQ_AVX512=0, in a
    subprocess) bit for bit, for row counts of 16 + 8 + 4 + leftovers, a tile boundary (43 rows at k =
    1,536), the three group sizes and the compact 8-bit stream. (The formula tests above check
    the same path against :func:`_avx2_reference` on such a host.)"""
    cases = []
    for bits, group, (n, k) in [(4, 32, (960, 576)), (4, 128, (48, 384)), (8, 64, (576, 1536)), (8, 32, (48, 384))]:
        if bits == 8 and group == 32:  # offsets -128 * scale: the compact stream
            codes, scales, offsets = _symmetric_layer(n, k, group, 128)
            packed = woq.pack(codes, 8)
        else:
            _, packed, scales, offsets, _ = _layer(n, k, bits, group)
        stream, fmt = woq.prepare(packed, scales, offsets, n, k, bits, group)
        for m in (4, 12, 43) if k == 1536 else (4, 13, 19):
            x = _x(m, k).float()
            x[:, 32:64] *= 1e-3
            x[0, 64:96] = 0.0
            cases.append(("int16", x.bfloat16(), stream, n, k, fmt, group))
    assert cases[-1][5] > 256  # (the last case's stream is the compact one)
    _assert_same_bits_as_avx2(cases, tmp_path)


@avx2_only
@avx512_vnni_only
def test_avx512_one_row_streams_match_the_avx2_ones_bitwise(tmp_path):
    """On an AVX-512 VNNI CPU the one-row streams run on 512-bit vectors (row4_streams512,
    row8_streams512); SGRT_WOQ_AVX512=0 keeps the AVX2 ones. Both give the same bits: one row
    against 4-bit (int16 and int8 activations) and 8-bit codes (full and compact headers), 1 to
    37 blocks, here against a subprocess with the switch off."""
    cases = []
    for bits, compact, group in ((4, False, 32), (4, False, 128), (8, False, 32), (8, True, 64)):
        for blocks in (1, 5, 8, 37):
            n, k = 16 * blocks, 576 if group != 128 else 512
            codes, packed, scales, offsets, _ = _layer(n, k, bits, group)
            if compact:  # offsets -128 * scale: the compact stream (bits 8 + 256 * 128)
                offsets = (scales.float() * -128).half()
            stream, fmt = woq.prepare(packed, scales, offsets, n, k, bits, group)
            assert fmt == (8 + 256 * 128 if compact else bits)
            x = _x(1, k, seed=blocks)
            cases += [(a, x, stream, n, k, fmt, group) for a in ("int16", "int8")]
    _assert_same_bits_as_avx2(cases, tmp_path)


def test_int8_row_tiles_do_not_change_rows():
    """8-bit codes at a long k go in tiles of rows (32 rows of k = 2,048): a batch that spans
    several tiles, each ending in a group of fewer than 4 rows, equals its rows computed alone."""
    n, k = 32, 2048
    _, packed, scales, offsets, _ = _layer(n, k, 8, 32)
    x = _x(71, k)
    alone = torch.cat([woq.linear(x[i:i + 1], packed, scales, offsets, n, k, 8, 32) for i in range(71)])
    assert torch.equal(woq.linear(x, packed, scales, offsets, n, k, 8, 32), alone)


def test_empty_batch():
    _, packed, scales, offsets, _ = _layer(16, 32, 4, 32)
    y = woq.linear(torch.empty(0, 32, dtype=torch.bfloat16), packed, scales, offsets, 16, 32, 4, 32)
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (960, 576)])
def test_pack_unpack_round_trip(bits, shape):
    n, k = shape
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = woq.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (n * k * bits // 8,)
    assert torch.equal(woq.unpack(packed, n, k, bits), codes)


def _pack_by_permutes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed layout built byte by byte with torch's permutes (pack's first form)."""
    n, k = codes.shape
    vec = codes.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32)
    if bits == 8:
        return vec.contiguous().reshape(-1)
    v = vec.reshape(n // 16, k // 8, 4, 4, 8)
    lo, hi = v[:, :, 0:2].permute(0, 1, 3, 2, 4), v[:, :, 2:4].permute(0, 1, 3, 2, 4)
    return (lo | (hi << 4)).contiguous().reshape(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_moves_k_pairs_as_words_to_the_same_bytes(bits):
    """pack moves each k-pair's two codes as one 16-bit word: every byte is where the byte-wise
    permutes put it, for contiguous and strided codes."""
    g = torch.Generator().manual_seed(5)
    for n, k in [(16, 32), (48, 96), (960, 576), (256, 2048)]:
        codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
        assert torch.equal(woq.pack(codes, bits), _pack_by_permutes(codes, bits))
        strided = torch.randint(0, 2 ** bits, (n, 2 * k), dtype=torch.uint8, generator=g)[:, ::2]
        assert torch.equal(woq.pack(strided, bits), _pack_by_permutes(strided.contiguous(), bits))
    top = torch.full((16, 32), 2 ** bits - 1, dtype=torch.uint8)  # (no carry between a word's bytes)
    assert torch.equal(woq.pack(top, bits), _pack_by_permutes(top, bits))


def test_packed_layout_as_documented():
    """Spot checks of the layout in the module docstring (block 1, k-pair 5 / chunk 1)."""
    n, k = 32, 64
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    p8 = woq.pack(codes, 8)
    block = 16 * k  # bytes per 16 output rows
    for w in range(32):  # word w of k-pair 5 in block 1
        assert p8[block + 5 * 32 + w] == codes[16 + w // 2, 10 + w % 2]
    c4 = codes & 15
    p4 = woq.pack(c4, 4)
    block = 16 * k // 2
    chunk = p4[block + 64: block + 128]  # block 1, chunk 1 (k-pairs 4..7)
    for lane in range(4):
        for s in range(2):
            for i in range(8):
                byte = int(chunk[16 * lane + 8 * s + i])
                w = 8 * lane + i
                assert byte & 15 == c4[16 + w // 2, 2 * (4 + s) + w % 2]
                assert byte >> 4 == c4[16 + w // 2, 2 * (4 + 2 + s) + w % 2]


def test_dequantize():
    codes, packed, scales, offsets, w = _layer(960, 576, 4, 32)
    dense = woq.dequantize(packed, scales, offsets, 960, 576, 4, 32, dtype=torch.float32)
    assert torch.allclose(dense.double(), w, rtol=2 ** -23, atol=0)


def test_pack_errors():
    ok = torch.zeros(16, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        woq.pack(ok, 3)
    with pytest.raises(ValueError, match="uint8"):
        woq.pack(ok.to(torch.int32), 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        woq.pack(torch.zeros(8, 32, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        woq.pack(torch.zeros(16, 48, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="0..15"):
        woq.pack(torch.full((16, 32), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="elements"):
        woq.unpack(torch.zeros(10, dtype=torch.uint8), 16, 32, 4)


def test_linear_errors():
    n, k = 32, 64
    _, packed, scales, offsets, _ = _layer(n, k, 4, 32)
    x = _x(2, k)

    def call(**kw):
        args = dict(x=x, packed=packed, scales=scales, offsets=offsets, n=n, k=k, bits=4, group=32)
        args.update(kw)
        return woq.linear(**args)

    cases = [
        (dict(x=x.float()), "x must be bfloat16"),
        (dict(x=_x(2, 32)), r"x must be \[M, k=64\]"),
        (dict(x=_x(64, 2).T), "x must be contiguous"),
        (dict(scales=scales.float()), "scales must be float16"),
        (dict(offsets=offsets[:16]), r"offsets must be \[n=32, k/group=2\]"),
        (dict(packed=packed[:-1]), "packed must be contiguous with n\\*k\\*bits/8"
         + (" \\+ 4\\*n\\*k/group=1280 bytes" if woq.isa() == "avx2" else "=1024 bytes")),
        (dict(packed=packed.view(torch.int8)), "packed must be uint8"),
        (dict(n=24), "n \\(output features\\) must be a positive multiple of 16"),
        (dict(k=48, x=_x(2, 48)), "k \\(input features\\) must be a positive multiple of group=32"),
        (dict(group=16), "group must be 32, 64 or 128"),
        (dict(bits=2), "bits must be 4,? (5 )?or 8"),  # (the AVX2 build also takes fuse5's streams)
    ]
    for kw, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call(**kw)


def test_disabled_by_environment(monkeypatch, caplog):
    """SGRT_NATIVE_KERNELS=0: available() is False, with one warning, and linear() raises."""
    saved = dict(woq._state)
    monkeypatch.setenv("SGRT_NATIVE_KERNELS", "0")
    try:
        woq._state.clear()
        with caplog.at_level(logging.WARNING, logger="sgrt.kernels"):
            assert woq.available() is False
            assert woq.available() is False
        warnings = [r for r in caplog.records if r.name == "sgrt.kernels" and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "SGRT_NATIVE_KERNELS=0" in warnings[0].getMessage()
        with pytest.raises(RuntimeError, match="unavailable"):
            woq.linear(_x(1, 32), *_layer(16, 32, 4, 32)[1:4], 16, 32, 4, 32)
    finally:
        woq._state.clear()
        woq._state.update(saved)
    assert os.environ["SGRT_NATIVE_KERNELS"] == "0"  # (monkeypatch restores it after the test)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)])
def test_fused_stream_layout_and_round_trip(bits, group):
    """fuse(): per 16-row block and group, the 16 scales, the 16 offsets (float16), then that
    group's run of pack()'s codes; unfuse() and unpack() give the parts back exactly."""
    n, k = 48, 256
    codes, packed, scales, offsets, _ = _layer(n, k, bits, group)
    fused = woq.fuse(packed, scales, offsets, n, k, bits, group)
    g_n, run = k // group, 16 * group * bits // 8
    assert fused.dtype == torch.uint8 and fused.numel() == n * k * bits // 8 + 4 * n * g_n
    v = fused.reshape(n // 16, g_n, 64 + run)
    for b, g in [(0, 0), (1, g_n - 1), (2, g_n // 2)]:
        head = v[b, g, :64].contiguous().view(torch.float16)
        assert torch.equal(head[:16], scales[16 * b:16 * b + 16, g])
        assert torch.equal(head[16:], offsets[16 * b:16 * b + 16, g])
        block = packed.reshape(n // 16, -1)[b]
        assert torch.equal(v[b, g, 64:], block[g * run:(g + 1) * run])
    p2, s2, o2 = woq.unfuse(fused, n, k, bits, group)
    assert torch.equal(p2, packed) and torch.equal(s2, scales) and torch.equal(o2, offsets)
    assert torch.equal(woq.unpack(fused, n, k, bits), codes)
    if woq.isa() == "avx2":  # the kernel takes the stream itself; pack()'s codes are fused per call
        x = _x(3, k)
        assert torch.equal(woq.linear(x, fused, scales, offsets, n, k, bits, group),
                           woq.linear(x, packed, scales, offsets, n, k, bits, group))


def _symmetric_layer(n: int, k: int, group: int, c: int, seed: int = 0):
    """8-bit codes with every offset exactly ``-c * scale`` (llama.cpp's Q8_0 read as codes q + 128:
    c = 128; Q5_0 as codes q in 0..31: c = 16, codes then below 32; other c: scales whose product
    by c is a float16): codes, scales, offsets."""
    g = torch.Generator().manual_seed(seed * 1000 + n + k + group + c)
    top = 32 if c == 16 else 256
    codes = torch.randint(0, top, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 9e-3 + 1e-3).half()
    if c & (c - 1):  # (c not a power of 2: scales of 7 significant bits, so that -c * scale is a float16)
        scales = (torch.randint(16, 128, (n, k // group), generator=g) * 2.0 ** -14).half()
    scales[0, 0] = 0.0  # (an all-zero group: offset -0.0)
    offsets = (scales.float() * -c).half()
    return codes, scales, offsets


@avx2_only
@pytest.mark.parametrize("activations", ["int16", "int8", "int8-prefill"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("c", [128, 16, 3])
def test_compact_stream_matches_the_full_one_bitwise(c, group, activations, monkeypatch):
    """8-bit codes whose offsets are all ``-c * scale`` go as the compact stream (headers without
    offsets; the kernel rebuilds them): prepare() picks it, and every path (one row: the 4 streams
    and the blocks left over; 2-4 rows at a time; tiles; 1 and 2 threads; each activation
    precision) gives the full stream's bits, which are :func:`_avx2_reference`'s. (c = 16's codes
    are below 32: SGRT_WOQ5=0 keeps them 8-bit; the 5-bit stream has its own test.)"""
    monkeypatch.setenv("SGRT_WOQ5", "0")
    threads = torch.get_num_threads()
    try:
        for n, k in [(16, 128), (48, 384), (16 * 37, 256), (960, 576)]:
            if k % group:
                continue
            codes, scales, offsets = _symmetric_layer(n, k, group, c)
            packed = woq.pack(codes, 8)
            stream, bits = woq.prepare(packed, scales, offsets, n, k, 8, group)
            assert bits == woq.stream_bits(8, c) == 8 + 256 * c
            assert stream.numel() == n * k + 2 * n * (k // group)
            full = woq.fuse(packed, scales, offsets, n, k, 8, group)
            op = woq.kernel(activations)
            empty = torch.empty(0, dtype=torch.float16)
            for m in (1, 2, 3, 4, 5, 7, 33):
                x = _x(m, k).float()
                x[:, 32:64] *= 1e-3
                x[0, 64:96] = 0.0
                x = x.bfloat16()
                acts = "int8" if activations == "int8" or (activations == "int8-prefill" and m >= woq.PREFILL_ROWS) \
                    else "int16"
                want = _avx2_reference(x, codes, scales, offsets, 8, group, acts)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    y = op(x, stream, empty, empty, n, k, bits, group)
                    assert torch.equal(y, want), (n, k, m, t)
                    assert torch.equal(op(x, full, empty, empty, n, k, 8, group), y), (n, k, m, t)
    finally:
        torch.set_num_threads(threads)


@avx2_only
def test_compact_stream_falls_back_where_one_offset_differs():
    """symmetric_constant() compares every group bit for bit: one offset off by one float16 ulp, a
    different constant in one row, or 4-bit codes keep the full stream (offsets stored)."""
    n, k = 48, 96
    codes, scales, offsets = _symmetric_layer(n, k, 32, 128)
    assert woq.symmetric_constant(scales, offsets) == 128
    for bad in ("ulp", "c"):
        o = offsets.clone()
        if bad == "ulp":
            o[37, 2] = (o[37, 2:3].view(torch.int16) + 1).view(torch.float16)[0]
        else:
            o[5] = (scales[5].float() * -127).half()
        assert woq.symmetric_constant(scales, o) == 0
        stream, bits = woq.prepare(woq.pack(codes, 8), scales, o, n, k, 8, 32)
        assert bits == 8 and stream.numel() == n * k + 4 * n * (k // 32)
        x = _x(1, k)
        assert torch.equal(woq.linear(x, stream, scales, o, n, k, bits, 32),
                           _avx2_reference(x, codes, scales, o, 8, 32))
        with pytest.raises(ValueError, match="compact"):
            woq.fuse(woq.pack(codes, 8), scales, o, n, k, 8, 32, c=128)
    assert woq.symmetric_constant(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.float16)) == 0
    c4, s4, o4 = _symmetric_layer(n, k, 32, 16)
    assert woq.prepare(woq.pack(c4 & 15, 4), s4, (s4.float() * -8).half(), n, k, 4, 32)[1] == 4


def test_compact_stream_layout_and_round_trip():
    """fuse(c=...): per 16-row block and group, the 16 float16 scales, then the group's codes;
    unfuse() with the kernel's bits rebuilds the same offsets, bit for bit."""
    n, k, group, c = 48, 256, 64, 128
    codes, scales, offsets = _symmetric_layer(n, k, group, c)
    packed = woq.pack(codes, 8)
    fused = woq.fuse(packed, scales, offsets, n, k, 8, group, c=c)
    g_n, run = k // group, 16 * group
    v = fused.reshape(n // 16, g_n, 32 + run)
    for b, g in [(0, 0), (1, g_n - 1), (2, 1)]:
        assert torch.equal(v[b, g, :32].contiguous().view(torch.float16), scales[16 * b:16 * b + 16, g])
        assert torch.equal(v[b, g, 32:], packed.reshape(n // 16, -1)[b][g * run:(g + 1) * run])
    p2, s2, o2 = woq.unfuse(fused, n, k, woq.stream_bits(8, c), group)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)
    assert torch.equal(o2.view(torch.int16), offsets.view(torch.int16))


@avx2_only
def test_compact_stream_argument_errors():
    """The kernel checks the compact stream's size against its bits argument, and takes the compact
    form for 8-bit codes only."""
    n, k = 32, 64
    codes, scales, offsets = _symmetric_layer(n, k, 32, 128)
    stream, bits = woq.prepare(woq.pack(codes, 8), scales, offsets, n, k, 8, 32)
    x, empty = _x(1, k), torch.empty(0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="packed must be contiguous"):
        woq.kernel()(x, stream, empty, empty, n, k, 8, 32)  # (the full stream's size expected)
    with pytest.raises(RuntimeError, match="bits must be"):
        woq.kernel()(x, stream, empty, empty, n, k, 4 + 256 * 128, 32)
    with pytest.raises(RuntimeError, match="multiple of group"):
        woq.kernel()(_x(1, 96), stream, empty, empty, n, 96, bits, 64)


@avx2_only
@pytest.mark.parametrize("bits", [4, 8])
def test_float_output_is_the_widened_bfloat16_output(bits):
    """GroupLinear.forward_float (the LM head's logits: ``linear_float``, each thread widening the
    outputs it computed) gives exactly ``layer(x).float()``, at any row count and thread count."""
    from sgrt.models.quant_native import GroupLinear

    n, k = 4096, 576
    layer = GroupLinear.from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(bits)), bits)
    assert layer._linear_float is not None  # (the fused operator runs, not the fallback)
    x = _x(40, k)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in (0, 1, 3, 17, 40):
                got = layer.forward_float(x[:m])
                assert got.dtype == torch.float32 and got.shape == (m, n)
                assert torch.equal(got, layer(x[:m]).float()), (t, m)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        layer._linear_float(_x(k, 2).T, *layer._args)


def _five_bit_layer(n: int, k: int, group: int, c: int, seed: int = 0):
    """8-bit codes below 32 (a GGUF's Q5_0 blocks): with offsets ``-16 * scale`` (c = 16, the
    compact headers) or :func:`_layer`'s free offsets (c = 0): codes, scales, offsets."""
    if c:
        return _symmetric_layer(n, k, group, c, seed)
    codes, _, scales, offsets, _ = _layer(n, k, 8, group, seed)
    return codes & 31, scales, offsets


@avx2_only
@pytest.mark.parametrize("activations", ["int16", "int8", "int8-prefill"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("c", [16, 0])
def test_five_bit_stream_matches_the_formula_bitwise(c, group, activations):
    """fuse5's stream (the 5-bit codes, then the 8-bit stream of the same codes) gives the 8-bit
    stream's bits, which are :func:`_avx2_reference`'s, on every path: one row (on an AVX-512
    VNNI CPU from the 5-bit part: several streams side by side and the blocks left over, 1 to 37
    blocks), 2-33 rows (the 8-bit part), 1 and 2 threads, each activation precision, compact and
    full headers, every group size."""
    threads = torch.get_num_threads()
    empty = torch.empty(0, dtype=torch.float16)
    op = woq.kernel(activations)
    try:
        for n, k in [(16, 128), (48, 384), (16 * 37, 256), (960, 576)]:
            if k % group:
                continue
            codes, scales, offsets = _five_bit_layer(n, k, group, c)
            stream = woq.fuse5(codes, scales, offsets, group, c)
            eight = woq.fuse(woq.pack(codes, 8), scales, offsets, n, k, 8, group, c)
            assert stream.numel() == eight.numel() + n * k * 5 // 8 + (eight.numel() - n * k)
            for m in (1, 2, 3, 5, 33):
                x = _x(m, k).float()
                x[:, 32:64] *= 1e-3
                x[0, 64:96] = 0.0
                x = x.bfloat16()
                acts = "int8" if activations == "int8" or (activations == "int8-prefill" and m >= woq.PREFILL_ROWS) \
                    else "int16"
                want = _avx2_reference(x, codes, scales, offsets, 8, group, acts)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    y = op(x, stream, empty, empty, n, k, woq.stream_bits(5, c), group)
                    assert torch.equal(y, want), (n, k, m, t)
                    assert torch.equal(op(x, eight, empty, empty, n, k, woq.stream_bits(8, c), group), y)
    finally:
        torch.set_num_threads(threads)


@avx2_only
@avx512_vnni_only
def test_five_bit_stream_without_avx512_reads_its_eight_bit_part(tmp_path):
    """With SGRT_WOQ_AVX512=0 (or on an AVX2-only CPU) a one-row call on fuse5's stream reads its
    8-bit part: the same bits as the AVX-512 VNNI kernel's read of the 5-bit part (here), for
    compact and full headers, both activation precisions, 1 to 37 blocks."""
    cases = []
    for c, group in ((16, 32), (0, 64), (16, 128)):
        for blocks in (1, 5, 37):
            n, k = 16 * blocks, 512
            codes, scales, offsets = _five_bit_layer(n, k, group, c, seed=blocks)
            stream = woq.fuse5(codes, scales, offsets, group, c)
            cases += [(a, _x(1, k, seed=blocks), stream, n, k, woq.stream_bits(5, c), group) for a in ("int16", "int8")]
    _assert_same_bits_as_avx2(cases, tmp_path)


def test_five_bit_stream_layout_and_round_trip():
    """fuse5(): per 16-row block and group the 8-bit stream's header, then per 32 inputs the codes'
    low 4 bits in pack()'s 4-bit layout and their fifth bits as 64-bit masks (bit j of a chunk's
    first mask: the fifth bit of the code in byte j's low nibble, second mask: its high nibble);
    then fuse()'s 8-bit stream. unfuse() gives the 8-bit codes, scales and offsets back exactly."""
    n, k, group, c = 48, 256, 64, 16
    codes, scales, offsets = _symmetric_layer(n, k, group, c)
    stream = woq.fuse5(codes, scales, offsets, group, c)
    eight = woq.fuse(woq.pack(codes, 8), scales, offsets, n, k, 8, group, c)
    head, g_n = 32, k // group
    five = stream[:stream.numel() - eight.numel()].reshape(n // 16, g_n, head + group // 32 * 320)
    assert torch.equal(stream[five.numel():], eight)
    low = woq.pack(codes & 15, 4).reshape(n // 16, k // 32, 4, 64)  # [blocks, 32-input blocks, chunks, bytes]
    high = woq.pack(codes >> 4, 4).reshape(n // 16, k // 32, 4, 64)
    for b, g in [(0, 0), (2, g_n - 1), (1, 1)]:
        assert torch.equal(five[b, g, :head].contiguous().view(torch.float16), scales[16 * b:16 * b + 16, g])
        for j in range(group // 32):
            kb = g * group // 32 + j
            body = five[b, g, head + 320 * j:head + 320 * (j + 1)]
            assert torch.equal(body[:256], low[b, kb].reshape(-1))
            masks = body[256:].reshape(4, 2, 8)
            for chunk in range(4):
                for half, nibble in enumerate((high[b, kb, chunk] & 1, high[b, kb, chunk] >> 4)):
                    word = int.from_bytes(bytes(masks[chunk, half].tolist()), "little")
                    assert [word >> i & 1 for i in range(64)] == nibble.tolist(), (b, g, j, chunk, half)
    p2, s2, o2 = woq.unfuse(stream, n, k, woq.stream_bits(5, c), group)
    assert torch.equal(p2, woq.pack(codes, 8)) and torch.equal(s2, scales)
    assert torch.equal(o2.view(torch.int16), offsets.view(torch.int16))
    with pytest.raises(ValueError, match="0..31"):
        woq.fuse5(codes | 32, scales, offsets, group, c)


@avx2_only
def test_prepare_gives_codes_below_32_the_five_bit_stream():
    """prepare() keeps 8-bit codes below 32 as fuse5's stream where five_bit_streams() (an AVX-512
    VNNI CPU, SGRT_WOQ5 not 0), else the 8-bit one; one code of 32 keeps the 8-bit stream."""
    n, k = 48, 128
    codes, scales, offsets = _symmetric_layer(n, k, 32, 16)
    stream, bits = woq.prepare(woq.pack(codes, 8), scales, offsets, n, k, 8, 32)
    if woq.five_bit_streams():
        assert bits == woq.stream_bits(5, 16) and torch.equal(stream, woq.fuse5(codes, scales, offsets, 32, 16))
    else:
        assert bits == woq.stream_bits(8, 16)
    codes[7, 9] = 32
    assert woq.prepare(woq.pack(codes, 8), scales, offsets, n, k, 8, 32)[1] == woq.stream_bits(8, 16)


@avx2_only
def test_five_bit_stream_argument_errors():
    """The kernel checks a 5-bit stream's size (both parts) against its bits argument."""
    n, k = 32, 64
    codes, scales, offsets = _symmetric_layer(n, k, 32, 16)
    stream = woq.fuse5(codes, scales, offsets, 32, 16)
    eight = woq.fuse(woq.pack(codes, 8), scales, offsets, n, k, 8, 32, 16)
    x, empty = _x(1, k), torch.empty(0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="twice: 5 bits, then 8"):
        woq.kernel()(x, eight, empty, empty, n, k, woq.stream_bits(5, 16), 32)
    with pytest.raises(RuntimeError, match="packed must be contiguous"):
        woq.kernel()(x, stream, empty, empty, n, k, woq.stream_bits(8, 16), 32)
    with pytest.raises(RuntimeError, match="bits must be"):
        woq.kernel()(x, stream, empty, empty, n, k, 6, 32)


@avx2_only
@pytest.mark.parametrize("bits,c,five", [(4, 0, False), (8, 0, False), (8, 128, False), (8, 16, True)])
def test_dequantize_rows_gives_dequantize_in_bfloat16(bits, c, five, monkeypatch):
    """The native rows of every stream form (4-bit, 8-bit, compact 8-bit, 5-bit) are
    woq.dequantize's values rounded to bfloat16, bit for bit, for any 16-row range; refused
    ranges are named."""
    from sgrt.models.quant_native import GroupLinear

    g = torch.Generator().manual_seed(bits + c)
    n, k = 96, 256
    codes = torch.randint(0, 32 if five else (1 << bits), (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half()
    offsets = (scales.float() * -float(c)).half() if c else (torch.rand(n, k // 32, generator=g) * 0.1 - 0.05).half()
    if not five:
        monkeypatch.setattr(woq, "five_bit_streams", lambda: False)
    layer = GroupLinear(codes, scales, offsets, bits)
    assert woq.stream_format(layer.stream_bits) == ((5 if five and woq.five_bit_streams() else bits), c)
    ref = layer.dequantize().bfloat16()
    assert torch.equal(woq.dequantize_rows(*layer._args, 0, n), ref)
    assert torch.equal(woq.dequantize_rows(*layer._args, 32, 80), ref[32:80])
    with pytest.raises(RuntimeError, match="16-row blocks"):
        woq.dequantize_rows(*layer._args, 8, 32)


@avx2_only
def test_dense_prefill_path_is_a_bfloat16_matmul_over_the_dequantized_weight(monkeypatch):
    """SGRT_WOQ_DENSE_ROWS=N (opt-in): calls of N rows or more are F.linear over the weight
    dequantized to bfloat16 a tile of rows at a time (the same bits as one F.linear over all of
    it: tiles cut whole output columns), fewer rows stay on the kernel; unset, never."""
    from sgrt.models.quant_native import GroupLinear

    monkeypatch.delenv("SGRT_WOQ_DENSE_ROWS", raising=False)
    assert woq.dense_rows() is None
    monkeypatch.setenv("SGRT_WOQ_DENSE_ROWS", "64")
    assert woq.dense_rows() == 64
    monkeypatch.setattr(woq, "DENSE_TILE_WEIGHTS", 32 * 256)  # (tiles of 32 rows: three of them)
    g = torch.Generator().manual_seed(7)
    layer = GroupLinear.from_float(torch.randn(96, 256, generator=g) * 0.05, 4)
    x = torch.randn(64, 256, generator=g).bfloat16()
    dense = torch.nn.functional.linear(x, layer.dequantize().bfloat16())
    assert torch.equal(layer(x), dense)
    assert torch.equal(layer(x[:63]), layer._linear(x[:63].contiguous(), *layer._args))  # (below: the kernel)
    assert not torch.equal(layer(x[:63]), dense[:63])  # (the two paths are different arithmetic)
