"""Weight-only group-wise int4 / int8 linear layers on sgrt's native CPU kernel
(:class:`GroupLinear`, :mod:`sgrt.kernels.woq`). :mod:`sgrt.models.quant` explains the format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgrt.models.quant_base import INT4_GROUP_SIZE, KERNEL_DTYPE, QuantizedLinear


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
        ValueError: a weight that is not finite in float16 (a NaN, an infinity, or beyond its range;
            the caller keeps such a layer in float).
    """
    levels = (1 << bits) - 1
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale, offset = ((hi - lo) / levels).half(), lo.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise ValueError("weights not finite in float16 (a NaN, an infinity, or beyond its range)")
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    codes = torch.round((w - offset.float().unsqueeze(-1)) / step).clamp_(0, levels).to(torch.uint8)
    return codes.reshape(n, k), scale, offset


class GroupLinear(QuantizedLinear):
    """``y = x @ W.T`` with ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]``,
    ``g = k // group_size``, 4- or 8-bit codes, on the native CPU kernel
    (:mod:`sgrt.kernels.woq`: AVX-512 BF16 or AVX2 + FMA, bfloat16 activations, float32 sums).

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.

    Args:
        codes: ``[N, K]`` uint8 (0..15 for ``bits=4``, 0..255 for ``bits=8``).
        scales, offsets: ``[N, K // group_size]``, stored as float16 (a Q4_1 block's ``d`` and
            ``m`` are float16 in the file, so they are kept exactly).
        bits: 4 or 8. group_size: 32, 64 or 128.
        activations: ``"int16"`` (default) or ``"int8"``: the AVX2 kernel's activation precision
            (:func:`sgrt.kernels.woq.check_activations`; ``"int8"``, llama.cpp's Q8 blocks, is
            faster and less accurate: docs/DESIGN.md).

    Raises:
        ValueError: ``activations`` (an unknown value, or ``"int8"`` off the AVX2 build).

    On the AVX2 build the buffer ``packed`` is the kernel's single stream of codes, scales and
    offsets (:func:`sgrt.kernels.woq.fuse`; 8-bit codes below 32 on an AVX-512 VNNI CPU:
    :func:`~sgrt.kernels.woq.fuse5`'s 5-bit and 8-bit streams) and there are no ``scales`` / ``offsets`` buffers
    (:meth:`group_params` reads them back); on the AVX-512 build it holds the codes alone.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 group_size: int = INT4_GROUP_SIZE, activations: str = "int16"):
        super().__init__()
        from sgrt.kernels import woq

        scales, offsets = scales.to(torch.float16).contiguous(), offsets.to(torch.float16).contiguous()
        n, k = codes.shape
        # The AVX2 build reads codes, scales and offsets as one stream (woq.fuse), and only that is
        # kept (a second copy of the scales would cost 1/5 of the int4 weight bytes); the kernel
        # then takes empty scale / offset arguments. 8-bit codes whose offsets are all -c * scale
        # (a GGUF's Q8_0 / Q5_0 blocks) get the compact stream, without the offsets; 8-bit codes all
        # below 32 (Q5_0) also a 5-bit copy for one-row calls, where the CPU has AVX-512 VNNI
        # (woq.fuse5). The kernel's `bits` argument (stream_bits) says which.
        stream, stream_bits = woq.prepare(woq.pack(codes, bits), scales, offsets, n, k, bits, group_size)
        self._install(stream, stream_bits, scales, offsets, n, k, bits, group_size, activations)

    @classmethod
    def from_stream(cls, stream: torch.Tensor, stream_bits: int, n: int, k: int, bits: int,
                    group_size: int = INT4_GROUP_SIZE, scales: torch.Tensor | None = None,
                    offsets: torch.Tensor | None = None, activations: str = "int16") -> "GroupLinear":
        """A layer over a weight already in the loaded kernel's layout (what
        :func:`sgrt.kernels.woq.prepare` returns: the AVX2 build's stream, or the AVX-512 BF16
        build's packed codes with ``scales`` / ``offsets`` ``[n, k // group_size]`` float16), held
        as it is: no copy (a weight store's memory-mapped tensor stays mapped).

        Args:
            stream: 1-D uint8. stream_bits: the kernel's ``bits`` argument for it
                (:func:`sgrt.kernels.woq.stream_bits`). bits: the code width, 4 or 8.

        Raises:
            ValueError: ``activations``; a stream whose size does not fit ``n``, ``k``, the bits
                and the group size.
        """
        from sgrt.kernels import woq

        self = cls.__new__(cls)
        QuantizedLinear.__init__(self)
        if scales is None:  # (the fused stream: its size must be the layout's)
            if stream.dtype != torch.uint8 or stream.dim() != 1 or stream.numel() != woq.stream_bytes(
                    n, k, stream_bits, group_size):
                raise ValueError(f"a {n} x {k} stream of kernel bits {stream_bits} has "
                                 f"{woq.stream_bytes(n, k, stream_bits, group_size)} bytes, got {stream.numel()}")
            scales = offsets = torch.empty(0, dtype=torch.float16)
        self._install(stream, stream_bits, scales, offsets, n, k, bits, group_size, activations)
        return self

    def _install(self, stream: torch.Tensor, stream_bits: int, scales: torch.Tensor, offsets: torch.Tensor,
                 n: int, k: int, bits: int, group_size: int, activations: str) -> None:
        from sgrt.kernels import woq

        woq.check_activations(activations)
        self.activations = activations
        self.out_features, self.in_features = n, k
        self.bits, self.group_size = bits, group_size
        self.stream_bits = stream_bits
        self.register_buffer("packed", stream)
        self.fused = self.packed.numel() != n * k * bits // 8
        if self.fused:
            self._no_scales = torch.empty(0, dtype=torch.float16)
        else:
            self.register_buffer("scales", scales)
            self.register_buffer("offsets", offsets)
        self._linear = woq.kernel(activations)
        self._linear_float = woq.float_kernel(activations)
        # (rows from which a call is a bfloat16 matmul over the dequantized weight: opt-in)
        self._dense_rows = woq.dense_rows() if self.fused else None
        self._refresh_args()

    def _refresh_args(self) -> None:
        # NOTE: the kernel's arguments as a plain tuple: reading buffers goes through
        # nn.Module.__getattr__ (~0.4 us each, 3 a call, 120 calls a decode step).
        s, o = (self._no_scales, self._no_scales) if self.fused else (self.scales, self.offsets)
        self._args = (self.packed, s, o, self.out_features, self.in_features, self.stream_bits, self.group_size)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, offsets), each ``[N, K // group_size]`` float16, as given (read back from the
        fused stream on the AVX2 build)."""
        return self._unfused()[1:]

    def _unfused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(:func:`sgrt.kernels.woq.pack`'s codes, scales, offsets), split out of the fused stream once."""
        from sgrt.kernels import woq

        if self.fused:
            return woq.unfuse(self.packed, self.out_features, self.in_features, self.stream_bits, self.group_size)
        return self.packed, self.scales, self.offsets

    def _apply(self, fn, recurse=True):  # .to() / .cpu() replace the buffers: refresh the tuple
        out = super()._apply(fn, recurse)
        self._refresh_args()
        return out

    @classmethod
    def from_q4_1(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  activations: str = "int16") -> "GroupLinear":
        """From Q4_1 blocks (``d``, ``m``: ``[N, K // 32]`` float16), all three as they are."""
        return cls(codes, d, m, 4, INT4_GROUP_SIZE, activations)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group_size: int = INT4_GROUP_SIZE,
                   activations: str = "int16") -> "GroupLinear":
        """Quantize a float weight ``[N, K]`` at load (:func:`quantize_groups`).

        Raises:
            ValueError: a weight beyond float16's range.
        """
        return cls(*quantize_groups(weight, bits, group_size), bits, group_size, activations)

    @staticmethod
    def supports(out_features: int, in_features: int, device: torch.device) -> bool:
        return device.type == "cpu" and out_features % 16 == 0 and in_features % INT4_GROUP_SIZE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == KERNEL_DTYPE:  # the model's own calls: straight to the kernel
            if self._dense_rows is not None and x.shape[0] >= self._dense_rows:
                return self._dense_matmul(x)
            return self._linear(x, *self._args)
        return super().forward(x)

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for many rows (a prefill chunk) as bfloat16 matmuls over the weight
        dequantized a tile of output rows at a time (:func:`sgrt.kernels.woq.dequantize_rows`:
        the kernel's weights rounded to bfloat16), opt-in where the CPU's bfloat16 matmul is the
        faster (:func:`sgrt.kernels.woq.dense_rows`: AMX). x ``[M, K]`` bfloat16 -> ``[M, N]``
        bfloat16."""
        from sgrt.kernels import woq

        n, k = self.out_features, self.in_features
        step = max(16, woq.DENSE_TILE_WEIGHTS // k // 16 * 16)
        if step >= n:
            return F.linear(x, woq.dequantize_rows(*self._args, 0, n))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            y[:, r0:r1] = F.linear(x, woq.dequantize_rows(*self._args, r0, r1))
        return y

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``'s values (x ``[M, K]`` bfloat16 -> ``[M, N]`` float32) in one pass
        where the kernel has a float32 output (:func:`sgrt.kernels.woq.float_kernel`): the LM
        head's logits, which the sampler reads in float32."""
        if self._linear_float is not None and x.dim() == 2 and x.dtype == KERNEL_DTYPE:
            return self._linear_float(x, *self._args)
        return self(x).float()

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

        return woq.dequantize(*self._unfused(), self.out_features, self.in_features,
                              self.bits, self.group_size, torch.float32)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} group_size={self.group_size}, native kernel"
                + (", int8 activations" if self.activations == "int8" else ""))


class GroupEmbedding(nn.Module):
    """An input embedding whose table is a :class:`GroupLinear`'s weight, looked up in the kernel's
    layout (:func:`sgrt.kernels.woq.gather_rows`): a tied model's quantized LM head serves both
    sides, or an untied model's embedding stays in its file's blocks, instead of a float table
    beside them (SmolLM2-135M: 57 MB of bfloat16; a Llama 3 8B's 128k x 4096: 1 GB).

    The rows are the table's weights ``scale * code + offset`` computed in float32, then cast to
    ``dtype``: from a GGUF's ``Q8_0`` / ``Q5_0`` / ``Q4_1`` / ``Q4_0`` blocks exactly the values of
    a float table converted from the file (``gguf.quants.dequantize``, then ``dtype``).

    Args:
        table: the layer whose weight is the table (``[vocab, hidden]``: out_features x in_features).
        dtype: the model's activation dtype.

    Input ``ids`` int64 of any shape; output ``[*ids.shape, hidden]`` in ``dtype``.
    """

    def __init__(self, table: GroupLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from sgrt.kernels import woq

        rows = woq.gather_rows(*self.table._args, ids)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.table.bits} rows of a group-wise table"
