"""Raw quantized blocks of a GGUF file, for kernels that run on them without a float round trip.

llama.cpp's Q4_1 block (``block_q4_1`` in ggml's ``ggml-common.h``) covers 32 consecutive weights
of one row in 20 bytes: ``d`` (float16 scale), ``m`` (float16 minimum), then 16 bytes whose low
nibbles are weights 0..15 and high nibbles weights 16..31. A weight is ``w = d * q + m`` with
``q`` in 0..15 (this is what ``gguf.quants.dequantize`` computes, in float32). That per-group form,
codes with a float16 scale and offset for each 32 weights of a row, is what sgrt's kernels run
(:mod:`sgrt.kernels.woq`), so every GGML type that has it is read into it with its codes as they
are (:data:`BLOCK_READERS`):

- 4-bit codes (:class:`Q4_1Weight`, the kernel's int4): ``Q4_1``; ``Q4_0`` (``w = d * (q - 8)``:
  ``m = -8 d``, exact); ``Q4_K`` (per 256 weights a float16 ``d`` and ``dmin`` and eight 6-bit
  scales and mins: group ``j`` is ``(d * sc[j]) * q - dmin * mn[j]``, whose two products are
  rounded once to float16).
- 5-bit codes (the kernel's int8, codes 0..31; also its 5-bit streams): ``Q5_0`` (symmetric,
  :class:`SymmetricWeight`), ``Q5_1`` (``w = d * q + m``), ``Q5_K`` (``Q4_K``'s scales with 5-bit
  codes).
- 8-bit codes: ``Q8_0`` (``w = d * q``, ``q`` int8, read as codes ``q + 128``).

``Q4_K`` is also read as it is (:func:`unpack_q4_k_super` -> :class:`KQ4Weight`: ``d``, ``dmin``
and the 6-bit scales and mins, no float16 products), for the AVX2 kernel's K-quant stream
(:func:`sgrt.kernels.woq.fuse_kq4`), which int4 projections of ``Q4_K`` parts take; the packer
makes that stream from the raw super-blocks in one pass (:func:`sgrt.kernels.woq.fuse_q4_k`, the
same bytes; these two are its reference).

Other types (``Q6_K``'s sixteen scales per 256 weights, ``Q2_K``, ``Q3_K``, the IQ types, float
types) have no such form; the packer (:mod:`sgrt.models.weight_packer`) dequantizes them a row
chunk at a time and quantizes the rows to the kernel's groups. Blocks never span rows, so every
reader here takes any row range of a tensor (``[rows, row_bytes]`` uint8, as
:meth:`sgrt.models.weight_files.CheckpointTensors.read_raw` returns them).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Q4_1_GROUP = 32  # weights per block
# GGML tensor types whose codes have at most 4 bits a weight: sgrt's int4 layout (16 levels per
# group of 32 with a float16 scale and offset) is as fine as they are. Every other type (Q5_*,
# Q6_K, Q8_*, F16, BF16, F32, ...) holds more levels than int4 can, so re-quantizing it to int4
# loses precision the file has: on Gemma 3 270M Q4_K_M (mostly Q5_0) that cost top-1 agreement
# with the file's float32 weights 97% -> 60% (mean KL 0.0045 -> 0.50).
NARROW_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S",
                          "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q1_0"})


@dataclass
class Q4_1Weight:
    """One weight matrix ``[rows, cols]`` (HF layout: ``[out_features, in_features]``) in Q4_1's
    form: ``w = d * code + m`` per group of 32 (5-bit types use it with codes up to 31).

    Attributes:
        codes: ``[rows, cols]`` uint8 (0..15 for the 4-bit types, 0..31 for ``Q5_1`` / ``Q5_K``).
        d: ``[rows, cols // 32]`` float16 scale of each group.
        m: ``[rows, cols // 32]`` float16 offset (minimum) of each group.
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """``d * q + m`` in float32, ``[rows, cols]``: the file's weights, bit for bit (Q4_K /
        Q5_K: their scale and offset products as rounded to float16)."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // Q4_1_GROUP, Q4_1_GROUP).float()
        w = self.d.float().unsqueeze(-1) * q + self.m.float().unsqueeze(-1)
        return w.view(rows, cols)

    @staticmethod
    def cat(parts: list["Q4_1Weight"]) -> "Q4_1Weight":
        """Concatenate along rows (output features), as the fused qkv / gate_up layers need."""
        return Q4_1Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                          torch.cat([p.m for p in parts]))


@dataclass
class SymmetricWeight:
    """One weight matrix ``[rows, cols]`` of symmetric blocks of 32 (llama.cpp's ``Q8_0``, ``Q5_0``)
    in the int8 group form ``w = d * code + m`` with ``m = -c * d``: ``Q8_0``'s int8 ``q`` as codes
    ``q + 128`` (``c = 128``), ``Q5_0``'s 5-bit ``q`` as they are (0..31, ``c = 16``). Exact: the
    file's weights, and an offset the AVX2 kernel need not store (``sgrt.kernels.woq.fuse``'s
    compact stream).

    Attributes:
        codes: ``[rows, cols]`` uint8. d: ``[rows, cols // 32]`` float16. c: the codes' zero.
    """

    codes: torch.Tensor
    d: torch.Tensor
    c: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def m(self) -> torch.Tensor:
        """``-c * d`` as float16 (exact for ``c`` a power of two, unless it overflows: callers check
        it is finite)."""
        return (self.d.float() * -float(self.c)).half()

    def dequantize(self) -> torch.Tensor:
        """``d * (code - c)`` in float32, ``[rows, cols]``: the file's weights, bit for bit."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // Q4_1_GROUP, Q4_1_GROUP).float() - self.c
        return (self.d.float().unsqueeze(-1) * q).view(rows, cols)

    def shifted(self, c: int) -> "SymmetricWeight":
        """The same weights with codes ``code + (c - self.c)`` (``Q5_0`` beside ``Q8_0`` in a
        fused projection: codes ``q + 112``, ``c = 128``)."""
        if c == self.c:
            return self
        return SymmetricWeight((self.codes.to(torch.int16) + (c - self.c)).to(torch.uint8), self.d, c)

    @staticmethod
    def cat(parts: list["SymmetricWeight"]) -> "SymmetricWeight":
        """Concatenate along rows. Parts with different ``c`` (a fused qkv of ``Q5_0`` q / k and a
        ``Q8_0`` v) are shifted to ``c = 128`` first (:meth:`shifted`: the same weights)."""
        c = parts[0].c if all(p.c == parts[0].c for p in parts) else 128
        return SymmetricWeight(torch.cat([p.shifted(c).codes for p in parts]), torch.cat([p.d for p in parts]), c)


def _blocks(raw: np.ndarray, rows: int, cols: int, kind: str, per: int, size: int) -> np.ndarray:
    if cols % per:
        raise ValueError(f"{kind} row length {cols} is not a multiple of {per}")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // per, size)


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block ``[..., block_bytes]`` -> ``[...]``."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """A block's 4 little-endian bytes of fifth bits ``[..., 4]`` -> ``[..., 32]`` uint8 ``16`` or
    0 (bit ``j`` of the 32-bit word belongs to weight ``j``)."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _weight(codes: np.ndarray, d: np.ndarray, m: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    return Q4_1Weight(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
                      torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1), dtype=np.float16)),
                      torch.from_numpy(np.ascontiguousarray(m.reshape(rows, -1), dtype=np.float16)))


def unpack_q4_1(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 32 * 20]`` uint8 of one Q4_1 tensor -> :class:`Q4_1Weight`."""
    b = _blocks(blocks, rows, cols, "Q4_1", 32, 20)
    return _weight(_nibbles(b[..., 4:]), _half(b, 0), _half(b, 2), rows, cols)


def unpack_q4_0(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 32 * 18]`` of one ``Q4_0`` tensor (ggml's ``block_q4_0``: float16
    ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``) -> :class:`Q4_1Weight` with ``m = -8 d``
    (exact in float16 unless it overflows: callers check ``m`` is finite)."""
    b = _blocks(blocks, rows, cols, "Q4_0", 32, 18)
    d = _half(b, 0)
    return _weight(_nibbles(b[..., 2:]), d, (d.astype(np.float32) * -8.0).astype(np.float16), rows, cols)


def unpack_q5_1(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 32 * 24]`` of one ``Q5_1`` tensor (ggml's ``block_q5_1``: float16
    ``d`` and ``m``, a 32-bit word of fifth bits, 16 bytes of nibbles; ``w = d * q + m``, ``q`` in
    0..31, bits as in ``Q5_0``) -> :class:`Q4_1Weight` with codes 0..31."""
    b = _blocks(blocks, rows, cols, "Q5_1", 32, 24)
    return _weight(_nibbles(b[..., 8:]) | _fifth_bits(b[..., 4:8]), _half(b, 0), _half(b, 2), rows, cols)


Q4_K_SUPER = 256  # weights per K-quant super-block: 8 groups of 32


def _k_scales(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes of 6-bit scales and mins ``[..., 12]`` -> (scales, mins)
    ``[..., 8]`` (ggml's ``get_scale_min_k4``)."""
    sc = np.empty(q.shape[:-1] + (8,), dtype=np.uint8)
    mn = np.empty(q.shape[:-1] + (8,), dtype=np.uint8)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's (float16 ``d``, ``dmin``, 12 scale bytes) -> each group's float16
    scale ``d * sc`` and offset ``-(dmin * mn)`` ``[..., 8]``, the products rounded once."""
    d, dmin = _half(b, 0).astype(np.float32), _half(b, 2).astype(np.float32)
    sc, mn = _k_scales(b[..., 4:16])
    return ((d[..., None] * sc.astype(np.float32)).astype(np.float16),
            (-(dmin[..., None] * mn.astype(np.float32))).astype(np.float16))


def unpack_q4_k(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 256 * 144]`` uint8 of one Q4_K tensor -> :class:`Q4_1Weight`.

    ggml's ``block_q4_K``: per 256 weights a float16 ``d`` and ``dmin``, 8 six-bit scales ``sc``
    and mins ``mn`` (packed in 12 bytes), and 4-bit codes; group ``j`` of 32 weights is
    ``w = (d * sc[j]) * q - (dmin * mn[j])``. That is Q4_1's form per group of 32, so the codes
    are kept as they are and ``d * sc[j]`` / ``-(dmin * mn[j])`` become the group's float16 ``d``
    / ``m`` (rounded once to float16: relative error <= 2**-11 of a group's scale and minimum,
    against up to half a step when a group is re-quantized by its min / max).
    """
    b = _blocks(blocks, rows, cols, "Q4_K", Q4_K_SUPER, 144)
    gd, gm = _k_groups(b)
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # per 64 weights: low nibbles group 2i, high 2i + 1
    return _weight(np.stack([qs & 0x0F, qs >> 4], axis=3), gd, gm, rows, cols)


@dataclass
class KQ4Weight:
    """One ``Q4_K`` weight matrix ``[rows, cols]`` with its super-block scales as the file holds
    them (no float16 rounding of the products): group ``j`` of 32 inputs in super-block ``s`` of
    256 is ``w = (d[s] * sc[j]) * q - dmin[s] * mn[j]``, each product exact in float32.

    Attributes:
        codes: ``[rows, cols]`` uint8, 0..15.
        d, dmin: ``[rows, cols // 256]`` float16, each super-block's scale of scales and of mins.
        sc, mn: ``[rows, cols // 32]`` uint8, 0..63: each group's 6-bit scale and min.
    """

    codes: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale ``d * sc``, offset ``-(dmin * mn)``), each ``[rows, cols // 32]`` float32, exact."""
        d = self.d.float().repeat_interleave(Q4_K_SUPER // Q4_1_GROUP, dim=1)
        dmin = self.dmin.float().repeat_interleave(Q4_K_SUPER // Q4_1_GROUP, dim=1)
        return d * self.sc.float(), -(dmin * self.mn.float())

    def dequantize(self) -> torch.Tensor:
        """``scale * q + offset`` in float32, ``[rows, cols]``: ``gguf.quants.dequantize``'s values
        for the file's ``Q4_K`` blocks, bit for bit (the same two products and one sum)."""
        rows, cols = self.codes.shape
        scale, offset = self.group_scales()
        q = self.codes.view(rows, cols // Q4_1_GROUP, Q4_1_GROUP).float()
        return (scale.unsqueeze(-1) * q + offset.unsqueeze(-1)).view(rows, cols)


def unpack_q4_k_super(blocks: np.ndarray, rows: int, cols: int) -> KQ4Weight:
    """Raw bytes ``[rows, cols // 256 * 144]`` uint8 of one ``Q4_K`` tensor -> :class:`KQ4Weight`
    (ggml's ``block_q4_K``, as in :func:`unpack_q4_k`), the scales as they are.

    Raises:
        ValueError: ``cols`` not a multiple of 256.
    """
    b = _blocks(blocks, rows, cols, "Q4_K", Q4_K_SUPER, 144)
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, -1, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))

    return KQ4Weight(t(codes), t(_half(b, 0)), t(_half(b, 2)), t(sc), t(mn))


def unpack_q5_k(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 256 * 176]`` of one ``Q5_K`` tensor -> :class:`Q4_1Weight` with
    codes 0..31. ggml's ``block_q5_K``: ``Q4_K``'s ``d``, ``dmin`` and 12 scale bytes, then 32
    bytes ``qh`` of fifth bits and 128 of nibbles; per 64 weights ``i`` (groups ``2i``, ``2i + 1``)
    the low nibbles of 32 bytes with bit ``2i`` of ``qh[l]``, then their high nibbles with bit
    ``2i + 1``; ``w = (d * sc[j]) * q - dmin * mn[j]`` (scale and offset rounded as in
    :func:`unpack_q4_k`)."""
    b = _blocks(blocks, rows, cols, "Q5_K", Q4_K_SUPER, 176)
    gd, gm = _k_groups(b)
    qh = b[..., 16:48]  # [rows, nb, 32]
    qs = b[..., 48:].reshape(rows, -1, 4, 32)
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4  # [rows, nb, 8, 32]
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
    return _weight(low | high, gd, gm, rows, cols)


def unpack_q8_0(blocks: np.ndarray, rows: int, cols: int) -> SymmetricWeight:
    """Raw bytes ``[rows, cols // 32 * 34]`` of one ``Q8_0`` tensor (ggml's ``block_q8_0``: float16
    ``d``, 32 int8 ``q``; ``w = d * q``) -> :class:`SymmetricWeight` (codes ``q + 128``)."""
    b = _blocks(blocks, rows, cols, "Q8_0", 32, 34)
    codes = (b[..., 2:] ^ 0x80).reshape(rows, cols)  # (int8 q + 128, as a byte: the sign bit flipped)
    return SymmetricWeight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(_half(b, 0).copy()), 128)


def unpack_q5_0(blocks: np.ndarray, rows: int, cols: int) -> SymmetricWeight:
    """Raw bytes ``[rows, cols // 32 * 22]`` of one ``Q5_0`` tensor -> :class:`SymmetricWeight`
    (codes ``q`` in 0..31, ``c = 16``). ggml's ``block_q5_0``: float16 ``d``, a 32-bit word ``qh``
    of fifth bits and 16 bytes of nibbles; weight ``j < 16`` is ``(qs[j] & 15) | bit j of qh << 4``,
    weight ``16 + j`` is ``(qs[j] >> 4) | bit 16 + j of qh << 4``; ``w = d * (q - 16)``."""
    b = _blocks(blocks, rows, cols, "Q5_0", 32, 22)
    codes = _nibbles(b[..., 6:]) | _fifth_bits(b[..., 2:6])
    return SymmetricWeight(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
                           torch.from_numpy(_half(b, 0).copy()), 16)


@dataclass(frozen=True)
class BlockReader:
    """How one GGML type reads into the kernel's group form.

    Attributes:
        unpack: raw rows ``[rows, row_bytes]``, rows, cols -> :class:`Q4_1Weight` or
            :class:`SymmetricWeight`.
        bits: the kernel's code width for it (4, or 8 for 5- and 8-bit codes).
        max_code: the largest code (15, 31 or 255): at most 31 can use the kernel's 5-bit streams.
    """

    unpack: Callable[[np.ndarray, int, int], Q4_1Weight | SymmetricWeight]
    bits: int
    max_code: int


BLOCK_READERS: dict[str, BlockReader] = {
    "Q4_0": BlockReader(unpack_q4_0, 4, 15),
    "Q4_1": BlockReader(unpack_q4_1, 4, 15),
    "Q4_K": BlockReader(unpack_q4_k, 4, 15),
    "Q5_0": BlockReader(unpack_q5_0, 8, 31),
    "Q5_1": BlockReader(unpack_q5_1, 8, 31),
    "Q5_K": BlockReader(unpack_q5_k, 8, 31),
    "Q8_0": BlockReader(unpack_q8_0, 8, 255),
}


# GGML types the AVX2 library dequantizes to gguf's float32 values: (its op, bytes a super-block)
_NATIVE_DEQUANTIZE = {"Q4_K": ("dequantize_q4_k", 144), "Q6_K": ("dequantize_q6_k", 210)}


def native_dequantize(kind: str) -> bool:
    """Whether :func:`dequantize` reads ``kind`` here: one of its types, with the AVX2 library
    loaded (elsewhere gguf's numpy dequantizes it: ``CheckpointTensors.read_float``)."""
    from sgrt.kernels import woq

    return kind in _NATIVE_DEQUANTIZE and woq.isa() == "avx2"


def dequantize(kind: str, blocks: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Raw bytes ``[rows, cols // 256 * size]`` uint8 of one ``Q4_K`` or ``Q6_K`` tensor (see
    :func:`native_dequantize`) -> float32 ``[rows, cols]``: the values ``gguf.quants.dequantize``
    gives, bit for bit, by the AVX2 library's ``dequantize_q4_k`` / ``dequantize_q6_k`` in one
    pass (~7x gguf's numpy, the reference). ggml's ``dequantize_row_q4_K``: group ``j`` of 32
    ``(d * sc[j]) * q - dmin * mn[j]``; ``dequantize_row_q6_K``: per 16 weights ``(d * scale) *
    (q - 32)``, ``q`` six bits from ``ql`` and ``qh``; each product and difference one float32
    rounding.

    Raises:
        ValueError: ``cols`` not a multiple of 256, ``blocks`` not that size, or another ``kind``.
        RuntimeError: the AVX2 library is not loaded.
    """
    from sgrt.kernels import woq

    if kind not in _NATIVE_DEQUANTIZE:
        raise ValueError(f"dequantize reads {', '.join(_NATIVE_DEQUANTIZE)}, not {kind}")
    if woq.isa() != "avx2":
        raise RuntimeError("sgrt.models.gguf_raw.dequantize needs the AVX2 library, which is not loaded")
    op, size = _NATIVE_DEQUANTIZE[kind]
    b = _blocks(blocks, rows, cols, kind, Q4_K_SUPER, size)
    return getattr(torch.ops.sgrt_woq_avx2, op)(torch.from_numpy(b), rows, cols)


def wider_than_4_bits(kind: str) -> bool:
    """Whether a GGML type (``"Q5_0"``, ``"Q4_K"``, ...) holds more precision than int4 can
    (not in :data:`NARROW_TYPES`): int4 mode keeps such a tensor in int8."""
    return kind not in NARROW_TYPES
