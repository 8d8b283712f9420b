"""What is wrong with a GGUF file that ``gguf.GGUFReader`` cannot read, in words.

``gguf``'s reader maps the file and slices it where the header says; on a file cut short or
overwritten it fails deep inside numpy ("cannot reshape array of size 6 into shape (256,)",
"index 0 is out of bounds"). :func:`gguf_layout_problem` walks the same layout with a bounds
check at every step and says which part is wrong: the header, a metadata entry (by key), a
tensor's description or its data (by name). It runs only after the reader failed (a load reads a
file's metadata once, in :mod:`sgrt.models.gguf_convert`'s child), so it is written for clear
messages, not speed.

The layout, from the GGUF specification (ggml's ``docs/gguf.md``): a header (``b"GGUF"``, a uint32
version, uint64 tensor and metadata counts), the metadata (key, uint32 value type, value), the
tensor descriptions (name, uint32 dimension count, uint64 dimensions innermost first, uint32 GGML
type, uint64 offset into the data), padding to ``general.alignment`` (32 by default), the data.
Strings are a uint64 length and UTF-8 bytes; arrays a uint32 item type, a uint64 count and items.
Everything is little-endian.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

HEADER_BYTES = 24
VERSIONS = (2, 3)
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# metadata value types: (name, bytes) for the fixed-size ones
_SCALARS = {0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4), 5: ("int32", 4),
            6: ("float32", 4), 7: ("bool", 1), 10: ("uint64", 8), 11: ("int64", 8), 12: ("float64", 8)}
_STRING, _ARRAY = 8, 9
_UINT_FORMATS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


class _Bad(Exception):
    """The first thing found wrong (the message)."""


class _Cursor:
    """Reads little-endian values from ``buf`` at ``at``, failing with ``where`` named."""

    def __init__(self, buf: memoryview, size: int) -> None:
        self.buf, self.size, self.at = buf, size, 0
        self.where = "the header"

    def need(self, n: int) -> None:
        if n < 0 or self.at + n > self.size:
            raise _Bad(f"the file ends inside {self.where} (it is {self.size} bytes, cut short?)")

    def uint(self, n: int) -> int:
        self.need(n)
        (v,) = struct.unpack_from(_UINT_FORMATS[n], self.buf, self.at)
        self.at += n
        return v

    def string(self) -> str:
        n = self.uint(8)
        if n > self.size - self.at:
            raise _Bad(f"{self.where} has a string of {n} bytes, past the end of the file ({self.size} bytes): "
                       f"cut short or corrupt")
        raw = bytes(self.buf[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{self.where} has a string that is not UTF-8 (corrupt)") from None


def gguf_layout_problem(path: str | Path) -> str | None:
    """What is wrong with the layout of the GGUF at ``path`` (a sentence naming the part: the
    header, a metadata key, a tensor), or None where its header, metadata, tensor descriptions
    and data extents are all consistent with the file (the fault is elsewhere).

    Raises:
        OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return "the file is empty"
        # (mapped, not read: only the metadata's pages are touched)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                _walk(view, size)
            except _Bad as e:
                return str(e)
            finally:
                view.release()
    return None


def _walk(buf: memoryview, size: int) -> None:
    import gguf

    c = _Cursor(buf, size)
    if bytes(buf[:4]) != b"GGUF":
        raise _Bad(f"it does not start with GGUF's magic bytes b'GGUF' but {bytes(buf[:4])!r}: not a GGUF file")
    c.at = 4
    version = c.uint(4)
    if version not in VERSIONS:
        raise _Bad(f"it is GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
    n_tensors, n_kv = c.uint(8), c.uint(8)
    # (the smallest metadata entry: a 1-byte key and a 1-byte value; tensor description: 1-byte name, 1 dim)
    if n_kv * 14 > size:
        raise _Bad(f"its header claims {n_kv} metadata entries, more than its {size} bytes can hold (corrupt)")
    if n_tensors * 33 > size:
        raise _Bad(f"its header claims {n_tensors} tensors, more than its {size} bytes can hold (corrupt)")
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        c.where = f"metadata entry {i}"
        key = c.string()
        c.where = f"metadata {key!r}"
        kind = c.uint(4)
        value = _value(c, kind, key)
        if key == "general.alignment":
            if kind != 4 or not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise _Bad(f"metadata 'general.alignment' is {value!r}, not a power of two (uint32)")
            alignment = value
    tensors, names = [], set()
    for i in range(n_tensors):
        c.where = f"tensor description {i}"
        name = c.string()
        c.where = f"the description of tensor {name!r}"
        if name in names:
            raise _Bad(f"tensor {name!r} is described twice")
        names.add(name)
        n_dims = c.uint(4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = [c.uint(8) for _ in range(n_dims)]
        type_id = c.uint(4)
        offset = c.uint(8)
        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise _Bad(f"tensor {name!r} has type id {type_id}, which is no GGML type") from None
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise _Bad(f"tensor {name!r}: its rows of {dims[0]} values are not whole {kind.name} blocks of {block}")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_bytes
        if offset % alignment:
            raise _Bad(f"tensor {name!r}: its data offset {offset} is not a multiple of the alignment {alignment}")
        tensors.append((name, kind.name, dims, offset, nbytes))
    c.where = "the padding before the tensor data"
    start = -(-c.at // alignment) * alignment
    for name, kind, dims, offset, nbytes in tensors:
        end = start + offset + nbytes
        if end > size:
            raise _Bad(f"tensor {name!r} ({kind}, {' x '.join(map(str, reversed(dims)))}) lies at bytes "
                       f"{start + offset}..{end}, past the end of the file ({size} bytes): the file is cut short "
                       f"(an interrupted download or copy?) or its description is corrupt")


def _value(c: _Cursor, kind: int, key: str) -> object:
    """Read one metadata value of type ``kind``: an unsigned integer's value, a string; None for
    the rest (skipped, an array's items each checked)."""
    if kind in _SCALARS:
        n = _SCALARS[kind][1]
        if kind in (0, 2, 4, 10):
            return c.uint(n)
        c.need(n)
        c.at += n
        return None
    if kind == _STRING:
        return c.string()
    if kind != _ARRAY:
        raise _Bad(f"metadata {key!r} has value type {kind}, which GGUF does not define")
    item = c.uint(4)
    count = c.uint(8)
    # (the fewest bytes an item takes: a scalar's size, a string's or an array's length fields)
    least = _SCALARS[item][1] if item in _SCALARS else {_STRING: 8, _ARRAY: 12}.get(item)
    if least is None:
        raise _Bad(f"metadata {key!r} is an array of value type {item}, which GGUF does not define")
    if count * least > c.size - c.at:
        raise _Bad(f"metadata {key!r}: an array of {count} items, more than the file holds after it "
                   f"(cut short or corrupt)")
    if item in _SCALARS:
        c.at += count * least
        return None
    where = c.where
    for j in range(count):
        c.where = f"{where}, item {j}"
        _value(c, item, key)
    c.where = where
    return None
