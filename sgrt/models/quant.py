"""Weight-only int8 / int4 linear layers, and the pass that installs them.

Batch-1 decode is bound by reading the weights, so storing them in 8 or 4 bits and dequantizing
inside the matmul kernel is where the speed comes from. Activations stay bfloat16.

Two kernel families; :func:`quantize_model` takes the first that runs here:

1. **sgrt's native CPU kernel** (:class:`GroupLinear`, :mod:`sgrt.kernels.woq`; AVX-512 BF16
   CPUs, compiled on first use): ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` per group
   of 32 inputs, float16 scale and offset, float32 sums.

   - **int4**: a GGUF's Q4_1 tensors as they are (codes, ``d``, ``m``: the file's weights bit
     for bit, see :mod:`sgrt.models.gguf_raw`); anything else quantized at load, min/max per
     group (:func:`quantize_groups`).
   - **int8**: quantized at load the same way with 8-bit codes (Q4_1's asymmetric form with 256
     levels). Per group rather than per channel: on the default model, whose weights are 4-bit
     groups, a per-channel grid (one step of ``max|row| / 127``) re-rounds them and top-1
     agreement with bfloat16 falls to 94-96%; per group it is 97.5% (teacher-forced, 200 tokens).

2. **torch's packed kernels** (CUDA, and CPUs without AVX-512 BF16):

   - **int8** (:class:`Int8Linear`): per-output-channel symmetric, ``scale[n] = max|W[n, :]| /
     127``, ``q = round(W / scale)`` in -127..127, ``y = (x @ q.T) * scale``
     (``torch.ops.aten._weight_int8pack_mm``).
   - **int4** (:class:`Int4Linear`): Q4_1 groups of 32 on torch's kernels
     (``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` on CUDA, "tinygemm"), which
     compute ``(q - 8) * scale + zero``: a Q4_1 block maps to ``scale = d``, ``zero = m + 8 d``.
     The fast kernels want bfloat16 scales and zeros (float32 ones only with float32
     activations, 40-50x slower on this CPU: measured), so these are the file's values rounded
     to bfloat16 (relative error at most 2**-8; checked in ``tests/models/test_quantization.py``).

**LM head**: its own quantized copy, int8 in both modes unless the file stores the head in Q4_1
(the tied embedding stays a float lookup table for the input side). Measured on the default
model (tied Q8_0 embedding), teacher-forced over 200 tokens: an int4 head quantized at load drops
top-1 agreement with bfloat16 to 84-90% (mean KL ~0.06), an int8 head keeps 96-98.5%. A tied
model uses it for logit batches of up to :data:`GROUP_HEAD_MAX_ROWS` rows (native) or
:data:`INT8_HEAD_MAX_ROWS` (torch's int8 kernel, compute-bound past a few rows) and its float
embedding table past that; so logits may differ in the last bits with the batch size, as they
do across dtypes.

Layers whose shapes a kernel cannot take keep their float weights (native: ``out % 16``,
``in % 32``; torch's CPU int4 the same; its int8: ``in % 16``, as the CPU kernel crashes the
process on other widths). A model whose dtype is not bfloat16 still works: each quantized layer
casts its input to bfloat16 and its output back (use ``dtype="bfloat16"`` with quantization).

Speed (2 threads, the default model's 120 projections, ms a pass; ``bench/woq_kernel.py``): at
1 row native int4 3.4, int8 6.0, torch's int4 4.0, int8 8.3, bfloat16 (oneDNN) 13.6; at 16 rows
10.7 / 11.4 / 21.8 / 33.5 / 17.1. torch's kernels are compute-bound from a few rows and 2-4x
slower than bfloat16 on prefill chunks, so from :data:`DENSE_MIN_ROWS` rows their layers
dequantize the weight to bfloat16 (int4: unpacked from the CPU kernel's own layout, no second
copy kept) for one dense matmul; the native kernel stays within 1.3x of bfloat16 there and
always runs. The CUDA paths are written to torch's documented layouts but untested here: the
first layer of each kind is checked against its dequantized weights at load.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sgrt.errors import InvalidRequest

logger = logging.getLogger("sgrt.models")

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
# The packed kernels' activation and scale dtype (CPU and CUDA).
KERNEL_DTYPE = torch.bfloat16
# Logit rows up to which a tied model's quantized LM head beats its float one (see quantize_model):
# torch's int8 kernel / the native group-wise kernel.
INT8_HEAD_MAX_ROWS = 4
GROUP_HEAD_MAX_ROWS = 32
# Rows from which a quantized layer dequantizes its weight to bfloat16 for one dense matmul
# instead of calling the packed kernel, which is compute-bound there (prefill chunks). Measured
# on the default model's shapes, 2 threads, 512 rows: int8 kernel 2.6x and int4 kernel 2.2x the
# bfloat16 matmul's time, dequantize + matmul 1.2-1.4x.
DENSE_MIN_ROWS = 128


def parse_quantization(quantization: str | None) -> str:
    """``None`` / ``"none"`` / ``"int8"`` / ``"int4"`` (any case) -> the canonical name.

    Raises:
        InvalidRequest: (field ``quantization``) any other value.
    """
    name = "none" if quantization is None else str(quantization).strip().lower()
    if name not in QUANTIZATIONS:
        raise InvalidRequest(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}",
                             field="quantization")
    return name


_CHECKED: set[tuple[str, str]] = set()


def _check_kernel(mod: nn.Module, w_ref: torch.Tensor, kind: str) -> None:
    """Once per (kernel, device type) off the CPU, where our tests do not run: compare a small
    matmul with ``w_ref`` ``[N, K]`` float32, and fail loudly rather than serve wrong logits.

    Raises:
        ModelLoadError: the kernel is missing or disagrees (names the kernel and the device).
    """
    from sgrt.errors import ModelLoadError

    device = w_ref.device
    if device.type == "cpu" or (kind, device.type) in _CHECKED:
        return
    x = torch.randn(3, w_ref.shape[1], device=device).to(KERNEL_DTYPE)
    try:
        got = mod(x).float()
    except RuntimeError as e:
        raise ModelLoadError(f"quantization {kind!r}: torch's packed kernel failed on {device}: {e}") from e
    ref = x.float() @ w_ref.t()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err < 2e-2:
        raise ModelLoadError(f"quantization {kind!r}: torch's packed kernel on {device} is off by "
                             f"{err:.3g} (relative) from the dequantized weights; use quantization='none'")
    _CHECKED.add((kind, device.type))


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == KERNEL_DTYPE else x2.to(KERNEL_DTYPE)


class _QuantizedLinear(nn.Module):
    """What int8 and int4 layers share: the choice between the packed kernel (decode-sized
    inputs) and a dense matmul over the dequantized weight (from :data:`DENSE_MIN_ROWS` rows).

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.
    """

    out_features: int

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        """The packed kernel on ``[M, K]`` bfloat16 -> ``[M, N]`` bfloat16."""
        raise NotImplementedError

    def _dense_weight(self) -> torch.Tensor | None:
        """``W`` ``[N, K]`` bfloat16 for a dense matmul, or None where it cannot be built."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own = x.dim() == 2 and x.dtype == KERNEL_DTYPE  # the model's own calls: no reshapes
        x2 = x if own else _as_2d(x)
        weight = self._dense_weight() if x2.shape[0] >= DENSE_MIN_ROWS else None
        y = self._kernel(x2) if weight is None else F.linear(x2, weight)
        return y if own else y.view(*x.shape[:-1], self.out_features).to(x.dtype)


# ---- int8 ---------------------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: weight ``[N, K]`` float -> (q ``[N, K]`` int8, scale ``[N]``
    bfloat16). ``q`` is rounded against the stored (bfloat16) scale, so ``|q * scale - w|`` is at
    most half a step, ``scale / 2``, everywhere: bfloat16 rounding moves the scale by at most
    2**-8 (relative), so ``max|w| / scale <= 127.5`` and the clamp to +-127 never cuts deeper."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).to(KERNEL_DTYPE)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.round(w / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(_QuantizedLinear):
    """``y = x @ (q * scale).T`` with int8 weights ``q`` ``[N, K]`` and per-row scales ``[N]``.

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())
        _check_kernel(self, self.dequantize(), "int8")

    @classmethod
    def from_float(cls, weight: torch.Tensor, device: torch.device | str = "cpu") -> "Int8Linear":
        q, scale = quantize_int8(weight)
        return cls(q.to(device), scale.to(device))

    @staticmethod
    def supports(out_features: int, in_features: int, device: torch.device) -> bool:
        return in_features % 16 == 0  # NOTE: the CPU kernel segfaults on other widths (torch 2.13)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def _dense_weight(self) -> torch.Tensor:
        return self.qweight.to(KERNEL_DTYPE) * self.scales.unsqueeze(1)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32."""
        return self.qweight.float() * self.scales.float().unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


# ---- int4 ---------------------------------------------------------------------------------------

def q4_1_scales_and_zeros(d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
    """Q4_1 block scale ``d`` and minimum ``m`` (``[N, K // group]``) -> the kernels'
    ``scales_and_zeros`` ``[K // group, N, 2]`` in ``dtype``.

    The kernels compute ``(q - 8) * scale + zero``; ``scale = d`` and ``zero = m + 8 d`` make that
    ``d * q + m`` for every code. ``m + 8 d`` is formed in float32, where it is exact for float16
    ``d`` and ``m`` unless their exponents lie more than 13 binades apart.
    """
    d32, m32 = d.float(), m.float()
    return torch.stack([d32, m32 + 8.0 * d32], dim=-1).transpose(0, 1).contiguous().to(dtype)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group_size`` inputs, min/max like Q4_1:
    weight ``[N, K]`` float -> (codes ``[N, K]`` uint8 in 0..15, scales_and_zeros
    ``[K // group, N, 2]`` bfloat16).

    ``d = (max - min) / 15``, then ``scale = d``, ``zero = min + 8 d`` rounded to bfloat16, and the
    codes are rounded against those stored values: ``q = clamp(round((w - zero) / scale) + 8)``.
    """
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    sz = q4_1_scales_and_zeros((hi - lo) / 15.0, lo)  # [G, N, 2] bf16
    scale = sz[..., 0].float().t().unsqueeze(-1)  # [N, G, 1]
    zero = sz[..., 1].float().t().unsqueeze(-1)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (torch.round((w - zero) / safe) + 8).clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), sz


def _inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 kernels need in_features divisible by 32, got {k}")


def unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes ``[N, K]`` uint8 back from ``_convert_weight_to_int4pack_for_cpu``'s output
    (``[N, K // 2]`` uint8), for ``N % 64 == 0``.

    The layout (torch 2.13, AVX-512 build; read off the kernel's output, not documented): rows
    in blocks of 64; each block holds, for every input index ``k``, 32 bytes whose low nibbles
    are rows 0-31 of the block and high nibbles rows 32-63. :func:`_cpu_layout_understood`
    checks this against the real packing before any layer relies on it.
    """
    blocks = packed.view(n // 64, k, 32)
    both = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [N / 64, K, 64]
    return both.transpose(1, 2).reshape(n, k)


_layout_ok: bool | None = None  # unpack_int4_cpu checked against this torch's packing (once)


def _cpu_layout_understood(n: int, k: int) -> bool:
    """Whether :func:`unpack_int4_cpu` inverts this torch's CPU packing (checked once, on random
    codes of a 128 x 64 weight); shapes with ``N % 64 != 0`` always use the kernel."""
    global _layout_ok
    if n % 64:
        return False
    if _layout_ok is None:
        codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
            _layout_ok = (packed.shape == (128, 32) and packed.dtype == torch.uint8
                          and torch.equal(unpack_int4_cpu(packed, 128, 64), codes.to(torch.uint8)))
        except RuntimeError:
            _layout_ok = False
        if not _layout_ok:
            logger.warning("int4: unknown CPU packing layout; prefill chunks use the packed kernel")
    return _layout_ok


class Int4Linear(_QuantizedLinear):
    """``y = x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``,
    ``g = k // group_size``; 4-bit codes packed for torch's kernels.

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.

    Args:
        codes: ``[N, K]`` uint8 in 0..15.
        scales_and_zeros: ``[K // group_size, N, 2]`` (cast to bfloat16).
        group_size: 32, 64, 128 or 256.
        device: where the packed weight lives (packing is device-specific).
    """

    def __init__(self, codes: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int = INT4_GROUP_SIZE, device: torch.device | str = "cpu"):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        device = torch.device(device)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        else:
            # NOTE: CUDA's converter takes two codes a byte, the even column in the high nibble.
            pairs = codes.to(device=device, dtype=torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (pairs[:, ::2] << 4 | pairs[:, 1::2]).contiguous(), _inner_k_tiles(self.in_features))
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=KERNEL_DTYPE).contiguous())
        self._mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu"
                    else torch.ops.aten._weight_int4pack_mm)
        self._unpackable = device.type == "cpu" and _cpu_layout_understood(self.out_features, self.in_features)
        if device.type != "cpu":
            sz = self.scales_and_zeros.float().transpose(0, 1).repeat_interleave(group_size, dim=1)  # [N, K, 2]
            _check_kernel(self, (codes.to(device).float() - 8) * sz[..., 0] + sz[..., 1], "int4")

    @classmethod
    def from_q4_1(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  device: torch.device | str = "cpu") -> "Int4Linear":
        """From Q4_1 blocks (``d``, ``m``: ``[N, K // 32]``), codes taken as they are."""
        return cls(codes, q4_1_scales_and_zeros(d, m), INT4_GROUP_SIZE, device)

    @classmethod
    def from_float(cls, weight: torch.Tensor, device: torch.device | str = "cpu",
                   group_size: int = INT4_GROUP_SIZE) -> "Int4Linear":
        """Quantize a float weight ``[N, K]`` at load (:func:`quantize_int4`)."""
        codes, sz = quantize_int4(weight, group_size)
        return cls(codes, sz, group_size, device)

    @staticmethod
    def supports(out_features: int, in_features: int, device: torch.device) -> bool:
        if in_features % INT4_GROUP_SIZE:
            return False
        return out_features % (16 if device.type == "cpu" else 8) == 0

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return self._mm(x2, self.packed, self.group_size, self.scales_and_zeros)

    def _dense_weight(self) -> torch.Tensor | None:
        """Unpacked from the CPU layout (see :func:`unpack_int4_cpu`); None off the CPU or where
        that layout is not the one checked."""
        if not self._unpackable:
            return None
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = unpack_int4_cpu(self.packed, n, k).view(n, k // g, g).to(KERNEL_DTYPE) - 8
        sz = self.scales_and_zeros.transpose(0, 1)  # [N, K // g, 2]
        return torch.addcmul(sz[..., 1:], codes, sz[..., :1]).reshape(n, k)  # one rounding to bfloat16

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32, read back through the kernel
        (an identity matrix as input). On CPU this runs the float32 kernel with float32 copies of
        the stored scales and zeros, so nothing is rounded on the way out; on CUDA the result is
        rounded to bfloat16."""
        eye = torch.eye(self.in_features, device=self.packed.device)
        if self.packed.device.type == "cpu":
            w_t = self._mm(eye, self.packed, self.group_size, self.scales_and_zeros.float())
        else:
            w_t = self._mm(eye.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros)
        return w_t.float().t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 group_size={self.group_size}")


# ---- group-wise, on sgrt's native CPU kernel ------------------------------------------------------

def quantize_groups(weight: torch.Tensor, bits: int, group_size: int = INT4_GROUP_SIZE
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization per group of ``group_size`` inputs, min/max like llama.cpp's Q4_1
    (``bits=4``) and the same with 8 bits: weight ``[N, K]`` float -> (codes ``[N, K]`` uint8 in
    0..2**bits-1, scales ``[N, K // group]`` float16, offsets ``[N, K // group]`` float16) with
    ``w ~ scale * code + offset``: ``scale = (max - min) / (2**bits - 1)``, ``offset = min``,
    both rounded to float16 first and the codes rounded against the stored values, so the
    error is at most half a step plus float16's rounding of ``offset``.

    Raises:
        ValueError: a weight beyond float16's range (the caller keeps such a layer in float).
    """
    levels = (1 << bits) - 1
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale, offset = ((hi - lo) / levels).half(), lo.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise ValueError("weights beyond float16's range")
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    codes = torch.round((w - offset.float().unsqueeze(-1)) / step).clamp_(0, levels).to(torch.uint8)
    return codes.reshape(n, k), scale, offset


class GroupLinear(_QuantizedLinear):
    """``y = x @ W.T`` with ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]``,
    ``g = k // group_size``, 4- or 8-bit codes, on the native CPU kernel
    (:mod:`sgrt.kernels.woq`: AVX-512 BF16, bfloat16 activations, float32 sums).

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.

    Args:
        codes: ``[N, K]`` uint8 (0..15 for ``bits=4``, 0..255 for ``bits=8``).
        scales, offsets: ``[N, K // group_size]``, stored as float16 (a Q4_1 block's ``d`` and
            ``m`` are float16 in the file, so they are kept exactly).
        bits: 4 or 8. group_size: 32, 64 or 128.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        from sgrt.kernels import woq

        self.out_features, self.in_features = codes.shape
        self.bits, self.group_size = bits, group_size
        self.register_buffer("packed", woq.pack(codes, bits))
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("offsets", offsets.to(torch.float16).contiguous())
        self._linear = woq.kernel()
        self._refresh_args()

    def _refresh_args(self) -> None:
        # NOTE: the kernel's arguments as a plain tuple: reading buffers goes through
        # nn.Module.__getattr__ (~0.4 us each, 3 a call, 120 calls a decode step).
        self._args = (self.packed, self.scales, self.offsets, self.out_features, self.in_features,
                      self.bits, self.group_size)

    def _apply(self, fn, recurse=True):  # .to() / .cpu() replace the buffers: refresh the tuple
        out = super()._apply(fn, recurse)
        self._refresh_args()
        return out

    @classmethod
    def from_q4_1(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> "GroupLinear":
        """From Q4_1 blocks (``d``, ``m``: ``[N, K // 32]`` float16), all three as they are."""
        return cls(codes, d, m, 4, INT4_GROUP_SIZE)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group_size: int = INT4_GROUP_SIZE) -> "GroupLinear":
        """Quantize a float weight ``[N, K]`` at load (:func:`quantize_groups`).

        Raises:
            ValueError: a weight beyond float16's range.
        """
        return cls(*quantize_groups(weight, bits, group_size), bits, group_size)

    @staticmethod
    def supports(out_features: int, in_features: int, device: torch.device) -> bool:
        return device.type == "cpu" and out_features % 16 == 0 and in_features % INT4_GROUP_SIZE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == KERNEL_DTYPE:  # the model's own calls: straight to the kernel
            return self._linear(x, *self._args)
        return super().forward(x)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return self._linear(x2, *self._args)

    def _dense_weight(self) -> None:
        # NOTE: no dense path: at prefill sizes the kernel is within 1.2-1.3x of a bfloat16 matmul
        # (2 threads, 512 rows, the default model's shapes), while dequantizing a weight alone
        # costs 2-10x that matmul.
        return None

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32 (exact: float16 scales and
        offsets times small integer codes)."""
        from sgrt.kernels import woq

        return woq.dequantize(self.packed, self.scales, self.offsets, self.out_features, self.in_features,
                              self.bits, self.group_size, torch.float32)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} group_size={self.group_size}, native kernel")


# ---- installing them ----------------------------------------------------------------------------

def native_kernel_available() -> bool:
    """Whether sgrt's group-wise CPU kernel (:mod:`sgrt.kernels.woq`) runs here (compiles on the
    first call; False on CPUs without AVX-512 BF16, with ``SGRT_NATIVE_KERNELS=0``, or if the
    build fails)."""
    from sgrt.kernels import woq

    return woq.available()


def quantize_model(model: Any, method: str, weights: dict[str, torch.Tensor],
                   q4_1: dict[str, Any] | None = None) -> dict[str, int]:
    """Replace every fused projection of ``model`` (a :class:`sgrt.models.llama.LlamaForCausalLM`)
    and its LM head by quantized layers, in place.

    Args:
        method: ``"int8"`` or ``"int4"`` (``"none"`` does nothing).
        weights: the float checkpoint, HF names (``model.`` prefix optional): quantizing from it
            rather than from the model's (maybe bfloat16) parameters keeps one rounding, not two.
        q4_1: for int4, Q4_1 blocks by HF name (:func:`sgrt.models.gguf_raw.read_q4_1`); a fused
            projection whose parts are all there is built from them as they are.

    Returns:
        Counts: ``{"q4_1": layers loaded from Q4_1 blocks, "quantized": layers quantized at load,
        "float": layers left in float because the kernel cannot take their shape}``. The LM head
        is int8 in int4 mode too, unless the file holds it in Q4_1.

    Raises:
        InvalidRequest: an unknown ``method``.
    """
    from sgrt.models.llama import FUSED_PROJECTIONS

    method = parse_quantization(method)
    counts = {"q4_1": 0, "quantized": 0, "float": 0}
    if method == "none":
        return counts
    sd = {k.removeprefix("model."): v for k, v in weights.items()}
    blocks = {k.removeprefix("model."): v for k, v in (q4_1 or {}).items()} if method == "int4" else {}
    device = model.device

    native = device.type == "cpu" and native_kernel_available()

    def build(names: list[str], current: nn.Module | None, kind: str) -> nn.Module | None:
        bits = 8 if kind == "int8" else 4
        if all(n in blocks for n in names):
            from sgrt.models.gguf_raw import Q4_1Weight

            b = Q4_1Weight.cat([blocks[n] for n in names])
            if native and GroupLinear.supports(*b.shape, device):
                counts["q4_1"] += 1
                return GroupLinear.from_q4_1(b.codes, b.d, b.m)
            if Int4Linear.supports(*b.shape, device):
                counts["q4_1"] += 1
                return Int4Linear.from_q4_1(b.codes, b.d, b.m, device)
        w = torch.cat([sd[n] for n in names]) if len(names) > 1 else sd[names[0]]
        cls = GroupLinear if native else (Int8Linear if kind == "int8" else Int4Linear)
        if cls.supports(*w.shape, device):
            try:
                layer = GroupLinear.from_float(w, bits) if native else cls.from_float(w, device)
            except ValueError as e:  # float16 scales cannot hold this weight
                logger.warning("%s: %s kept in float (%s)", method, "+".join(names), e)
            else:
                counts["quantized"] += 1
                return layer
        else:
            logger.warning("%s: %s kept in float (shape %s not supported by the %s kernel)",
                           method, "+".join(names), tuple(w.shape), kind)
        counts["float"] += 1
        return current

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for fused, parts in FUSED_PROJECTIONS.items():
                setattr(layer, fused, build([f"layers.{i}.{p}" for p in parts], getattr(layer, fused), method))
        head = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        # NOTE: the LM head is int4 only when the file stores it in Q4_1; otherwise int8. An int4
        # head quantized at load cuts top-1 agreement with bfloat16 to ~85% on the default model
        # (whose tied embedding is Q8_0), against ~97% with an int8 head (see the module docstring).
        model.logits_head = build([head], None, "int4" if head in blocks else "int8")
        if model.lm_head is None and isinstance(model.logits_head, Int8Linear):
            # NOTE: the int8 kernel is compute-bound past a few rows (CPU, 1 thread, 49152 x 576:
            # 4.9 ms at 1 row vs 10.5 bfloat16; 7.4 vs 10.6 at 4; 35 vs 13 at 16), and a tied model
            # keeps its float embedding table anyway: larger batches use that as the head.
            model.logits_head_max_rows = INT8_HEAD_MAX_ROWS
        elif model.lm_head is None and isinstance(model.logits_head, GroupLinear):
            # NOTE: the native kernel stays ahead of bfloat16 further (2 threads, the default
            # model's layers: 0.6x bfloat16's time at 16 rows, 0.75x at 32, 0.9x at 64).
            model.logits_head_max_rows = GROUP_HEAD_MAX_ROWS
        if model.lm_head is not None and model.logits_head is not None:
            model.lm_head = None  # NOTE: its float copy is no longer used; free it.
    model.quantization = method
    return counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and persistent buffers (packed weights, scales): what its
    weights occupy, the input embedding table included; rotary tables and the like excluded."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for mod in model.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
    return total
