"""sgrt's packed-weight file: every tensor a model runs with, in the layout its kernels read,
memory-mapped on load.

A store is a folder with two files:

- ``weights.bin``: the tensors' bytes back to back, each at an offset that is a multiple of
  :data:`ALIGN` (so every tensor starts on a cache line of the page-aligned mapping);
- ``manifest.json``: ``{"format": "sgrt-weights", "version", "tensors": {name: {"dtype",
  "shape", "offset"}}, "meta": {...}}`` (``meta``: what the writer wants to keep beside them:
  the model config, how each layer was packed).

:class:`StoreWriter` fills ``weights.bin`` one piece at a time (a tensor's space is reserved first
and written in row chunks with ``pwrite``, so a conversion holds one chunk in memory, not the
model). :func:`open_store` maps ``weights.bin`` copy-on-write (``MAP_PRIVATE``): the tensors are
views of the page cache, shared by every process that maps the same file and never copied; a
page becomes private only if someone writes to it (nothing in sgrt does). A load is then reading
the manifest. The format is sgrt's own (neither safetensors nor GGUF), so that no other engine
mistakes a store for a checkpoint; safetensors could not be written a tensor at a time.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgrt.errors import ModelLoadError

FORMAT = "sgrt-weights"
VERSION = 1
ALIGN = 64
WEIGHTS_FILE = "weights.bin"
MANIFEST_FILE = "manifest.json"
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float32": torch.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Reserved:
    """A tensor's place in ``weights.bin`` (see :meth:`StoreWriter.reserve`)."""

    name: str
    offset: int
    nbytes: int


class StoreWriter:
    """Writes a store into ``folder`` (created if absent): :meth:`reserve` a tensor's bytes,
    :meth:`write` pieces of them, or :meth:`add` a whole tensor; :meth:`finish` writes the
    manifest. Not thread-safe.

    Raises:
        OSError: the folder or file cannot be written.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.folder / WEIGHTS_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = 0
        self._tensors: dict[str, dict[str, Any]] = {}

    def reserve(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Reserved:
        """Room for a tensor of ``dtype`` and ``shape`` (its bytes are zero until written).

        Raises:
            ValueError: ``name`` reserved twice, or a dtype the store does not hold.
        """
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} reserved twice")
        if dtype not in _NAMES:
            raise ValueError(f"the store holds {', '.join(_DTYPES)}, not {dtype}")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        offset = -(-self._end // ALIGN) * ALIGN
        self._end = offset + nbytes
        self._tensors[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "offset": offset}
        return Reserved(name, offset, nbytes)

    def write(self, slot: Reserved, at: int, data: torch.Tensor) -> None:
        """Write ``data``'s bytes (contiguous, any dtype) at byte ``at`` of the reserved tensor.

        Raises:
            ValueError: the bytes would run past the reserved ones.
        """
        data = data.contiguous()
        raw = memoryview(data.view(torch.uint8).numpy()).cast("B") if data.numel() else memoryview(b"")
        if at < 0 or at + len(raw) > slot.nbytes:
            raise ValueError(f"{slot.name}: writing {len(raw)} bytes at {at} runs past its {slot.nbytes}")
        done = 0
        while done < len(raw):
            done += os.pwrite(self._fd, raw[done:], slot.offset + at + done)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Reserve and write a whole tensor."""
        tensor = tensor.detach().cpu().contiguous()
        self.write(self.reserve(name, tensor.dtype, tuple(tensor.shape)), 0, tensor)

    def finish(self, meta: dict[str, Any]) -> None:
        """Size ``weights.bin``, flush it, and write ``manifest.json`` (last: a folder with a
        manifest is complete)."""
        os.ftruncate(self._fd, -(-self._end // ALIGN) * ALIGN)
        os.fsync(self._fd)
        self.abandon()
        manifest = {"format": FORMAT, "version": VERSION, "tensors": self._tensors, "meta": meta}
        (self.folder / MANIFEST_FILE).write_text(json.dumps(manifest))

    def abandon(self) -> None:
        """Close the file (without a manifest unless :meth:`finish` wrote it); idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DamagedStore(ModelLoadError):
    """A weight store on disk that cannot be what its checkpoint packs to: files cut short or
    overwritten, a manifest that is unreadable or disagrees with ``weights.bin`` or with the model
    (:func:`open_store`, :func:`sgrt.models.assemble.build_model`). The loader moves such a store
    aside and packs it again; the message names the store, what is wrong and the fix."""

    def __init__(self, folder: Path, what: str):
        super().__init__(f"weight store {folder} is damaged or stale: {what} (delete the folder to rebuild it)")
        self.folder, self.what = Path(folder), what


@dataclass
class WeightStore:
    """An opened store: its tensors (views of one mapping of ``weights.bin``) and its ``meta``.

    Attributes:
        folder: where it is.
        tensors: by name; read-only in practice (writing one would copy its pages privately).
        meta: the manifest's ``meta``.
        nbytes: size of ``weights.bin``.
    """

    folder: Path
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    nbytes: int

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor ``name``.

        Raises:
            DamagedStore: the store has no such tensor.
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise DamagedStore(self.folder, f"no tensor {name!r}") from None


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished store of this format's version (its manifest; what
    :func:`open_store` checks besides is not read here)."""
    try:
        m = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") == VERSION
            and (folder / WEIGHTS_FILE).is_file())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder``'s manifest, checked against its ``weights.bin`` without reading the weights: a
    dict of this format's version whose tensors have known dtypes and shapes and lie back to back
    in the order and at the offsets :class:`StoreWriter` gives them (each at the first multiple of
    :data:`ALIGN` past the one before), filling ``weights.bin`` exactly.

    Raises:
        DamagedStore: anything else (names what).
    """
    folder = Path(folder)
    try:
        m = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DamagedStore(folder, f"cannot read {MANIFEST_FILE}: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DamagedStore(folder, f"{MANIFEST_FILE} is not a {FORMAT} v{VERSION} manifest")
    if not isinstance(m.get("tensors"), dict) or not isinstance(m.get("meta"), dict):
        raise DamagedStore(folder, f"{MANIFEST_FILE} lacks its tensors or meta")
    end = 0
    for name, info in m["tensors"].items():
        if not (isinstance(info, dict) and info.get("dtype") in _DTYPES and isinstance(info.get("shape"), list)
                and all(_is_count(d) for d in info["shape"]) and _is_count(info.get("offset"))):
            raise DamagedStore(folder, f"tensor {name!r} has no valid dtype, shape and offset in {MANIFEST_FILE}")
        if info["offset"] != _aligned(end):
            raise DamagedStore(folder, f"tensor {name!r} is at byte {info['offset']} of {WEIGHTS_FILE}, where the "
                                       f"tensors before it end at {end}")
        end = info["offset"] + torch.Size(info["shape"]).numel() * _DTYPES[info["dtype"]].itemsize
    try:
        size = (folder / WEIGHTS_FILE).stat().st_size
    except OSError as e:
        raise DamagedStore(folder, f"cannot read {WEIGHTS_FILE}: {e}") from e
    if size != _aligned(end):
        raise DamagedStore(folder, f"{WEIGHTS_FILE} has {size} bytes where its tensors fill {_aligned(end)} "
                                   f"(cut short or overwritten)")
    return m


def open_store(folder: Path) -> WeightStore:
    """Map a finished store (see the module docstring); nothing is read but the manifest, which is
    checked against ``weights.bin`` first (:func:`read_manifest`).

    Raises:
        DamagedStore: (a ModelLoadError) no finished store there, or a manifest that does not
            describe its ``weights.bin`` (names what is wrong).
    """
    folder = Path(folder)
    m = read_manifest(folder)
    path = folder / WEIGHTS_FILE
    size = path.stat().st_size
    tensors: dict[str, torch.Tensor] = {}
    mapped = None
    if size:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # (the tensors keep the mapping alive: torch.frombuffer holds a reference to it)
    for name, info in m["tensors"].items():
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        count = torch.Size(shape).numel()
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=info["offset"]).view(shape)
    return WeightStore(folder, tensors, m["meta"], size)
