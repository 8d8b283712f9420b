"""Weight-only int8 / int4 linear layers on torch's packed kernels (CUDA, and CPUs without
AVX-512 BF16): :class:`Int8Linear` (per-channel symmetric int8) and :class:`Int4Linear` (Q4_1
groups of 32 on "tinygemm"). :mod:`sgrt.models.quant` explains the formats and measurements.
"""
from __future__ import annotations

import logging

import torch

from sgrt.models.quant_base import INT4_GROUP_SIZE, KERNEL_DTYPE, QuantizedLinear, check_kernel

logger = logging.getLogger("sgrt.models")


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


class Int8Linear(QuantizedLinear):
    """``y = x @ (q * scale).T`` with int8 weights ``q`` ``[N, K]`` and per-row scales ``[N]``.

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())
        check_kernel(self, self.dequantize(), "int8")

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


class Int4Linear(QuantizedLinear):
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
            check_kernel(self, (codes.to(device).float() - 8) * sz[..., 0] + sz[..., 1], "int4")

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
