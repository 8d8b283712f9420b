"""A checkpoint's tensors read one row range at a time, without holding the file in memory.

:class:`CheckpointTensors` is the table of a GGUF file's or an HF folder's weight tensors: for
each, the file, the byte offset of its first row, its storage type (a GGML type name such as
``"Q4_1"`` / ``"Q6_K"``, or ``"F32"`` / ``"F16"`` / ``"BF16"``) and its shape in HF layout
(``[rows, cols]``, ``[out_features, in_features]`` for a projection). Rows of every type are
contiguous runs of bytes (a GGML block never spans two rows), so :meth:`CheckpointTensors.read_raw`
reads rows ``r0 .. r1`` with one ``pread`` into a buffer of their size, and
:meth:`CheckpointTensors.read_float` turns them into float32 (``gguf.quants.dequantize`` for GGML
types). Nothing is memory-mapped: mapped pages stay in a process's resident set until unmapped,
so reading a 5 GB file through a mapping would show 5 GB of RSS during a load that needs one
tensor's worth at a time.

The safetensors header (an 8-byte little-endian length, then JSON: ``dtype``, ``shape``,
``data_offsets`` per tensor) is read as its format description gives it
(https://github.com/huggingface/safetensors, "Format"). A GGUF's tensor table comes from
``gguf.GGUFReader`` (:func:`gguf_tensor_table`).
"""
from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgrt.errors import ModelLoadError
from sgrt.models import gguf_raw
from sgrt.models.checkpoint import unpermute_rotary
from sgrt.models.config import ModelConfig

# safetensors dtype -> (our type name, bytes an element); only float weights load
_SAFETENSORS_TYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}
DEFAULT_GGUF_ALIGNMENT = 32  # (GGUF's, where general.alignment does not say)
_FLOAT_TYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
                "BF16": (np.uint16, torch.bfloat16)}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are.

    Attributes:
        name: the checkpoint's own HF-style name (``model.layers.0.self_attn.q_proj.weight``; a
            GGUF's names mapped by its family, before any splitting of fused tensors).
        path: the file that holds it.
        offset: byte offset of its first row in ``path``.
        type: ``"F32"``, ``"F16"``, ``"BF16"`` or a GGML quantized type name (``"Q4_1"``, ...).
        shape: ``(rows, cols)``, or ``(n,)`` for a vector (read as one row).
        row_bytes: bytes a row.
    """

    name: str
    path: str
    offset: int
    type: str
    shape: tuple[int, ...]
    row_bytes: int

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]

    def to_json(self) -> list:
        return [self.name, self.path, self.offset, self.type, list(self.shape), self.row_bytes]

    @staticmethod
    def from_json(v: list) -> "TensorEntry":
        return TensorEntry(v[0], v[1], int(v[2]), v[3], tuple(int(x) for x in v[4]), int(v[5]))


class CheckpointTensors:
    """The weight tensors of one checkpoint by name, read by row ranges (module docstring).

    Args:
        entries: every tensor, by :attr:`TensorEntry.name`.
        spec: the model spec, for error messages.
    """

    def __init__(self, entries: dict[str, TensorEntry], spec: str = "") -> None:
        self.entries = entries
        self.spec = spec
        self._fds: dict[str, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def close(self) -> None:
        """Close the files opened by the reads."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_raw(self, entry: TensorEntry, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0 .. r1`` of ``entry`` as stored: ``[r1 - r0, row_bytes]`` uint8 (a fresh buffer).

        Raises:
            ModelLoadError: the file is shorter than its header says (names the tensor).
        """
        fd = self._fds.get(entry.path)
        if fd is None:
            fd = self._fds[entry.path] = os.open(entry.path, os.O_RDONLY)
        want = (r1 - r0) * entry.row_bytes
        buf = np.empty(want, dtype=np.uint8)  # (not zeroed first: the read fills it)
        view, got = memoryview(buf), 0
        while got < want:
            n = os.preadv(fd, [view[got:]], entry.offset + r0 * entry.row_bytes + got)
            if n <= 0:
                raise ModelLoadError(f"model {self.spec!r}: {entry.path} ends inside tensor {entry.name!r} "
                                     f"(truncated file?)")
            got += n
        return buf.reshape(r1 - r0, entry.row_bytes)

    def read_float(self, entry: TensorEntry, r0: int, r1: int, bf16: bool = False) -> torch.Tensor:
        """Rows ``r0 .. r1`` of ``entry`` in float32, ``[r1 - r0, cols]``: float types widened
        exactly, GGML types dequantized by ``gguf`` (the file's values, as llama.cpp defines them;
        ``Q4_K`` and ``Q6_K`` by :func:`gguf_raw.dequantize` where the AVX2 library is loaded, the same
        values).
        ``bf16``: a bfloat16 tensor's rows stay bfloat16 (a view of the file's bytes; the same
        values, for a reader that widens them itself).

        Raises:
            ModelLoadError: a type ``gguf`` cannot dequantize.
        """
        raw = self.read_raw(entry, r0, r1)
        if entry.type in _FLOAT_TYPES:
            np_dtype, torch_dtype = _FLOAT_TYPES[entry.type]
            t = torch.from_numpy(raw.view(np_dtype).reshape(r1 - r0, entry.cols))
            if torch_dtype == torch.bfloat16:
                return t.view(torch_dtype) if bf16 else t.view(torch_dtype).float()
            return t.float()
        if gguf_raw.native_dequantize(entry.type):  # (the same values in one native pass)
            return gguf_raw.dequantize(entry.type, raw, r1 - r0, entry.cols)
        import gguf

        try:
            kind = gguf.GGMLQuantizationType[entry.type]
            w = gguf.quants.dequantize(raw, kind)
        except (KeyError, NotImplementedError) as e:
            raise ModelLoadError(f"model {self.spec!r}: tensor {entry.name!r} has type {entry.type}, "
                                 f"which gguf cannot dequantize: {e}") from e
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(r1 - r0, entry.cols))


@functools.lru_cache(maxsize=None)
def readable_type(kind: str) -> bool:
    """Whether :meth:`CheckpointTensors.read_float` reads tensors of ``kind`` (a float type, or a
    GGML type ``gguf`` dequantizes: tried on one zero block)."""
    import gguf

    if kind in _FLOAT_TYPES:
        return True
    try:
        qtype = gguf.GGMLQuantizationType[kind]
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (KeyError, NotImplementedError):
        return False
    return True


def gguf_tensor_table(reader: Any, family: Any, path: Path, spec: str,
                      skip: frozenset[str] = frozenset()) -> dict[str, TensorEntry]:
    """The tensors of an open ``gguf.GGUFReader`` by HF name (``family.gguf_hf_name``), GGUF's
    innermost-first dims turned into HF's ``(rows, cols)``. ``skip``: GGUF names left out
    (rotary metadata tensors).

    Raises:
        ModelLoadError: a tensor with no counterpart in the family, of more than 2 dimensions, or
            of a type :meth:`CheckpointTensors.read_float` cannot read (names it and the file).
    """
    import gguf

    out: dict[str, TensorEntry] = {}
    align = reader.fields.get("general.alignment")
    alignment = int(align.contents()) if align is not None else DEFAULT_GGUF_ALIGNMENT
    for t in reader.tensors:
        if (int(t.data_offset) - int(reader.data_offset)) % alignment:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} in {path} starts at byte {t.data_offset}, "
                                 f"not on the file's {alignment}-byte alignment (a corrupt tensor description)")
        if t.name in skip:
            continue
        name = family.gguf_hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has no {family.name} counterpart")
        dims = [int(x) for x in t.shape]
        if len(dims) > 2:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} in {path} has {len(dims)} dimensions "
                                 f"{dims}; weights have 1 or 2")
        if not readable_type(t.tensor_type.name):
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} in {path} has type {t.tensor_type.name}, "
                                 f"which sgrt cannot read (gguf has no dequantization for it)")
        shape = (dims[1], dims[0]) if len(dims) == 2 else (dims[0],)
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        out[name] = TensorEntry(name, str(path), int(t.data_offset), t.tensor_type.name, shape,
                                dims[0] // block * size)
    return out


def safetensors_table(files: list[Path], spec: str) -> dict[str, TensorEntry]:
    """The float tensors of safetensors files by name, from their headers alone.

    Raises:
        ModelLoadError: an unreadable header, or a tensor of another dtype than F32 / F16 / BF16
            (names it).
    """
    out: dict[str, TensorEntry] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"model {spec!r}: cannot read the safetensors header of {f}: {e}") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_TYPES:
                raise ModelLoadError(f"model {spec!r}: tensor {name!r} in {f} has dtype {info['dtype']}; "
                                     f"sgrt reads {', '.join(_SAFETENSORS_TYPES)} checkpoints")
            kind, size = _SAFETENSORS_TYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            out[name] = TensorEntry(name, str(f), 8 + n + int(info["data_offsets"][0]), kind,
                                    shape, shape[-1] * size if shape else size)
    return out


def safetensors_files(folder: Path, spec: str) -> list[Path]:
    """The weight files of an HF folder: the shards listed in ``model.safetensors.index.json``,
    else ``model.safetensors``, else every ``*.safetensors``.

    Raises:
        ModelLoadError: no safetensors file, or a listed shard is missing (names them).
    """
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif single.is_file():
        files = [single]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(f"model {spec!r}: no weights found; looked for {index}, {single}, "
                             f"{folder}/*.safetensors" + (f"; missing shards {missing}" if missing else ""))
    return files



def read_safetensors(folder: Path, spec: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's weight files (:func:`safetensors_files`) in memory, by name:
    for references and tools; loads read a tensor at a time instead (:mod:`sgrt.models.
    weight_packer`).

    Raises:
        ModelLoadError: no safetensors file (names the files looked for).
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder, spec):
        state.update(load_file(str(f), device="cpu"))
    return state

# ---- canonical weights: rows of the checkpoint's tensors ----------------------------------------

@dataclass(frozen=True)
class Part:
    """Rows of one checkpoint tensor that make up one canonical weight.

    Attributes:
        entry: the tensor. row0, rows: its rows that are this weight (a fused tensor's share).
        heads: undo llama.cpp's rotary row order, per head of ``rows // heads`` rows (GGUF q / k).
        shift: subtracted from the values (llama.cpp stores Gemma's norms as ``1 + w``).
    """

    entry: TensorEntry
    row0: int
    rows: int
    heads: int | None = None
    shift: float = 0.0

    def read(self, tensors: CheckpointTensors, a: int, b: int, blocks: bool, bf16: bool = False) -> Any:
        """Its rows ``a .. b``: the file's blocks (:data:`gguf_raw.BLOCK_READERS`'s weight) if
        ``blocks``, else float32 ``[b - a, cols]`` (``bf16``: a bfloat16 part's rows as bfloat16,
        the same values)."""
        a0, b0 = self._span(a, b)
        lo, hi = self.row0 + a0, self.row0 + b0
        if blocks:
            w = gguf_raw.BLOCK_READERS[self.entry.type].unpack(tensors.read_raw(self.entry, lo, hi), hi - lo,
                                                              self.entry.cols)
            fields = [w.codes, w.d] + ([w.m] if isinstance(w, gguf_raw.Q4_1Weight) else [])
        else:
            fields = [tensors.read_float(self.entry, lo, hi, bf16 and not self.shift)]
        if self.heads:
            fields = [unpermute_rotary(t, (b0 - a0) // (self.rows // self.heads)) for t in fields]
        fields = [t[a - a0: b - a0] for t in fields]
        if not blocks:
            return fields[0] - self.shift if self.shift else fields[0]
        if isinstance(w, gguf_raw.Q4_1Weight):
            return gguf_raw.Q4_1Weight(*fields)
        return gguf_raw.SymmetricWeight(fields[0], fields[1], w.c)

    def read_raw(self, tensors: CheckpointTensors, a: int, b: int) -> np.ndarray:
        """Its rows ``a .. b`` as the file stores them, ``[b - a, row_bytes]`` uint8, in HF's row
        order (a GGUF q / k part's rows unpermuted: whole rows of blocks move)."""
        a0, b0 = self._span(a, b)
        raw = tensors.read_raw(self.entry, self.row0 + a0, self.row0 + b0)
        if self.heads:
            raw = unpermute_rotary(torch.from_numpy(raw), (b0 - a0) // (self.rows // self.heads)).numpy()
        return raw[a - a0: b - a0]

    def _span(self, a: int, b: int) -> tuple[int, int]:
        """The rows read for rows ``a .. b``: whole heads where rows are unpermuted by heads."""
        if not self.heads:
            return a, b
        hd = self.rows // self.heads
        return a // hd * hd, -(-b // hd) * hd


def canonical_parts(entries: dict[str, TensorEntry], family: Any, config: ModelConfig, gguf: bool
                    ) -> dict[str, Part]:
    """Every canonical weight (Llama names without the ``model.`` prefix: ``layers.0.self_attn.
    q_proj.weight``, ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``) as a
    :class:`Part` of a checkpoint tensor: fused tensors split by ``family.fused_parts``; for a
    GGUF (``gguf``) q / k rows marked for unpermuting where the family's file permutes them, and
    norms for the family's norm offset."""
    out: dict[str, Part] = {}
    for name, entry in entries.items():
        split = family.fused_parts(name, config) or [(name, 0, entry.rows)]
        for part, row0, rows in split:
            key = part.removeprefix("model.")
            heads = None
            if gguf and family.gguf_unpermute_qk:
                if key.endswith("self_attn.q_proj.weight"):
                    heads = config.num_attention_heads
                elif key.endswith("self_attn.k_proj.weight"):
                    heads = config.num_key_value_heads
            shift = family.gguf_norm_offset if gguf and key.endswith("norm.weight") else 0.0
            out[key] = Part(entry, row0, rows, heads, shift)
    return out


def read_rows(tensors: CheckpointTensors, parts: list[Part], r0: int, r1: int, blocks: bool,
              raw: bool = False, bf16: bool = False) -> list[Any]:
    """Rows ``r0 .. r1`` of the weight the parts stack, as each part's pieces (:meth:`Part.read`;
    with ``raw``, :meth:`Part.read_raw`)."""
    pieces, at = [], 0
    for p in parts:
        lo, hi = max(r0, at), min(r1, at + p.rows)
        if lo < hi:
            pieces.append(p.read_raw(tensors, lo - at, hi - at) if raw else p.read(tensors, lo - at, hi - at, blocks,
                                                                                   bf16))
        at += p.rows
    return pieces
