"""A GGUF file's key-value header, read without parsing its arrays (``sgrt models``, the CLI's
checks before a load).

``gguf.GGUFReader`` parses every field, a tokenizer's 100k-260k strings included (seconds, and
hundreds of MB for Gemma 3's vocabulary: :mod:`sgrt.models.gguf_convert`). This reader walks the
header once through a memory map and keeps scalars and strings; an array keeps its element type
and length only (a string array is stepped over one length prefix at a time, ~0.1 s for 262k
strings). Standard library only: no numpy, no torch.

Layout (GGUF v2 and v3, little-endian; big-endian files are detected by their version field):
magic ``GGUF``, ``uint32`` version, ``uint64`` tensor count, ``uint64`` key-value count, then each
key as a ``uint64``-length UTF-8 string, a ``uint32`` value type and the value; an array is a
``uint32`` element type, a ``uint64`` count and the elements.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF value types -> struct format of the fixed-size ones.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# llama.cpp's ``general.file_type`` numbers (``enum llama_ftype``) -> the names its tools print.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
    18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
    25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
    32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}


@dataclass(frozen=True)
class GGUFArray:
    """An array field, not read: its element type (a GGUF value type number) and length."""

    type: int
    count: int


@dataclass
class GGUFHeader:
    """What :func:`read_gguf_header` found.

    Attributes:
        version: the GGUF version (2 or 3).
        tensor_count: tensors the file declares.
        fields: key -> value (int, float, bool, str) or :class:`GGUFArray`.
    """

    version: int
    tensor_count: int
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (``"llama"``, ``"gemma3"``, ...)."""
        return self.fields.get("general.architecture")

    def arch_field(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>`` (``block_count``, ``embedding_length``, ...)."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    @property
    def vocab_size(self) -> int | None:
        """``<arch>.vocab_size``, else the length of ``tokenizer.ggml.tokens``."""
        size = self.arch_field("vocab_size")
        if size is None and isinstance(self.fields.get("tokenizer.ggml.tokens"), GGUFArray):
            size = self.fields["tokenizer.ggml.tokens"].count
        return size

    @property
    def file_type(self) -> str | None:
        """``general.file_type`` by llama.cpp's name (``"Q4_K_M"``), None when absent."""
        ftype = self.fields.get("general.file_type")
        return None if ftype is None else FILE_TYPES.get(ftype, f"file_type {ftype}")

    @property
    def has_chat_template(self) -> bool:
        """Whether the file carries ``tokenizer.chat_template``."""
        return bool(self.fields.get("tokenizer.chat_template"))


class _Cursor:
    """Reads little- (or big-) endian values from a buffer, checking every bound."""

    def __init__(self, buf: Any, order: str):
        self.buf = buf
        self.order = order
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"truncated at byte {self.pos}")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_strings(self, count: int) -> None:
        # NOTE: one length prefix at a time, no decoding: the bulk of a header (the vocabulary).
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"truncated string array at byte {pos}")
            pos += 8 + unpack(buf, pos)[0]
        if pos > end:
            raise ValueError("a string array runs past the end")
        self.pos = pos

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("I"), self.take("Q")
            if elem == _STRING:
                self.skip_strings(count)
            elif elem in _SCALARS:
                nbytes = struct.calcsize(_SCALARS[elem]) * count
                if self.pos + nbytes > len(self.buf):
                    raise ValueError(f"an array of {count} values at byte {self.pos} runs past the end")
                self.pos += nbytes
            else:  # arrays of arrays: no model file uses them; read them element by element
                for _ in range(count):
                    self.value(elem)
            return GGUFArray(elem, count)
        raise ValueError(f"unknown value type {kind} at byte {self.pos}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The key-value header of the GGUF file ``path`` (module docstring); tensor data and
    tensor infos are not read.

    Raises:
        ValueError: not a GGUF file, a version other than 2 or 3, or a header cut short (the
            message says where).
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{size} bytes: too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"not a GGUF file (starts with {bytes(buf[:4])!r})")
            order = "<"
            version = struct.unpack_from("<I", buf, 4)[0]
            if version & 0xFFFF == 0:  # written big-endian
                order, version = ">", struct.unpack_from(">I", buf, 4)[0]
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
            cur = _Cursor(buf, order)
            cur.pos = 8
            tensors, count = cur.take("Q"), cur.take("Q")
            header = GGUFHeader(version, tensors)
            for _ in range(count):
                key = cur.string()
                header.fields[key] = cur.value(cur.take("I"))
            return header
