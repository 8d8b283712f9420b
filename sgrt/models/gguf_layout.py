"""A GGUF's metadata and tensor descriptions read without parsing its arrays, in the shape
:func:`~sgrt.models.checkpoint.gguf_hf_config` and :func:`~sgrt.models.weight_files.
gguf_tensor_table` read from a ``gguf.GGUFReader``.

``gguf.GGUFReader`` builds a numpy view of every value of every field: ~2-5 s for a 49k-token
vocabulary on a busy 2-core machine, and a GGUF's cache entry paid it twice (sgrt's config and
tensor table, then transformers' tokenizer). The config and the table need no array but the
vocabulary's length, so :func:`read_layout` walks the file once through a memory map
(:mod:`sgrt.models.gguf_header`'s cursor: scalars and strings kept, arrays stepped over), then
reads the tensor descriptions, checking every bound and each tensor's type, block shape,
alignment and extent. :class:`LayoutReader` answers ``fields[key].contents()``, ``tensors``
(name, shape, type, offset; ``data`` read from the file when asked: the rotary tensors) and
``data_offset`` as the reader does.

Anything it does not take (a big-endian file, an array read as a value, anything the checks
refuse) raises :class:`NotReadHere`: the caller then parses with ``gguf.GGUFReader``, whose
failures are explained by :mod:`sgrt.models.gguf_check` as before.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgrt.models.gguf_header import GGUFArray, _Cursor

MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


class NotReadHere(Exception):
    """The file (or a field asked for) is one :class:`LayoutReader` leaves to ``gguf.GGUFReader``."""


class _Field:
    """One metadata value as ``gguf``'s ``ReaderField`` shows it to sgrt: ``contents()``, and
    ``data`` whose length is an array's item count."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def contents(self) -> Any:
        if isinstance(self.value, GGUFArray):
            raise NotReadHere("an array's items were not read")
        return self.value

    @property
    def data(self) -> Any:
        if isinstance(self.value, GGUFArray):
            return range(self.value.count)
        return [0]


@dataclass
class LayoutTensor:
    """A tensor's description: ``shape`` innermost first (GGUF's order, as ``gguf``'s
    ``ReaderTensor.shape``), ``tensor_type`` a ``gguf.GGMLQuantizationType``, ``data_offset``
    absolute in the file, ``n_bytes`` its data's length."""

    name: str
    shape: list[int]
    tensor_type: Any
    data_offset: int
    n_bytes: int
    path: Path

    @property
    def data(self) -> Any:
        """The tensor's values read from the file: a numpy array of its float type, shaped
        outermost first, or its blocks as ``uint8`` rows (``gguf``'s ``ReaderTensor.data``)."""
        import gguf
        import numpy as np

        floats = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        dims = tuple(reversed(self.shape))
        with open(self.path, "rb") as f:
            f.seek(self.data_offset)
            raw = f.read(self.n_bytes)
        if self.tensor_type in floats:
            return np.frombuffer(raw, dtype=floats[self.tensor_type]).reshape(dims)
        return np.frombuffer(raw, dtype=np.uint8).reshape(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))


class LayoutReader:
    """What :func:`read_layout` found, read as a ``gguf.GGUFReader`` (module docstring).

    Attributes:
        fields: key -> field (``contents()``: int, float, bool or str; arrays raise
            :class:`NotReadHere`).
        tensors: the tensor descriptions in file order.
        data_offset: the byte where tensor data starts (the metadata's length, padded).
        data: carries ``filename`` (the path, for messages).
    """

    def __init__(self, path: Path, fields: dict[str, _Field], tensors: list[LayoutTensor], data_offset: int):
        self.fields = fields
        self.tensors = tensors
        self.data_offset = data_offset
        self.data = type("Source", (), {"filename": os.path.abspath(path)})()


def read_layout(path: str | Path) -> LayoutReader:
    """Read the GGUF at ``path`` (module docstring).

    Raises:
        NotReadHere: anything this reader does not take or finds inconsistent (the caller parses
            with ``gguf.GGUFReader``).
        OSError: the file cannot be opened.
    """
    import gguf

    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise NotReadHere("too short")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _read(path, buf, size, gguf)
            except (ValueError, KeyError, struct.error, UnicodeDecodeError, OverflowError) as e:
                raise NotReadHere(str(e)) from e


def _read(path: Path, buf: Any, size: int, gguf: Any) -> LayoutReader:
    if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
        raise NotReadHere("not a little-endian GGUF of version 2 or 3")
    cur = _StrictCursor(buf, "<")
    cur.pos = 8
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    if n_kv * 14 > size or n_tensors * 33 > size:
        raise NotReadHere("counts larger than the file")
    fields: dict[str, _Field] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.take("I"))
        fields.setdefault(key, _Field(value))  # (gguf keeps the first of a repeated key)
    align = fields.get("general.alignment")
    alignment = DEFAULT_ALIGNMENT
    if align is not None:
        alignment = align.value
        if isinstance(alignment, GGUFArray) or not isinstance(alignment, int) or isinstance(alignment, bool) \
                or alignment <= 0 or alignment & (alignment - 1):
            raise NotReadHere("general.alignment is not a power of two")
    infos = []
    names = set()
    for _ in range(n_tensors):
        name = cur.string()
        if name in names:
            raise NotReadHere(f"tensor {name!r} described twice")
        names.add(name)
        n_dims = cur.take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise NotReadHere(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.take("Q") for _ in range(n_dims)]
        kind = gguf.GGMLQuantizationType(cur.take("I"))
        offset = cur.take("Q")
        infos.append((name, dims, kind, offset))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        elements = 1
        for d in dims:
            elements *= d
        if dims[0] % block or offset % alignment:
            raise NotReadHere(f"tensor {name!r}: rows not whole blocks, or data off the alignment")
        n_bytes = elements * type_bytes // block
        if start + offset + n_bytes > size:
            raise NotReadHere(f"tensor {name!r} runs past the end of the file")
        tensors.append(LayoutTensor(name, dims, kind, start + offset, n_bytes, path))
    return LayoutReader(path, fields, tensors, start)


class _StrictCursor(_Cursor):
    """:mod:`sgrt.models.gguf_header`'s cursor whose strings decode as ``gguf``'s do (UTF-8, an
    error where they are not)."""

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text
