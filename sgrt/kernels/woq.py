"""Weight-only quantized linear layers with group-wise scales: native CPU kernels (AVX2 + FMA, the
default on every CPU that has it, and an opt-in AVX-512 BF16 one: "Which build runs" below).

``y = x @ W.T`` with ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` (``g = k // group``):
the asymmetric blocks of llama.cpp's Q4_1 (``block_q4_1`` in ggml's ``ggml-common.h``: ``code``
0..15, ``scale = d``, ``offset = m``, float16, groups of 32), and the same form with 8-bit codes
0..255 ("Q8_1-style" in the sense of a per-group float16 scale *and* offset; llama.cpp's own
``block_q8_1`` holds ``d`` and ``s = d * sum(q)`` for symmetric codes, which maps to this form
with ``offset = -128 d`` after shifting the codes by 128). Activations ``x`` and the result are
bfloat16; sums are fp32 (a group's partial sum, then ``scale * partial + offset * sum(x over
the group)`` with fp32 FMAs), rounded to bfloat16 once (round to nearest even).

The AVX-512 BF16 kernel (``woq_cpu.cpp``) widens codes to bfloat16 exactly and multiplies with ``vdpbf16ps``
(Intel's AVX512_BF16 instruction ``_mm512_dpbf16_ps``: 16 fp32 lanes, each adding the products
of one pair of bf16), 16 output features a vector and one x pair broadcast per instruction; each
widened weight vector serves a tile of up to 16 rows of ``x``. torch's thread pool
(``at::parallel_for``) splits the output features. The scales are transposed to the kernel's
order per call (16 x 8 blocks, ``vpermt2w``), the rows of ``x`` regrouped per tile.

Packed layout (:func:`pack`): blocks of 16 output features; a block's whole K is contiguous
(``16 * K * bits / 8`` bytes), as 32-word vectors, one per pair of consecutive inputs ("k-pair"):
word ``w`` of k-pair ``p``'s vector is ``code[16 * block + w // 2, 2 * p + w % 2]``.

- ``bits=8``: one byte per word, the vectors in k order (32 bytes a k-pair).
- ``bits=4``: 64-byte chunks of 4 vectors (k-pairs ``4c .. 4c+3``); byte ``16 L + 8 s + i`` of a
  chunk holds word ``8 L + i`` of vector ``s`` in its low nibble and of vector ``2 + s`` in its
  high nibble, the order in which ``vpunpcklbw`` / ``vpunpckhbw`` (per 128-bit lane ``L``)
  interleave the masked nibbles with the byte ``0x43``: the bf16 bit pattern ``0x4300 | q`` is
  ``128 + q``, corrected by ``-128 * scale * sum(x)`` per group.

The layout does not depend on the group size. Requirements: ``N % 16 == 0``, ``K % group == 0``,
``group`` in 32 / 64 / 128; any number of rows ``M >= 0``. A row's result does not depend on the
other rows of the batch or on the thread count (bitwise): every output is computed by the same
instructions in the same order. It can differ in the last bit between CPU models, as
``vdpbf16ps``'s internal rounding is the CPU's.

Speed (``bench/woq_kernel.py``; 2 threads of an AMD EPYC with AVX-512 BF16, 120 layers = 30
copies of the default model's 4 projection shapes, ~106 M weights a pass, ms a pass; one run on
a shared machine, where absolute times move by up to 20% between runs and the ratios less):

====  =========  =========  ==========  ==========  =====  ============  =========
rows  ours int4  ours int8  torch int4  torch int8  bf16   int4 / torch  int4/bf16
====  =========  =========  ==========  ==========  =====  ============  =========
1     3.4        6.0        4.0         8.3         13.6   0.84          0.25
2     3.8        6.2        4.9         10.1        14.3   0.78          0.27
4     4.7        6.7        6.4         11.7        13.1   0.73          0.36
8     6.6        8.5        11.2        22.5        14.5   0.59          0.46
16    10.7       11.4       21.8        33.5        17.1   0.49          0.62
====  =========  =========  ==========  ==========  =====  ============  =========

LM head (49152 x 576, one copy): 1 row 0.73 ms (torch int4 0.89, bf16 2.6), 4 rows 0.98 ms
(1.48, 2.2). Where other tenants halve the memory bandwidth, the memory-bound 1-4 row cases
lose the most (one such run: int4 / torch int4 0.99 at 1 row, 1.1 at 2-4 rows).

At 1 row both 4-bit kernels stream ~0.63 bytes a weight from memory. From 2 rows torch's int4
kernel is bound by widening its codes again for each 4 rows; this one widens each weight vector
once per 16 rows, is memory-bound up to ~4 rows and then bound by ``vdpbf16ps`` throughput
(~82% of its peak on one core at 16 rows; the per-group scale and offset FMAs take 1/9).

**AVX2 build** (``woq_avx2.cpp``, library ``sgrt_woq_avx2``; the default, see "Which build
runs" below; :func:`isa` says which runs): the same operator signature and code layout, with
integer dot products on quantized activations instead of float products. Each row of ``x`` is
quantized once per call, per block of 32 inputs (symmetric, in float32): ``a = max |x|``,
``t = x * (127 / a)``, ``q1 = round(t)`` (int8: llama.cpp's Q8 activation blocks,
``quantize_row_q8_1`` in ggml) and the remainder ``q2 = round((t - q1) * 254)`` (int8), so that
``x ~ dx * Q`` with ``Q = 254 q1 + q2`` and ``dx = a / 32258`` (a step of ``max|x| / 32258``,
~16-bit; q1 alone more than doubled the int4 model's KL against bfloat16). Per block and output
row the kernel computes ``isum = sum code * Q`` and ``qsum = sum Q`` exactly in integers, then
in float32 ``y += dx * (scale * isum + offset * qsum)``: exactly ``W @ (dx * Q)`` up to float32 rounding
(``tests/models/test_woq_kernel.py`` reproduces it bit for bit). 4-bit codes: a 64-byte chunk
(4 k-pairs x 16 rows) is two 256-bit loads whose low / high nibbles are u8 operands of
``vpmaddubsw`` against s8 vectors of (q[2p], q[2p+1]) pairs laid out to match (built once per
row, reused by every weight block): 16-bit lanes (row, k-pair), 8 pair sums a block (at most
30480: exact), one ``vpshufb`` + ``vpmaddwd`` a register per block to the s32 row sums, twice
(q1 with weight 254, q2). 8-bit codes: ``vpmovzxbw`` + ``vpmaddwd`` against the int16 Q pairs.
Its weight argument is :func:`fuse`'s single stream (codes, scales and offsets interleaved per
16-row block and group, in the order the kernel reads them; :func:`prepare` builds it at load,
and :func:`linear` fuses :func:`pack`'s codes per call where given those), prefetched 4 KB ahead
(one row against 8-bit codes: each thread's blocks read as 4 streams side by side instead);
the ``scales`` / ``offsets`` arguments are then not read, only checked (float16, and ``[n, k /
group]`` or empty: :class:`~sgrt.models.quant_native.GroupLinear` keeps only the stream). 8-bit
codes whose offsets are all ``-c * scale`` (:func:`symmetric_constant`: a GGUF's Q8_0 / Q5_0
blocks) get headers without the offsets (:func:`fuse` with ``c``; the kernel's ``bits`` argument is
then :func:`stream_bits` ``(8, c)``), rebuilt by the kernel in float32 with the same bits.
8-bit codes all below 32 (a GGUF's Q5_0 blocks) get, on a CPU with AVX-512 VNNI
(:func:`five_bit_streams`), :func:`fuse5`'s stream: the codes at 5 bits (the 4-bit layout's
nibbles plus masks of the fifth bits) and then the 8-bit stream of the same codes; one row (decode,
memory-bound) reads the 5-bit part, 0.65x the bytes, more rows the 8-bit part, with the same bits.
Rows of ``x`` go two at a time per weight load (four for 8-bit codes), in tiles whose expanded activations stay in L2;
integer sums are exact and every row's float32 steps are the same instructions in the same order,
so a row's result does not depend on the batch or the thread split (bitwise). NaN or infinity in
a block of ``x`` makes that row's outputs NaN; blocks with ``max |x| < 2**-100`` count as zero.
The operator ``sgrt_woq_avx2::linear_q8`` (``activations="int8"``, opt-in) is the same with
``Q = q1`` and ``dx = a / 127``: half the ``vpmaddubsw``, 1.3-1.5x the speed, less accurate
(docs/DESIGN.md).
Speed (``bench/woq_kernel.py``, this kernel against the previous AVX2 one, float32 FMAs on codes
widened to float32, built in the same run; 1 thread of the 2-core AMD EPYC, one run on a machine
loaded ~4x over, where the read bandwidth measured 4.4 GB/s instead of ~16): time ratio new / old
at 16 rows 0.36-0.55 (int4) and 0.25-0.36 (int8), at 256 rows 0.43-0.58 and 0.21-0.26, LM head
(49152 x 576 int8) 0.77 at 1 row and 0.33 at 16. At 1 row (``--rows 1 --passes 7``, same
machine state, 4.5 GB/s): int4 0.40-0.97, int8 0.50-0.89, streaming 2.5-3.5 GB/s (int4) of
weights, 56-78% of the measured read bandwidth: memory-bound, where the old kernel was not.

K-quant stream (:func:`fuse_kq4`, the kernel's ``bits`` argument :data:`KQ4_BITS`, group 32): a
GGUF's ``Q4_K`` weight as the file holds it, per 16-row block and super-block of 256 inputs a
320-byte header (float16 ``d``, ``dmin``; 6-bit scales and mins as bytes) before the 8 groups'
4-bit codes in the layout above; every 4-bit path rebuilds each group's scale ``d * sc`` and
offset ``dmin * -mn`` in float32 (exact) where it would widen the stored float16 ones: 4.625 bits a
weight against 5, and the file's weights bit for bit (docs/DESIGN.md, "K-quant stream").

Build: compiled on first use (~10 s on 2 cores, mostly torch's headers) and cached by
:func:`sgrt.kernels.build.load_library`, which a later process loads from (~0.05 s).
``SGRT_NATIVE_KERNELS=0`` disables it (:func:`available` is then False).

Which build runs: the AVX2 one on every CPU with AVX2 + FMA + F16C, AVX-512 ones included; the
AVX-512 BF16 build only where ``SGRT_WOQ_ISA=avx512_bf16`` asks for it (to test or time it). On
an AVX-512 BF16 Xeon the AVX2 build decoded faster against the same llama.cpp runs (SmolLM2 int4
1.76x llama.cpp against 1.32x, Gemma 3 int4 1.48x against 0.99x: ``bench/vs_llamacpp.py``,
docs/DESIGN.md), prefilled as fast or faster (351.8 against 322.5 tok/s, 507.2 against 372.6), and
quantizes activations to ~16 bits instead of bfloat16's 8. Inside the AVX2 build, where the CPU has
AVX-512 VNNI, its multi-row prefill tiles run as 512-bit ``vpdpwssd`` kernels (bitwise the same
outputs; ``SGRT_WOQ_AVX512=0`` keeps them off, read once per process; docs/DESIGN.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from sgrt.kernels.build import disabled, load_library, operator_entry

SOURCE = Path(__file__).with_name("woq_cpu.cpp")
# The AVX2 + FMA build of the same operator (``woq_avx2.cpp``) for CPUs without AVX-512 BF16.
SOURCE_AVX2 = Path(__file__).with_name("woq_avx2.cpp")
REQUIRED_CPU_FLAGS_AVX2 = ("avx2", "fma", "f16c")
# -ffp-contract=off: the epilogue's multiplies and adds stay separate roundings (tests reproduce them)
CFLAGS_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
BLOCK_N = 16
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)
# the AVX2 build's activation precisions: ~16-bit (default), int8 (opt-in, linear_q8), int8 for
# calls of >= PREFILL_ROWS rows only (linear_q8_prefill: prefill / extend chunks)
ACTIVATIONS = ("int16", "int8", "int8-prefill")
PREFILL_ROWS = 32  # (Q8_PREFILL_ROWS in woq_avx2.cpp)
_OPS = {"int16": "linear", "int8": "linear_q8", "int8-prefill": "linear_q8_prefill"}
# Checked before the library is built or loaded: its code is AVX-512 throughout, and loading it on
# another CPU could crash the process.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "f16c")
CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"]

_state: dict[str, object] = {}


def available() -> bool:
    """Whether a native kernel can run here: the AVX2 one (``REQUIRED_CPU_FLAGS_AVX2`` in
    ``/proc/cpuinfo``; the AVX-512 BF16 one instead where ``SGRT_WOQ_ISA=avx512_bf16`` asks for
    it and ``REQUIRED_CPU_FLAGS`` are there; see :func:`isa`), with
    ``SGRT_NATIVE_KERNELS`` not ``0`` and the library compiled and loaded
    (:func:`sgrt.kernels.build.load_library`: ~10 s on the first call, cached on disk after).
    Never raises: a warning says why not. Cached per process."""
    if "op" in _state and not disabled():
        return True
    _state.pop("op", None)
    _state.pop("isa", None)
    from sgrt.kernels.build import cpu_flags

    if all(f in cpu_flags() for f in REQUIRED_CPU_FLAGS) and os.environ.get("SGRT_WOQ_ISA", "") == "avx512_bf16":
        if load_library("sgrt_woq", SOURCE, CFLAGS, REQUIRED_CPU_FLAGS) is None:
            _state["op"] = operator_entry(torch.ops.sgrt_woq.linear.default)  # 120 calls a decode step
            _state["isa"] = "avx512_bf16"
            return True
        if disabled():  # its one warning said so; the AVX2 build is off too
            return False
    if load_library("sgrt_woq_avx2", SOURCE_AVX2, CFLAGS_AVX2, REQUIRED_CPU_FLAGS_AVX2) is not None:
        return False
    _state["op"] = operator_entry(torch.ops.sgrt_woq_avx2.linear.default)
    _state["isa"] = "avx2"
    return True


def isa() -> str | None:
    """Which build :func:`available` loaded: ``"avx512_bf16"`` (``woq_cpu.cpp``), ``"avx2"``
    (``woq_avx2.cpp``: integer dot products on ~16-bit quantized activations), or None."""
    return _state.get("isa") if available() else None


def _check_codes(codes: torch.Tensor, bits: int) -> tuple[int, int]:
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D uint8 tensor [N, K], got "
                         f"{getattr(codes, 'dtype', type(codes).__name__)} {tuple(getattr(codes, 'shape', ()))}")
    n, k = codes.shape
    if n == 0 or n % BLOCK_N:
        raise ValueError(f"codes: N (output features) must be a positive multiple of {BLOCK_N}, got {n}")
    if k == 0 or k % 32:
        raise ValueError(f"codes: K (input features) must be a positive multiple of 32, got {k}")
    return n, k


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` uint8 (0..15 for ``bits=4``, 0..255 for ``bits=8``) -> the kernel's packed
    weight: 1-D uint8 of ``N * K * bits / 8`` bytes (layout in the module docstring).

    Raises:
        ValueError: ``bits`` not 4 / 8, ``codes`` not 2-D uint8, ``N % 16``, ``K % 32``, or a
            4-bit code above 15.
    """
    import numpy as np

    n, k = _check_codes(codes, bits)
    codes = codes.cpu().contiguous()
    # NOTE: the two codes of a k-pair are adjacent in the input and in the output, so they move as
    # one 16-bit word (numpy: torch has no uint16 shifts), a third of the time of moving bytes.
    pairs = codes.numpy().view(np.uint16)  # [N, K/2]: k-pair p of row r
    nb = n // BLOCK_N
    if bits == 8:
        # word w of k-pair p in block b: code[16 b + w // 2, 2 p + w % 2]  -> [blocks, K/2, 16 rows]
        return torch.from_numpy(np.ascontiguousarray(pairs.reshape(nb, BLOCK_N, k // 2).transpose(0, 2, 1))
                                .view(np.uint8).reshape(-1))
    if int(codes.max()) > 15:
        raise ValueError(f"codes: bits=4 needs codes in 0..15, got a maximum of {int(codes.max())}")
    # chunks of 4 vectors (k-pairs 4c .. 4c+3) of 32 words: byte (L, s, i) of chunk c = word i of
    # lane L of vector s | that of vector 2 + s << 4, word i = code[16 b + 4 L + i // 2, 2 (4 c + v) + i % 2].
    # As k-pairs: [blocks, lane L, row h, chunk c, half (v // 2), s] -> [blocks, c, half, L, s, h]
    x = np.ascontiguousarray(pairs.reshape(nb, 4, 4, k // 8, 2, 2).transpose(0, 3, 4, 1, 5, 2))
    # (codes <= 15: a 16-bit shift by 4 never carries into the other byte)
    return torch.from_numpy(((x[:, :, 1] << 4) | x[:, :, 0]).view(np.uint8).reshape(-1))


def unpack(packed: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: codes ``[n, k]`` uint8.

    Raises:
        ValueError: ``packed`` not uint8 with ``n * k * bits / 8`` elements, or bad ``n``/``k``/``bits``.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if n <= 0 or n % BLOCK_N or k <= 0 or k % 32:
        raise ValueError(f"n must be a positive multiple of {BLOCK_N} and k of 32, got n={n}, k={k}")
    extra = packed.numel() - n * k * bits // 8
    if packed.dtype == torch.uint8 and extra > 0 and extra % (4 * n) == 0 and k // (extra // (4 * n)) in GROUP_SIZES:
        packed = unfuse(packed, n, k, bits, k // (extra // (4 * n)))[0]  # (the AVX2 kernel's stream)
    if packed.dtype != torch.uint8 or packed.numel() != n * k * bits // 8:
        raise ValueError(f"packed must be uint8 with n*k*bits/8={n * k * bits // 8} elements, "
                         f"got {packed.dtype} with {packed.numel()}")
    if bits == 8:
        vec = packed.reshape(n // BLOCK_N, k // 2, 32)
    else:
        b = packed.reshape(n // BLOCK_N, k // 8, 4, 2, 8)  # [blocks, K/8, L, s, i]
        lo = (b & 0x0F).permute(0, 1, 3, 2, 4)  # [blocks, K/8, s, L, i]
        hi = (b >> 4).permute(0, 1, 3, 2, 4)
        vec = torch.cat([lo, hi], dim=2).reshape(n // BLOCK_N, k // 2, 32)
    return vec.reshape(n // BLOCK_N, k // 2, BLOCK_N, 2).permute(0, 2, 1, 3).reshape(n, k).contiguous()


def symmetric_constant(scales: torch.Tensor, offsets: torch.Tensor) -> int:
    """The integer ``c`` in 1..255 with ``offsets == -c * scales`` in every group, compared bit for
    bit in float32 (the value the AVX2 kernel rebuilds, ``float(scale) * -c``, against the value
    the stored float16 offset widens to), or 0 where there is none (an asymmetric group, a
    different ``c`` per group, or every scale zero). Llama.cpp's ``Q8_0`` read as codes
    ``q + 128`` gives 128, ``Q5_0`` as codes ``q`` 16 (:mod:`sgrt.models.gguf_raw`).

    Args:
        scales, offsets: ``[n, k / group]`` float16 (any matching shapes)."""
    s, o = scales.float(), offsets.float()
    nz = s != 0
    if s.shape != o.shape or not bool(nz.any()):
        return 0
    i = int(nz.reshape(-1).nonzero()[0])
    c = -o.reshape(-1)[i].item() / s.reshape(-1)[i].item()
    if not (c == c and 1 <= round(c) <= 255):
        return 0
    c = round(c)
    return c if torch.equal((s * -float(c)).view(torch.int32), o.view(torch.int32)) else 0


def stream_bits(bits: int, c: int = 0) -> int:
    """The AVX2 kernel's ``bits`` argument for a stream of ``bits``-bit codes: ``bits`` itself
    (group headers with offsets), or ``bits + 256 * c`` for :func:`fuse`'s compact headers
    (8-bit codes, every offset ``-c * scale``: :func:`symmetric_constant`); ``bits`` 5 for
    :func:`fuse5`'s streams of 8-bit codes below 32. (:data:`KQ4_BITS`: :func:`fuse_kq4`'s.)"""
    return bits + 256 * c


# The AVX2 kernel's ``bits`` argument for :func:`fuse_kq4`'s K-quant stream (4-bit codes under
# Q4_K super-block headers): 4 plus this flag bit.
KQ_FLAG = 1 << 16
KQ4_BITS = 4 + KQ_FLAG
KQ_SUPER = 256  # inputs per K-quant super-block (8 groups of 32)
KQ_HEADER_BYTES = 320  # per 16-row block and super-block: 16 d, 16 dmin (float16), 8 x 16 sc, 8 x 16 mn


def stream_format(kernel_bits: int) -> tuple[int, int]:
    """The inverse of :func:`stream_bits`: (code width, ``c``; 0 for headers with offsets and for
    :data:`KQ4_BITS`, see :func:`is_kquant`)."""
    return kernel_bits & 255, (kernel_bits >> 8) & 255


def is_kquant(kernel_bits: int) -> bool:
    """Whether the kernel's ``bits`` argument names :func:`fuse_kq4`'s K-quant stream."""
    return bool(kernel_bits & KQ_FLAG)


def fuse_kq4(packed: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
             n: int, k: int) -> torch.Tensor:
    """A GGUF's ``Q4_K`` weight as it is (:class:`sgrt.models.gguf_raw.KQ4Weight`) -> the AVX2
    kernel's K-quant stream (1-D uint8, :func:`stream_bytes` ``(n, k, KQ4_BITS)`` = ``n * k * 37 /
    64`` bytes: 4.625 bits a weight), taken with ``bits = KQ4_BITS`` and ``group = 32``: per block
    of 16 output features, per super-block of 256 inputs in k order, a 320-byte header (the 16
    rows' float16 ``d``, then their 16 float16 ``dmin``, then the scales ``sc[j][row]`` for groups
    ``j = 0..7`` as 128 bytes, then the mins ``mn[j][row]`` likewise), followed by the 8 groups'
    codes exactly as :func:`fuse` lays out a 32-input group's 4-bit codes (:func:`pack`'s). The
    kernel computes group ``j``'s scale ``d * sc[j]`` and offset ``dmin * -mn[j]`` in float32 (exact),
    so it multiplies by the file's weights, those of ``gguf``'s dequantize.

    Args:
        packed: :func:`pack` ``(codes, 4)``: ``n * k / 2`` uint8.
        d, dmin: ``[n, k / 256]`` float16. sc, mn: ``[n, k / 32]`` uint8, each below 64.

    Raises:
        ValueError: ``n`` not a positive multiple of 16, ``k`` of 256; sizes or dtypes that do not
            match; a scale or min of 64 or more.
    """
    if n <= 0 or n % BLOCK_N or k <= 0 or k % KQ_SUPER:
        raise ValueError(f"n must be a positive multiple of {BLOCK_N} and k of {KQ_SUPER}; got n={n}, k={k}")
    nb, s, g = n // BLOCK_N, k // KQ_SUPER, k // 32
    if (packed.dtype != torch.uint8 or packed.numel() != n * k // 2
            or any(t.dtype != torch.float16 or t.shape != (n, s) for t in (d, dmin))
            or any(t.dtype != torch.uint8 or t.shape != (n, g) for t in (sc, mn))):
        raise ValueError(f"packed must be uint8 with n*k/2={n * k // 2} elements, d / dmin float16 [{n}, {s}], "
                         f"sc / mn uint8 [{n}, {g}]; got {packed.dtype} {packed.numel()}, {d.dtype} "
                         f"{tuple(d.shape)}, {dmin.dtype} {tuple(dmin.shape)}, {sc.dtype} {tuple(sc.shape)}, "
                         f"{mn.dtype} {tuple(mn.shape)}")
    if int(sc.max()) > 63 or int(mn.max()) > 63:
        raise ValueError("sc / mn: K-quant scales and mins have 6 bits (0..63)")
    codes = packed.reshape(nb, s, 8 * BLOCK_N * 16)  # a super-block's 8 groups of 16 x 32 codes

    def per_row(t: torch.Tensor, per: int) -> torch.Tensor:  # [n, s * per] -> [nb, s, per * 16] (group major)
        return t.reshape(nb, BLOCK_N, s, per).permute(0, 2, 3, 1).reshape(nb, s, per * BLOCK_N)

    head = torch.cat([per_row(d, 1).contiguous().view(torch.uint8), per_row(dmin, 1).contiguous().view(torch.uint8),
                      per_row(sc, 8), per_row(mn, 8)], dim=2)
    return torch.cat([head, codes], dim=2).reshape(-1)


def fuse_q4_k(blocks: Any, n: int, k: int) -> torch.Tensor:
    """GGUF ``Q4_K`` super-blocks of ``n`` rows of ``k`` weights (``[n, k / 256 * 144]`` uint8
    numpy, ggml's ``block_q4_K``) -> the K-quant stream :func:`fuse_kq4` makes of
    :func:`sgrt.models.gguf_raw.unpack_q4_k_super`'s fields (the same bytes; those two are its
    reference, ``tests/models/test_weight_packer.py``), in one pass of the AVX2 library's
    ``fuse_q4_k`` (the K-quant stream is that build's alone). Group ``j``'s codes are the low (even
    ``j``) or high nibbles of 32 of the super-block's bytes, so a chunk byte's two codes are the
    same nibble of two of them (as in :func:`fuse_q4_1`).

    Raises:
        ValueError: ``n`` not a positive multiple of 16, ``k`` of 256, or ``blocks`` not that size.
        RuntimeError: the AVX2 library is not loaded.
    """
    import numpy as np

    if n <= 0 or n % BLOCK_N or k <= 0 or k % KQ_SUPER or blocks.shape != (n, k // KQ_SUPER * 144) \
            or blocks.dtype != np.uint8:
        raise ValueError(f"blocks must be uint8 [n, k / 256 * 144] with n a multiple of {BLOCK_N}, k of "
                         f"{KQ_SUPER}; got {blocks.dtype} {tuple(blocks.shape)} for n={n}, k={k}")
    if isa() != "avx2":
        raise RuntimeError("sgrt.kernels.woq.fuse_q4_k needs the AVX2 library, which is not loaded")
    return torch.ops.sgrt_woq_avx2.fuse_q4_k(torch.from_numpy(np.ascontiguousarray(blocks)), n, k)


def unfuse_kq4(stream: torch.Tensor, n: int, k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_kq4`: (packed codes, ``d``, ``dmin``, ``sc``, ``mn``)."""
    nb, s = n // BLOCK_N, k // KQ_SUPER
    v = stream.reshape(nb, s, KQ_HEADER_BYTES + 8 * BLOCK_N * 16)
    head = v[:, :, :KQ_HEADER_BYTES]

    def rows(t: torch.Tensor, per: int) -> torch.Tensor:  # [nb, s, per * 16] -> [n, s * per]
        return t.reshape(nb, s, per, BLOCK_N).permute(0, 3, 1, 2).reshape(n, s * per).contiguous()

    d = rows(head[:, :, 0:32].contiguous().view(torch.float16), 1)
    dmin = rows(head[:, :, 32:64].contiguous().view(torch.float16), 1)
    return (v[:, :, KQ_HEADER_BYTES:].reshape(-1).contiguous(), d, dmin, rows(head[:, :, 64:192], 8),
            rows(head[:, :, 192:320], 8))


def fuse(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, n: int, k: int, bits: int,
         group: int = 32, c: int = 0) -> torch.Tensor:
    """:func:`pack`'s codes with their scales and offsets -> the AVX2 kernel's single stream
    (1-D uint8, ``n * k * bits / 8 + 4 * n * k / group`` bytes): per block of 16 output features,
    per group in k order, a 64-byte header (the 16 rows' float16 scales, then their 16 offsets)
    followed by that group's codes exactly as :func:`pack` lays them out (a block's codes are in
    k order, so a group's are one run of ``16 * group * bits / 8`` bytes).

    ``c > 0`` (8-bit codes, every offset ``-c * scale`` bit for bit: :func:`symmetric_constant`):
    the compact stream, whose headers hold the 16 scales alone (32 bytes; ``n * k * bits / 8 + 2 *
    n * k / group`` bytes in all: 544 instead of 576 a group of 16 x 32 int8 codes), taken by the
    kernel with ``bits = stream_bits(8, c)``; it rebuilds the offsets in float32, with the same
    bits as the stored ones (the same outputs, bit for bit).

    Raises:
        ValueError: sizes that do not match ``n``, ``k``, ``bits``, ``group``; ``c`` not 0, or
            not the symmetric constant of 8-bit codes' scales and offsets.
    """
    if group not in GROUP_SIZES or n <= 0 or n % BLOCK_N or k <= 0 or k % group:
        raise ValueError(f"n must be a positive multiple of {BLOCK_N}, k of group in {GROUP_SIZES}; "
                         f"got n={n}, k={k}, group={group}")
    nb, g = n // BLOCK_N, k // group
    if (bits not in BITS or packed.dtype != torch.uint8 or packed.numel() != n * k * bits // 8
            or any(t.dtype != torch.float16 or t.shape != (n, g) for t in (scales, offsets))):
        raise ValueError(f"packed must be uint8 with n*k*bits/8={n * k * bits // 8} elements and scales / "
                         f"offsets float16 [{n}, {g}]; got {packed.dtype} {packed.numel()}, "
                         f"{scales.dtype} {tuple(scales.shape)}, {offsets.dtype} {tuple(offsets.shape)}")
    if c and (bits != 8 or not torch.equal((scales.float() * -float(c)).view(torch.int32),
                                           offsets.float().view(torch.int32))):
        raise ValueError(f"c={c}: the compact stream needs 8-bit codes whose every offset is -c * scale")
    codes = packed.reshape(nb, g, BLOCK_N * group * bits // 8)
    head = torch.cat([t.reshape(nb, BLOCK_N, g).transpose(1, 2) for t in ((scales,) if c else (scales, offsets))],
                     dim=2)
    return torch.cat([head.contiguous().view(torch.uint8), codes], dim=2).reshape(-1)


def fuse_q4_1(blocks: Any, n: int, k: int, native: bool = True) -> torch.Tensor:
    """GGUF ``Q4_1`` blocks of ``n`` rows of ``k`` weights (``[n, k / 32 * 20]`` uint8 numpy:
    ``block_q4_1``'s float16 ``d``, ``m`` and 16 bytes of nibbles, weight ``t`` in the low nibble
    of byte ``t`` for ``t < 16``, else the high nibble of byte ``t - 16``) -> the stream
    ``fuse(pack(codes, 4), d, m, n, k, 4)`` gives (the same bytes), without the codes a byte each:
    a chunk byte's two codes (inputs ``x`` and ``x + 4``, :func:`pack`) are both low or both high
    nibbles of the block's bytes ``x`` and ``x + 4``, so four 32-bit words of a block give its 16
    bytes of chunks in four masks and shifts, and one transposed copy puts them in place. Run by
    the AVX2 library where it is loaded (``native``; its ``fuse_q4_1``, one pass), else numpy.

    Raises:
        ValueError: ``n`` not a positive multiple of 16, ``k`` of 32, or ``blocks`` not that size.
    """
    import numpy as np

    if n <= 0 or n % BLOCK_N or k <= 0 or k % 32 or blocks.shape != (n, k // 32 * 20) or blocks.dtype != np.uint8:
        raise ValueError(f"blocks must be uint8 [n, k / 32 * 20] with n a multiple of {BLOCK_N}, k of 32; got "
                         f"{blocks.dtype} {tuple(blocks.shape)} for n={n}, k={k}")
    if native and isa() == "avx2":  # (the same bytes in one pass: ~5x faster)
        return torch.ops.sgrt_woq_avx2.fuse_q4_1(torch.from_numpy(np.ascontiguousarray(blocks)), n, k)
    nb, g = n // BLOCK_N, k // 32
    b = np.ascontiguousarray(blocks).reshape(n, g, 20)
    w = b[:, :, 4:].view(np.uint32)  # [n, g, 4]: the block's nibble bytes 0-3, 4-7, 8-11, 12-15
    x, x4 = w[:, :, 0::2], w[:, :, 1::2]  # bytes x = 0-3 / 8-11 and their partners x + 4
    low = np.uint32(0x0F0F0F0F)
    # [n, g, chunk of the group]: chunks 0, 1 from the low nibbles, 2, 3 from the high ones
    chunks = np.concatenate([(x & low) | ((x4 & low) << 4), ((x >> 4) & low) | (x4 & ~low)], axis=2)
    # a chunk's 16-bit words (k-pair s of row 4 L + h) -> [block, group, chunk, L, s, h]
    words = chunks.view(np.uint16).reshape(nb, 4, 4, g, 4, 2).transpose(0, 3, 4, 1, 5, 2)
    out = np.empty((nb, g, 32 + 128), np.uint16)
    # the header: the 16 rows' d, then their m
    out[:, :, :32] = b[:, :, :4].view(np.uint16).reshape(nb, BLOCK_N, g, 2).transpose(0, 2, 3, 1).reshape(nb, g, 32)
    out[:, :, 32:] = words.reshape(nb, g, 128)
    return torch.from_numpy(out.view(np.uint8).reshape(-1))


def quantize_fuse(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Float rows ``[n, k]`` (float32 or bfloat16) -> the AVX2 kernel's stream of their group-wise
    codes (groups of 32): exactly ``fuse(pack(codes, bits), scales, offsets, n, k, bits)`` of
    :func:`sgrt.models.quant_native.quantize_groups`'s ``(codes, scales, offsets)``, bit for bit
    (the same float32 operations, one rounding each; ``tests/models/test_weight_packer.py`` holds
    them equal; only where a group's least or greatest value is a zero held both as -0 and +0 may
    the sign of a zero scale or offset differ, the same value), in one pass of the AVX2 library's ``quantize_fuse`` instead of ~6 passes of torch
    and numpy (~6x faster). Needs that library (:func:`isa` ``== "avx2"``).

    Raises:
        ValueError: ``bits`` not 4 / 8, a shape the stream cannot take (``n % 16``, ``k % 32``), a
            dtype other than float32 / bfloat16, or weights beyond float16's range (a NaN, an
            infinity, a group whose scale or offset overflows float16), as ``quantize_groups``.
        RuntimeError: the AVX2 library is not loaded.
    """
    if bits not in BITS or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight must be 2-D float32 or bfloat16 and bits 4 or 8; got {weight.dtype} "
                         f"{tuple(weight.shape)}, bits={bits!r}")
    n, k = weight.shape
    if n <= 0 or n % BLOCK_N or k <= 0 or k % 32:
        raise ValueError(f"n must be a positive multiple of {BLOCK_N} and k of 32, got n={n}, k={k}")
    if isa() != "avx2":
        raise RuntimeError("sgrt.kernels.woq.quantize_fuse needs the AVX2 library, which is not loaded")
    stream = torch.ops.sgrt_woq_avx2.quantize_fuse(weight.contiguous(), n, k, bits)
    if stream.numel() == 0:
        raise ValueError("weights not finite in float16 (a NaN, an infinity, or beyond its range)")
    return stream


def unfuse(fused: torch.Tensor, n: int, k: int, bits: int, group: int = 32
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse` and :func:`fuse5`: (packed codes, scales ``[n, k / group]``
    float16, offsets). ``bits``: the kernel's argument (:func:`stream_bits`; a compact stream's
    offsets are rebuilt, ``-c * scale``, exactly the ones it was fused from; a 5-bit stream gives
    its 8-bit part's, :func:`pack`'s 8-bit codes). A K-quant stream (:data:`KQ4_BITS`) gives its
    groups' scales ``d * sc`` and offsets ``-(dmin * mn)`` as float32 (exact; float16 cannot hold
    them)."""
    if is_kquant(bits):
        packed, d, dmin, sc, mn = unfuse_kq4(fused, n, k)
        per = KQ_SUPER // 32
        return (packed, d.float().repeat_interleave(per, dim=1) * sc.float(),
                -(dmin.float().repeat_interleave(per, dim=1) * mn.float()))
    bits, c = stream_format(bits)
    nb, g = n // BLOCK_N, k // group
    hb = 32 if c else 64
    if bits == 5:  # (the 8-bit stream that follows the 5-bit one: fuse5)
        bits, fused = 8, split5(fused, n, k, group, c)[1]
    v = fused.reshape(nb, g, hb + BLOCK_N * group * bits // 8)
    head = v[:, :, :hb].contiguous().view(torch.float16)  # [nb, g, 16 or 32]
    scales = head[:, :, :BLOCK_N].transpose(1, 2).reshape(n, g).contiguous()
    if c:
        offsets = (scales.float() * -float(c)).half()
    else:
        offsets = head[:, :, BLOCK_N:].transpose(1, 2).reshape(n, g).contiguous()
    return v[:, :, hb:].reshape(-1).contiguous(), scales, offsets


# A 5-bit stream's bytes per 16 rows x 32 inputs: the low 4 bits as pack()'s 4-bit chunks, then
# per chunk two 64-bit masks of the fifth bits (of the codes in the chunk bytes' low, then high nibbles).
_FIVE_BYTES = 320
_BIT_WEIGHTS = 1 << torch.arange(8, dtype=torch.int32)


def fuse5(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int = 32, c: int = 0
          ) -> torch.Tensor:
    """8-bit group codes below 32 (a GGUF's ``Q5_0`` blocks: :mod:`sgrt.models.gguf_raw`) with their
    scales and offsets -> the AVX2 kernel's 5-bit stream (1-D uint8), taken with ``bits =
    stream_bits(5, c)``: per block of 16 output features and group, :func:`fuse`'s header (the
    compact one for ``c > 0``), then per 32 inputs the codes' low 4 bits exactly as :func:`pack`
    lays out 4-bit codes (256 bytes) and their fifth bits as two little-endian 64-bit masks per
    64-byte chunk (bit ``j``: the code in the low, then the high nibble of the chunk's byte ``j``;
    64 bytes); then :func:`fuse`'s 8-bit stream of the same codes. One row on an AVX-512 VNNI CPU
    reads the 5-bit part (0.65x the 8-bit stream's bytes), everything else the 8-bit part; the
    outputs are bitwise those of the 8-bit stream either way.

    Args:
        codes: ``[n, k]`` uint8, each below 32. scales, offsets: ``[n, k / group]`` float16.
        c: 0 (headers with offsets) or :func:`symmetric_constant` of scales and offsets.

    Raises:
        ValueError: a code above 31, or what :func:`fuse` raises for these sizes and ``c``.
    """
    n, k = _check_codes(codes, 8)
    if int(codes.max()) > 31:
        raise ValueError(f"codes: a 5-bit stream needs codes in 0..31, got a maximum of {int(codes.max())}")
    # (fuse checks sizes, group and c, and gives the headers: those of an 8-bit stream of these codes)
    full = fuse(pack(codes, 8), scales, offsets, n, k, 8, group, c)
    nb, g, hb = n // BLOCK_N, k // group, 32 if c else 64
    head = full.reshape(nb, g, hb + BLOCK_N * group)[:, :, :hb]
    nibbles = pack(codes & 15, 4).reshape(nb, k // 32, 256)  # [blocks, 32-input blocks, 4 chunks of 64]
    fifth = pack(codes >> 4, 4).reshape(nb, k // 32, 4, 64)  # (each nibble 0 or 1)
    masks = torch.stack([fifth & 1, fifth >> 4], dim=3).reshape(nb, k // 32, 4, 2, 8, 8).to(torch.int32)
    mask_bytes = (masks * _BIT_WEIGHTS).sum(-1).to(torch.uint8).reshape(nb, k // 32, 64)
    five = torch.cat([nibbles, mask_bytes], dim=2).reshape(nb, g, group // 32 * _FIVE_BYTES)
    return torch.cat([torch.cat([head, five], dim=2).reshape(-1), full])


def split5(stream: torch.Tensor, n: int, k: int, group: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fuse5`'s stream as (its 5-bit part, what one row reads on an AVX-512 VNNI CPU; its
    8-bit part, :func:`fuse`'s stream of the same codes), views of ``stream``."""
    five = n // BLOCK_N * (k // group) * (32 if c else 64) + n * k * 5 // 8
    return stream[:five], stream[five:]


def stream_bytes(n: int, k: int, kernel_bits: int, group: int = 32) -> int:
    """Bytes of the AVX2 build's stream of an ``n`` x ``k`` weight taken with ``kernel_bits``
    (:func:`stream_bits`): :func:`fuse`'s (a 64-byte header a block of 16 rows and group, 32 for
    the compact one, then the codes), or :func:`fuse5`'s (its 5-bit part, then the 8-bit stream)."""
    if is_kquant(kernel_bits):
        return n // BLOCK_N * (k // KQ_SUPER) * (KQ_HEADER_BYTES + BLOCK_N * KQ_SUPER // 2)
    bits, c = stream_format(kernel_bits)
    headers = n // BLOCK_N * (k // group) * (32 if c else 64)
    if bits == 5:
        return headers + n * k * 5 // 8 + headers + n * k
    return headers + n * k * bits // 8


def _row_positions(bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where row ``w`` (0..15) of a 16-row block keeps the code of input ``j`` of a group:
    (byte offsets ``[16, group]`` into the group's :func:`pack`-ed codes, bit shifts ``[16, group]``).
    8-bit: k-pair ``j // 2``'s 32-byte vector, word ``2 w + j % 2``. 4-bit: the 64-byte chunk
    ``j // 8``, vector ``v = (j // 2) % 4``, word ``2 w + j % 2`` at byte ``16 L + 8 (v % 2) + i``
    (``L, i = divmod(word, 8)``), in the high nibble for ``v >= 2`` (the module docstring)."""
    w = torch.arange(BLOCK_N).unsqueeze(1)
    j = torch.arange(group).unsqueeze(0)
    word = 2 * w + j % 2
    if bits == 8:
        return (j // 2) * 32 + word, torch.zeros(BLOCK_N, group, dtype=torch.long)
    v = (j // 2) % 4
    return 64 * (j // 8) + 16 * (word // 8) + 8 * (v % 2) + word % 8, 4 * (v >= 2).long().expand(BLOCK_N, group)


def gather_rows(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, n: int, k: int,
                kernel_bits: int, group: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the weight ``scale * code + offset`` in float32, ``[len(rows), k]``, read
    straight from the kernel's layout (an embedding lookup in a quantized table, which may be a
    tied LM head's weight): :func:`prepare`'s AVX2 stream (``scales`` / ``offsets`` empty) or
    :func:`pack`'s codes with their ``scales`` / ``offsets`` ``[n, k / group]``. The values are
    those of :func:`dequantize` (the same float32 multiply and add). Reads ``len(rows) * k``
    codes, not the blocks they sit in.

    Args:
        rows: int64 ``[T]``, each in ``0 .. n - 1``.

    Raises:
        IndexError: a row out of range.
        ValueError: a K-quant stream (:data:`KQ4_BITS`; never an embedding's form).
    """
    if is_kquant(kernel_bits):
        raise ValueError("gather_rows: a K-quant stream is not an embedding table's form")
    bits, c = stream_format(kernel_bits)
    fused = scales.numel() == 0
    if fused and bits == 5:  # (the 8-bit stream that follows the 5-bit one)
        packed, bits = split5(packed, n, k, group, c)[1], 8
    rows = rows.reshape(-1).long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise IndexError(f"row out of range 0..{n - 1}")
    g, codes_bytes = k // group, BLOCK_N * group * bits // 8
    header = (32 if c else 64) if fused else 0
    per_group = header + codes_bytes
    pos, shift = _row_positions(bits, group)
    b, w = rows // BLOCK_N, rows % BLOCK_N
    base = (b * g).unsqueeze(1) + torch.arange(g).unsqueeze(0)  # [T, g]: (block, group) index
    at = (base * per_group + header).unsqueeze(-1) + pos[w].unsqueeze(1)  # [T, g, group]
    codes = ((packed[at] >> shift[w].unsqueeze(1).to(torch.uint8)) & (255 if bits == 8 else 15)).float()
    if fused:  # float16 scale of row w at header bytes 2w, offset at 32 + 2w (compact: -c * scale)
        lo = (base * per_group).unsqueeze(-1) + 2 * w.view(-1, 1, 1) + torch.arange(2)
        scale = packed[lo].view(torch.float16).float()  # [T, g, 1]
        if c:
            offset = (scale.half().float() * -float(c)).half().float()
        else:
            offset = packed[lo + 2 * BLOCK_N].view(torch.float16).float()
    else:
        scale, offset = scales[rows].float().unsqueeze(-1), offsets[rows].float().unsqueeze(-1)
    return (codes * scale + offset).reshape(-1, k)


def five_bit_streams() -> bool:
    """Whether :func:`prepare` gives 8-bit codes below 32 the 5-bit stream (:func:`fuse5`): on the
    AVX2 build where the CPU has AVX-512 VNNI (whose one-row kernel reads it; elsewhere the kernel
    reads only its 8-bit part), unless ``SGRT_WOQ5=0`` or ``SGRT_WOQ_AVX512=0``. It costs the 5-bit
    codes' bytes beside the 8-bit ones (Gemma 3 270M Q4_K_M: +38 MB)."""
    from sgrt.kernels.build import cpu_flags

    if isa() != "avx2" or os.environ.get("SGRT_WOQ5", "") == "0" or os.environ.get("SGRT_WOQ_AVX512", "") == "0":
        return False
    return all(f in cpu_flags() for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"))


def prepare(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, n: int, k: int, bits: int,
            group: int = 32) -> tuple[torch.Tensor, int]:
    """(the weight argument the loaded kernel takes, its ``bits`` argument): :func:`fuse`'s stream
    for the AVX2 build (codes, scales and offsets in one sequential run; the compact one, with
    ``bits = stream_bits(8, c)``, for 8-bit codes whose offsets are all ``-c * scale``:
    :func:`symmetric_constant`; the 5-bit one, :func:`fuse5`, for 8-bit codes that are all below 32
    where :func:`five_bit_streams`), :func:`pack`'s codes and ``bits`` for the AVX-512 one. Done
    once at load (:class:`sgrt.models.quant_native.GroupLinear`)."""
    if isa() != "avx2":
        return packed, bits
    c = symmetric_constant(scales, offsets) if bits == 8 else 0
    if bits == 8 and five_bit_streams():
        codes = unpack(packed, n, k, 8)
        if int(codes.max()) <= 31:  # (a GGUF's Q5_0 blocks: the file's 5 bits, not 8)
            return fuse5(codes, scales, offsets, group, c), stream_bits(5, c)
    return fuse(packed, scales, offsets, n, k, bits, group, c), stream_bits(bits, c)


def check_activations(activations: str) -> None:
    """``activations`` is ``"int16"`` (the default: ~16-bit activations, ``Q = 254 q1 + q2``),
    ``"int8"`` (the opt-in: q1 alone, a step of ``max|x| / 127`` per block of 32, llama.cpp's Q8
    activation blocks) or ``"int8-prefill"`` (int8 for calls of at least :data:`PREFILL_ROWS`
    rows, 16-bit below: prefill / extend chunks, where the kernel is compute-bound, get the speed;
    decode keeps the accuracy), and the loaded build takes it: the int8 ones only on the AVX2 build
    (``linear_q8``, ``linear_q8_prefill``; the AVX-512 BF16 build multiplies bfloat16 x exactly).

    Raises:
        ValueError: another value, or an int8 one where the AVX2 build is not the one loaded.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations != "int16" and isa() != "avx2":
        raise ValueError(f"activations={activations!r} needs the AVX2 build of the kernel; this one is {isa()!r}")


def op_name(activations: str = "int16") -> str | None:
    """The registered name of the operator :func:`kernel` returns (``sgrt_woq_avx2::linear``,
    ``sgrt_woq_avx2::linear_q8``, ``sgrt_woq::linear``), for C++ callers that look it up by name;
    None where no build is loaded."""
    if not available():
        return None
    check_activations(activations)
    if isa() == "avx2":
        return "sgrt_woq_avx2::" + _OPS[activations]
    return "sgrt_woq::linear"


def kernel(activations: str = "int16"):
    """The registered operator itself, with :func:`linear`'s signature (positional arguments),
    for callers that check :func:`available` once and call it many times (one Python frame
    less a call). ``activations``: see :func:`check_activations` (``"int8"``: the AVX2 build's
    ``linear_q8``; ``"int8-prefill"``: its ``linear_q8_prefill``).

    Raises:
        RuntimeError: :func:`available` is False.
        ValueError: from :func:`check_activations`.
    """
    if not available():
        raise RuntimeError("sgrt.kernels.woq: the native kernel is unavailable (see the log)")
    if activations == "int16":
        return _state["op"]
    check_activations(activations)
    return operator_entry(getattr(torch.ops.sgrt_woq_avx2, _OPS[activations]).default)


def float_kernel(activations: str = "int16"):
    """The operator that computes :func:`kernel`'s output widened to float32 in the same pass
    (``sgrt_woq_avx2::linear_float``: ``kernel(activations)(...).float()``'s values, each thread
    widening the outputs it computed; for the LM head's logits), with :func:`linear`'s
    positional arguments; None where there is none (the AVX-512 BF16 build, int8 activations,
    no build loaded)."""
    if activations != "int16" or isa() != "avx2":
        return None
    return operator_entry(torch.ops.sgrt_woq_avx2.linear_float.default)


# The weights a GroupLinear's dense path dequantizes at a time (16 MB of bfloat16).
DENSE_TILE_WEIGHTS = 1 << 23


def dense_rows() -> int | None:
    """The rows of x from which a GroupLinear runs a many-row call (a prefill chunk) as bfloat16
    matmuls over its weight dequantized a tile at a time (:func:`dequantize_rows`, then oneDNN,
    which runs them on AMX tiles where the CPU has them: ~1 TFLOP/s on 2 cores of an AMX Xeon),
    instead of this kernel: ``SGRT_WOQ_DENSE_ROWS=N`` (opt-in; unset or 0: never, None). Opt-in
    because its outputs are not this kernel's: bfloat16 activations exactly against weights
    rounded to bfloat16, where the kernel takes the weights exactly and the activations at ~16
    bits, so greedy tokens can differ from the kernel's after a long prompt (docs/DESIGN.md)."""
    env = os.environ.get("SGRT_WOQ_DENSE_ROWS", "").strip()
    rows = int(env) if env.isdigit() else 0
    return rows if rows > 0 and isa() == "avx2" else None


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, n: int, k: int,
                    kernel_bits: int, group: int, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0 .. r1`` (16-row blocks) of the AVX2 build's weight (:func:`prepare`'s stream)
    as bfloat16 ``[r1 - r0, k]``: :func:`dequantize`'s values, in the native operator
    (``sgrt_woq_avx2::dequantize_rows``).

    Raises:
        RuntimeError: the AVX2 build is not loaded; arguments the operator refuses (named).
    """
    if isa() != "avx2":
        raise RuntimeError("sgrt.kernels.woq.dequantize_rows needs the AVX2 build")
    return torch.ops.sgrt_woq_avx2.dequantize_rows(packed, scales, offsets, n, k, kernel_bits, group, r0, r1)


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
           n: int, k: int, bits: int, group: int = 32, activations: str = "int16") -> torch.Tensor:
    """``y[m, n] = sum_k x[m, k] * (scales[n, k // group] * code[n, k] + offsets[n, k // group])``.

    Args:
        x: ``[M, k]`` bfloat16, contiguous, any ``M >= 0``.
        packed: :func:`pack`'s output for the codes ``[n, k]``, or :func:`prepare`'s (the AVX2 build's
            fused stream; the AVX2 build fuses :func:`pack`'s codes itself, per call).
        scales, offsets: ``[n, k // group]`` float16, contiguous (Q4_1's ``d`` and ``m``).
        n, k: output / input features (``n % 16 == 0``, ``k % group == 0``).
        bits: 4 or 8. group: 32, 64 or 128 inputs per scale.
        activations: ``"int16"`` or, on the AVX2 build, ``"int8"`` (x quantized to int8 per block
            of 32, ``dx = max|x| / 127``, as llama.cpp's Q8 blocks: faster, less accurate) or
            ``"int8-prefill"`` (int8 where ``M >= PREFILL_ROWS``); see :func:`check_activations`.

    Returns:
        ``[M, n]`` bfloat16, in the units of ``x @ W.T`` (nothing rescaled): fp32 sums rounded
        to nearest even once, so within ``2**-8 |y|`` plus float32 summation error of the exact
        result (``tests/models/test_woq_kernel.py`` states and checks the bound); the AVX2
        build's x is first quantized to a step of ``max|x| / 32258`` per block of 32 (module
        docstring). A row's result does not depend on the other rows or the thread count
        (bitwise).

    Raises:
        RuntimeError: from the kernel, naming the argument and the limit (dtype, shape,
            contiguity, ``n % 16``, ``k % group``, bits / group values).
        RuntimeError: :func:`available` is False.
        ValueError: ``activations`` (:func:`check_activations`).
    """
    if isa() == "avx2" and packed.numel() == n * k * bits // 8:  # pack()'s codes alone: fuse them here
        try:
            packed = fuse(packed, scales, offsets, n, k, bits, group)
        except ValueError:
            pass  # (bad arguments: the kernel names the one at fault)
    return kernel(activations)(x, packed, scales, offsets, n, k, bits, group)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, n: int, k: int, bits: int,
               group: int = 32, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense weight ``[n, k]`` (computed in float32, then cast to ``dtype``), for a dense path."""
    codes = unpack(packed, n, k, bits).float().reshape(n, k // group, group)
    w = codes * scales.float().unsqueeze(-1) + offsets.float().unsqueeze(-1)
    return w.reshape(n, k).to(dtype)
