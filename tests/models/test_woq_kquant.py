"""The K-quant form of the native kernel (sgrt/kernels/woq.py ``fuse_kq4``, woq_avx2.cpp's
super-block headers) and the reader it takes its blocks from (sgrt/models/gguf_raw.py
``unpack_q4_k_super``): a GGUF's ``Q4_K`` blocks as they are, against ``gguf``'s own dequantize.

The kernel's weights must be the file's bit for bit (the weights ``gguf.quants.dequantize``
gives in float32), and its outputs those of the AVX2 kernel's formula on those weights
(``test_woq_kernel._avx2_reference``, bit for bit), on every path: one row (the streams), 2 / 3
rows, the 4-, 8- and 16-row tiles, the AVX-512 VNNI kernels and the AVX2 ones.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sgrt.kernels import woq
from sgrt.models import gguf_raw

gguf = pytest.importorskip("gguf")

if not woq.available() or woq.isa() != "avx2":
    pytest.skip("the K-quant stream is the AVX2 build's", allow_module_level=True)

from tests.models.test_woq_kernel import _avx2_reference, _x  # noqa: E402

E = torch.empty(0, dtype=torch.float16)
# (rows, cols): one 16-row block and super-block; rows not a multiple of the 3-stream split or of
# the 16-row AVX-512 tile; a long k
SHAPES = [(16, 256), (48, 512), (160, 1280), (272, 2304)]


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw ``Q4_K`` bytes ``[rows, cols / 256 * 144]`` with random codes, 6-bit scales and mins,
    and float16 ``d`` / ``dmin`` of a real model's size (1e-4 .. 1e-3)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        halves = rng.uniform(1e-4, 1e-3, (rows, cols // 256)).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _stream(raw: np.ndarray, n: int, k: int) -> tuple[gguf_raw.KQ4Weight, torch.Tensor]:
    w = gguf_raw.unpack_q4_k_super(raw, n, k)
    return w, woq.fuse_kq4(woq.pack(w.codes, 4), w.d, w.dmin, w.sc, w.mn, n, k)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reader_is_ggufs_dequantize_bit_for_bit(shape):
    n, k = shape
    raw = random_q4_k(n, k, seed=n + k)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    got = gguf_raw.unpack_q4_k_super(raw, n, k).dequantize().numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stream_round_trip_and_size(shape):
    """fuse_kq4 / unfuse_kq4 are inverses; the stream is 37/64 of a byte a weight (4.625 bits)
    and unfuse's float32 scales give the file's weights exactly."""
    n, k = shape
    raw = random_q4_k(n, k, seed=3)
    w, stream = _stream(raw, n, k)
    assert stream.numel() == woq.stream_bytes(n, k, woq.KQ4_BITS) == n * k * 37 // 64
    packed, d, dmin, sc, mn = woq.unfuse_kq4(stream, n, k)
    assert torch.equal(woq.unpack(packed, n, k, 4), w.codes)
    for a, b in ((d, w.d), (dmin, w.dmin), (sc, w.sc), (mn, w.mn)):
        assert torch.equal(a, b)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    assert torch.equal(woq.dequantize(*woq.unfuse(stream, n, k, woq.KQ4_BITS, 32), n, k, 4, 32, torch.float32), want)


def test_header_layout_as_documented():
    """Row r's d, dmin at bytes 2r, 32 + 2r of its block's super-block header; group j's sc, mn at
    64 + 16 j + r, 192 + 16 j + r; then the groups' codes as fuse's 4-bit groups."""
    n, k = 32, 512
    w, stream = _stream(random_q4_k(n, k, seed=5), n, k)
    per = woq.KQ_HEADER_BYTES + 8 * 256
    plain = woq.fuse(woq.pack(w.codes, 4), torch.zeros(n, k // 32, dtype=torch.float16),
                     torch.zeros(n, k // 32, dtype=torch.float16), n, k, 4).reshape(n // 16, k // 32, 64 + 256)
    for b, s, r, j in ((0, 0, 0, 0), (1, 1, 15, 7), (1, 0, 6, 3)):
        h = stream[(b * (k // 256) + s) * per:][:per]
        row = 16 * b + r
        assert h[2 * r:2 * r + 2].view(torch.float16).item() == w.d[row, s].item()
        assert h[32 + 2 * r:34 + 2 * r].view(torch.float16).item() == w.dmin[row, s].item()
        assert h[64 + 16 * j + r] == w.sc[row, 8 * s + j] and h[192 + 16 * j + r] == w.mn[row, 8 * s + j]
        assert torch.equal(h[320 + 256 * j:576 + 256 * j], plain[b, 8 * s + j, 64:])


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_the_formula_on_the_files_weights_bitwise(shape, activations):
    """Every row count's path (1: the streams; 2-3; 4, 8, 16-row tiles and their leftovers; a
    tile boundary) gives _avx2_reference's bits on the file's exact scales and offsets."""
    n, k = shape
    w, stream = _stream(random_q4_k(n, k, seed=n), n, k)
    scales, offsets = w.group_scales()
    for m in (1, 2, 3, 4, 7, 8, 16, 29):
        x = _x(m, k, seed=m).float()
        if m > 2:
            x[1, 32:64] *= 1e-3
            x[2, 64:96] = 0.0
        x = x.bfloat16()
        y = woq.kernel(activations)(x, stream, E, E, n, k, woq.KQ4_BITS, 32)
        assert torch.equal(y, _avx2_reference(x, w.codes, scales, offsets, 4, 32, activations)), m


def test_float_output_and_dequantize_rows():
    n, k = 48, 512
    w, stream = _stream(random_q4_k(n, k, seed=9), n, k)
    x = _x(3, k)
    assert torch.equal(woq.float_kernel()(x, stream, E, E, n, k, woq.KQ4_BITS, 32),
                       woq.kernel()(x, stream, E, E, n, k, woq.KQ4_BITS, 32).float())
    assert torch.equal(woq.dequantize_rows(stream, E, E, n, k, woq.KQ4_BITS, 32, 16, 48),
                       w.dequantize()[16:48].bfloat16())


_AVX2_SCRIPT = (
    "import sys, torch\n"
    "from sgrt.kernels import woq\n"
    "cases = torch.load(sys.argv[1])\n"
    "e = torch.empty(0, dtype=torch.half)\n"
    "torch.save([woq.kernel(a)(x, s, e, e, n, k, woq.KQ4_BITS, 32) for a, x, s, n, k in cases], sys.argv[2])\n")


@pytest.mark.skipif(not all(f in open("/proc/cpuinfo").read() for f in ("avx512f", "avx512bw", "avx512_vnni")),
                    reason="the AVX-512 VNNI kernels run only where the CPU has them")
def test_avx512_and_avx2_kernels_give_the_same_bits(tmp_path):
    """The same cases with SGRT_WOQ_AVX512=0 (AVX2 kernels, in a subprocess) and without."""
    cases = []
    for n, k in SHAPES[1:3]:
        _, stream = _stream(random_q4_k(n, k, seed=11), n, k)
        cases += [(a, _x(m, k), stream, n, k) for m in (1, 5, 16, 21) for a in ("int16", "int8")]
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env={**os.environ, "SGRT_WOQ_AVX512": "0"}, check=True, timeout=600)
    for (a, x, s, n, k), want in zip(cases, torch.load(tmp_path / "avx2.pt")):
        assert torch.equal(woq.kernel(a)(x, s, E, E, n, k, woq.KQ4_BITS, 32), want), (a, x.shape, n, k)


def test_argument_errors():
    n, k = 16, 256
    w, stream = _stream(random_q4_k(n, k), n, k)
    x = _x(1, k)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        woq.kernel()(_x(1, 288), stream, E, E, n, 288, woq.KQ4_BITS, 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        woq.kernel()(x, stream[:-1].contiguous(), E, E, n, k, woq.KQ4_BITS, 32)
    with pytest.raises(ValueError, match="6 bits"):
        woq.fuse_kq4(woq.pack(w.codes, 4), w.d, w.dmin, w.sc | 64, w.mn, n, k)
    with pytest.raises(ValueError, match="k of 256"):
        woq.fuse_kq4(woq.pack(w.codes, 4), w.d, w.dmin, w.sc, w.mn, n, 128)
    with pytest.raises(ValueError, match="embedding"):
        woq.gather_rows(stream, E, E, n, k, woq.KQ4_BITS, 32, torch.tensor([0]))
