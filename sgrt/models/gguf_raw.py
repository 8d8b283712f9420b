"""Raw quantized blocks of a GGUF file, for kernels that run on them without a float round trip.

llama.cpp's Q4_1 block (``block_q4_1`` in ggml's ``ggml-common.h``) covers 32 consecutive weights
of one row in 20 bytes: ``d`` (float16 scale), ``m`` (float16 minimum), then 16 bytes whose low
nibbles are weights 0..15 and high nibbles weights 16..31. A weight is ``w = d * q + m`` with
``q`` in 0..15 (this is what ``gguf.quants.dequantize`` computes, in float32). A Q4_K
super-block (256 weights) has the same form per group of 32, with each group's scale and minimum
a product of two numbers (:func:`unpack_q4_k`): it is read into Q4_1's form too, so int4 takes a
K-quant file's 4-bit tensors with their codes as they are instead of re-quantizing them.

:func:`read_q4_1` returns, per HF parameter name, the codes and per-block ``d`` / ``m``, with
llama.cpp's q/k row permutation undone on whole rows (the same
:func:`sgrt.models.checkpoint.unpermute_rotary` the float conversion uses), so row ``i`` here is row
``i`` of the converted float weight. Parsing a GGUF's metadata takes seconds (the tokenizer's
100k strings), so :func:`load_q4_groups` keeps the blocks (and every tensor's type) beside the float conversion in its cache
folder (``q4_groups.safetensors``: codes two a byte, ``d``, ``m``) and reads them from there next time.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgrt.errors import ModelLoadError
from sgrt.models.checkpoint import GGUFFile

Q4_1_GROUP = 32  # weights per block
_Q4_1_BLOCK_BYTES = 20  # 2 (d) + 2 (m) + 16 (codes)
# (named anew when Q4_K joined Q4_1: a cache written before holds the Q4_1 tensors only)
Q4_1_CACHE_FILE = "q4_groups.safetensors"
# GGML tensor types whose codes have at most 4 bits a weight: sgrt's int4 layout (16 levels per
# group of 32 with a float16 scale and offset) is as fine as they are. Every other type (Q5_*,
# Q6_K, Q8_*, F16, BF16, F32, ...) holds more levels than int4 can, so re-quantizing it to int4
# loses precision the file has: on Gemma 3 270M Q4_K_M (mostly Q5_0) that cost top-1 agreement
# with the file's float32 weights 97% -> 60% (mean KL 0.0045 -> 0.50).
NARROW_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S",
                          "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q1_0"})


@dataclass
class Q4_1Weight:
    """One Q4_1 weight matrix ``[rows, cols]`` (HF layout: ``[out_features, in_features]``).

    Attributes:
        codes: ``[rows, cols]`` uint8, values 0..15.
        d: ``[rows, cols // 32]`` float16 scale of each block.
        m: ``[rows, cols // 32]`` float16 minimum of each block.
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """``d * q + m`` in float32, ``[rows, cols]``: the file's weights, bit for bit."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // Q4_1_GROUP, Q4_1_GROUP).float()
        w = self.d.float().unsqueeze(-1) * q + self.m.float().unsqueeze(-1)
        return w.view(rows, cols)

    @staticmethod
    def cat(parts: list["Q4_1Weight"]) -> "Q4_1Weight":
        """Concatenate along rows (output features), as the fused qkv / gate_up layers need."""
        return Q4_1Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                          torch.cat([p.m for p in parts]))


def unpack_q4_1(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 32 * 20]`` uint8 of one tensor -> :class:`Q4_1Weight`."""
    if cols % Q4_1_GROUP:
        raise ValueError(f"Q4_1 row length {cols} is not a multiple of {Q4_1_GROUP}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, cols // Q4_1_GROUP, _Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    m = b[..., 2:4].copy().view(np.float16)[..., 0]
    qs = b[..., 4:]  # [rows, blocks, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return Q4_1Weight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d.copy()),
                      torch.from_numpy(m.copy()))


Q4_K_SUPER = 256  # weights per Q4_K super-block: 8 groups of 32
_Q4_K_BLOCK_BYTES = 144  # 2 (d) + 2 (dmin) + 12 (6-bit scales and mins) + 128 (codes)


def unpack_q4_k(blocks: np.ndarray, rows: int, cols: int) -> Q4_1Weight:
    """Raw bytes ``[rows, cols // 256 * 144]`` uint8 of one Q4_K tensor -> :class:`Q4_1Weight`.

    ggml's ``block_q4_K``: per 256 weights a float16 ``d`` and ``dmin``, 8 six-bit scales ``sc``
    and mins ``mn`` (packed in 12 bytes), and 4-bit codes; group ``j`` of 32 weights is
    ``w = (d * sc[j]) * q - (dmin * mn[j])``. That is Q4_1's form per group of 32, so the codes
    are kept as they are and ``d * sc[j]`` / ``-(dmin * mn[j])`` become the group's float16 ``d``
    / ``m`` (rounded once to float16: relative error <= 2**-11 of a group's scale and minimum,
    against up to half a step when a group is re-quantized by its min / max).
    """
    if cols % Q4_K_SUPER:
        raise ValueError(f"Q4_K row length {cols} is not a multiple of {Q4_K_SUPER}")
    nb = cols // Q4_K_SUPER
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, nb, _Q4_K_BLOCK_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 4:16].astype(np.uint8)  # [rows, nb, 12]
    sc = np.empty((rows, nb, 8), dtype=np.uint8)
    mn = np.empty((rows, nb, 8), dtype=np.uint8)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    qs = b[..., 16:].reshape(rows, nb, 4, 32)  # per 64 weights: low nibbles group 2i, high 2i + 1
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    gd = (d[..., None] * sc.astype(np.float32)).astype(np.float16).reshape(rows, nb * 8)
    gm = (-(dmin[..., None] * mn.astype(np.float32))).astype(np.float16).reshape(rows, nb * 8)
    return Q4_1Weight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(gd.copy()),
                      torch.from_numpy(gm.copy()))


# The 4-bit GGML types read as Q4_1-form groups of 32 (codes as they are), by type name.
_Q4_READERS = {"Q4_1": unpack_q4_1, "Q4_K": unpack_q4_k}


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

    @staticmethod
    def cat(parts: list["SymmetricWeight"]) -> "SymmetricWeight":
        """Concatenate along rows. Parts with different ``c`` (a fused qkv of ``Q5_0`` q / k and a
        ``Q8_0`` v) are shifted to ``c = 128`` first (codes ``q + 112`` for ``Q5_0``: the same
        weights)."""
        c = parts[0].c if all(p.c == parts[0].c for p in parts) else 128
        codes = [p.codes if p.c == c else (p.codes.to(torch.int16) + (c - p.c)).to(torch.uint8) for p in parts]
        return SymmetricWeight(torch.cat(codes), torch.cat([p.d for p in parts]), c)


_Q8_0_BLOCK_BYTES = 34  # 2 (d) + 32 (int8 q)
_Q5_0_BLOCK_BYTES = 22  # 2 (d) + 4 (fifth bits) + 16 (low nibbles)


def unpack_q8_0(blocks: np.ndarray, rows: int, cols: int) -> SymmetricWeight:
    """Raw bytes ``[rows, cols // 32 * 34]`` of one ``Q8_0`` tensor (ggml's ``block_q8_0``: float16
    ``d``, 32 int8 ``q``; ``w = d * q``) -> :class:`SymmetricWeight` (codes ``q + 128``)."""
    if cols % Q4_1_GROUP:
        raise ValueError(f"Q8_0 row length {cols} is not a multiple of {Q4_1_GROUP}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, cols // Q4_1_GROUP, _Q8_0_BLOCK_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    codes = (b[..., 2:] ^ 0x80).reshape(rows, cols)  # (int8 q + 128, as a byte: the sign bit flipped)
    return SymmetricWeight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d.copy()), 128)


def unpack_q5_0(blocks: np.ndarray, rows: int, cols: int) -> SymmetricWeight:
    """Raw bytes ``[rows, cols // 32 * 22]`` of one ``Q5_0`` tensor -> :class:`SymmetricWeight`
    (codes ``q`` in 0..31, ``c = 16``). ggml's ``block_q5_0``: float16 ``d``, a 32-bit word ``qh``
    of fifth bits and 16 bytes of nibbles; weight ``j < 16`` is ``(qs[j] & 15) | bit j of qh << 4``,
    weight ``16 + j`` is ``(qs[j] >> 4) | bit 16 + j of qh << 4``; ``w = d * (q - 16)``."""
    if cols % Q4_1_GROUP:
        raise ValueError(f"Q5_0 row length {cols} is not a multiple of {Q4_1_GROUP}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, cols // Q4_1_GROUP, _Q5_0_BLOCK_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    qh = b[..., 2:6].copy().view("<u4")[..., 0]  # [rows, blocks]
    high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [rows, blocks, 32]
    qs = b[..., 6:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | high
    return SymmetricWeight(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
                           torch.from_numpy(d.copy()), 16)


# The symmetric GGML types read as int8 groups of 32 (SymmetricWeight), by type name.
_Q8_READERS = {"Q8_0": unpack_q8_0, "Q5_0": unpack_q5_0}
Q8_CACHE_FILE = "q8_groups.safetensors"


def read_q4_1(gguf_path: str | Path, spec: str = "", reader: Any = None,
              names: set[str] | None = None, readers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every Q4_1 and Q4_K tensor of a GGUF (Q4_K in Q4_1's form, :func:`unpack_q4_k`), keyed by
    HF parameter name (``model.layers.0.self_attn.q_proj.weight``), q/k rows unpermuted.

    Tensors of other types are left out (the caller quantizes those from float weights).
    ``readers``: other types instead (``_Q8_READERS``: :func:`read_q8_groups`).

    Args:
        reader: an open ``gguf.GGUFReader`` of the file (parsing one takes seconds).
        names: only these HF names (default: all).

    Raises:
        ModelLoadError: the file cannot be read, or a tensor has no Llama counterpart.
    """
    from sgrt.models.layers import FUSED_PROJECTIONS
    from sgrt.models.checkpoint import gguf_config, gguf_family, unpermute_rotary

    if reader is None:
        reader = _open(gguf_path, spec)
    config, _ = gguf_config(reader, spec)
    family = gguf_family(reader, spec)
    # Only tensors that are whole parts of our fused projections (not Phi-3's pre-fused ones).
    parts = {p for ps in FUSED_PROJECTIONS.values() for p in ps} | {"lm_head.weight", "embed_tokens.weight"}
    out: dict[str, Q4_1Weight] = {}
    for t in reader.tensors:
        unpack = (_Q4_READERS if readers is None else readers).get(t.tensor_type.name)
        if unpack is None:
            continue
        name = family.gguf_hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has no {family.name} counterpart")
        if name.removeprefix("model.").split(".", 2)[-1] not in parts and not name.endswith(
                ("lm_head.weight", "embed_tokens.weight")):
            continue
        if names is not None and name not in names:
            continue
        cols, rows = (int(x) for x in t.shape)  # GGUF lists dims innermost first
        w = unpack(t.data, rows, cols)
        n_heads = _rotary_heads(t.name, config) if family.gguf_unpermute_qk else None
        if n_heads is not None and isinstance(w, SymmetricWeight):
            w = SymmetricWeight(*(unpermute_rotary(x, n_heads).contiguous() for x in (w.codes, w.d)), w.c)
        elif n_heads is not None:
            w = Q4_1Weight(*(unpermute_rotary(x, n_heads).contiguous() for x in (w.codes, w.d, w.m)))
        out[name] = w
    return out


def read_tensor_types(gguf_path: str | Path, spec: str = "", reader: Any = None) -> dict[str, str]:
    """The GGML type name (``"Q5_0"``, ``"Q4_K"``, ...) of every tensor of a GGUF that has an HF
    counterpart, keyed by HF parameter name (``model.layers.0.self_attn.q_proj.weight``).

    Raises:
        ModelLoadError: the file cannot be read.
    """
    from sgrt.models.checkpoint import gguf_family

    if reader is None:
        reader = _open(gguf_path, spec)
    family = gguf_family(reader, spec)
    out: dict[str, str] = {}
    for t in reader.tensors:
        name = family.gguf_hf_name(t.name)
        if name is not None:
            out[name] = t.tensor_type.name
    return out


def load_q4_groups(gguf_path: str | Path, cache_folder: str | Path | None, spec: str = "",
                   source: GGUFFile | None = None) -> tuple[dict[str, Q4_1Weight], dict[str, str]]:
    """:func:`read_q4_1` and :func:`read_tensor_types` of one GGUF (one reader), through
    ``cache_folder / q4_groups.safetensors`` (the GGUF's conversion cache entry, whose name already
    digests the file's contents; the types in its metadata): read from it when present, else read
    the GGUF and write it there (atomically; skipped if the folder is read-only). ``source``: the
    load's :class:`GGUFFile` of ``gguf_path``, so that a cache miss shares its one parse."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cached = Path(cache_folder) / Q4_1_CACHE_FILE if cache_folder is not None else None
    if cached is not None and cached.is_file():
        with safe_open(str(cached), "pt") as f:
            meta = f.metadata() or {}
        if "tensor_types" in meta:
            flat = load_file(str(cached))
            names = {k.rsplit(".", 1)[0] for k in flat}
            blocks = {n: Q4_1Weight(_unpack_nibbles(flat[n + ".codes"]), flat[n + ".d"], flat[n + ".m"])
                      for n in sorted(names)}
            return blocks, json.loads(meta["tensor_types"])
    reader = (source or GGUFFile(gguf_path, spec)).reader()
    blocks, types = read_q4_1(gguf_path, spec, reader), read_tensor_types(gguf_path, spec, reader)
    if cached is not None:
        flat = {}
        for n, w in blocks.items():
            flat[n + ".codes"] = (w.codes[:, 0::2] | (w.codes[:, 1::2] << 4)).contiguous()
            flat[n + ".d"], flat[n + ".m"] = w.d, w.m
        _save_cache(flat, cached, {"format": "sgrt-q4-groups", "source": str(gguf_path),
                                   "tensor_types": json.dumps(types, sort_keys=True)})
    return blocks, types


def read_q8_groups(gguf_path: str | Path, spec: str = "", reader: Any = None) -> dict[str, SymmetricWeight]:
    """Every ``Q8_0`` and ``Q5_0`` tensor of a GGUF as :class:`SymmetricWeight`, keyed by HF name,
    q/k rows unpermuted (:func:`read_q4_1`'s rules)."""
    return read_q4_1(gguf_path, spec, reader, readers=_Q8_READERS)


def load_q8_groups(gguf_path: str | Path, cache_folder: str | Path | None, spec: str = "",
                   source: GGUFFile | None = None) -> dict[str, SymmetricWeight]:
    """:func:`read_q8_groups` through ``cache_folder / q8_groups.safetensors`` (codes, ``d``; each
    tensor's ``c`` in the metadata), as :func:`load_q4_groups` caches the 4-bit blocks (``source``
    likewise)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cached = Path(cache_folder) / Q8_CACHE_FILE if cache_folder is not None else None
    if cached is not None and cached.is_file():
        with safe_open(str(cached), "pt") as f:
            meta = f.metadata() or {}
        if "c" in meta:
            flat, cs = load_file(str(cached)), json.loads(meta["c"])
            return {n: SymmetricWeight(flat[n + ".codes"], flat[n + ".d"], int(c)) for n, c in sorted(cs.items())}
    blocks = read_q8_groups(gguf_path, spec, (source or GGUFFile(gguf_path, spec)).reader())
    if cached is not None:
        flat = {}
        for n, w in blocks.items():
            flat[n + ".codes"], flat[n + ".d"] = w.codes, w.d
        _save_cache(flat, cached, {"format": "sgrt-q8-groups", "source": str(gguf_path),
                                   "c": json.dumps({n: w.c for n, w in blocks.items()}, sort_keys=True)})
    return blocks


def _save_cache(flat: dict[str, torch.Tensor], cached: Path, metadata: dict[str, str]) -> None:
    """Write ``flat`` to the safetensors file ``cached`` atomically (a temporary file renamed over
    it, readable as the umask allows); skipped where the folder is read-only (OSError)."""
    from safetensors.torch import save_file

    tmp = cached.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{cached.name}")
    try:
        save_file(flat, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, cached)
    except OSError:
        tmp.unlink(missing_ok=True)


def wider_than_4_bits(types: dict[str, str]) -> frozenset[str]:
    """The HF names among ``types`` (:func:`read_tensor_types`) whose file type is not in
    :data:`NARROW_TYPES`: the tensors that int4 would hold less precisely than the file does."""
    return frozenset(name for name, t in types.items() if t not in NARROW_TYPES)


def _open(gguf_path: str | Path, spec: str) -> Any:
    """A ``gguf.GGUFReader`` of the file; ModelLoadError naming it if it cannot be read."""
    return GGUFFile(gguf_path, spec).reader()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, cols // 2]`` uint8, even column in the low nibble -> ``[rows, cols]`` codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)


def _rotary_heads(gguf_name: str, config: Any) -> int | None:
    if gguf_name.endswith("attn_q.weight"):
        return config.num_attention_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_key_value_heads
    return None
