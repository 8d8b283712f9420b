"""The KV pool: preallocated K and V tensors for every layer and a free list of token slots.

Layout follows DESIGN.md: ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads,
head_dim]``. A request owns a list of slot indices, one per token; the radix cache owns the
slots of the tokens it holds. Slot 0 is reserved as a padding target and never handed out.

The KV cache dtype (``kv_cache_dtype``): ``"auto"`` stores K and V in the model's activation
dtype; ``"int8"`` stores them as int8 codes with one float32 scale per (slot, layer, kv head)
in ``k_scale`` / ``v_scale`` ``[num_layers, num_slots + 1, num_kv_heads]``: symmetric, scale =
absmax / 127 of the head's ``head_dim`` values, code = round-half-even(x / scale) (0 where the
scale is 0), value = code * scale (:func:`quantize_int8`). The torch path and the native store
compute the same codes and scales bit for bit. A slot's codes and scales are written together,
so prefix sharing and forks (which share slots) need nothing more.
"""
from __future__ import annotations

import mmap
import os

import torch

from sgrt.errors import CapacityError


# vLLM's CPU default KV space: a pool sized from memory takes this much, or a quarter of the memory
# available when the engine starts, whichever is less (its pages are made as they are used).
KV_SPACE_BYTES = 4 << 30
MIN_DEFAULT_TOKENS = 2048
# The KV cache dtypes (EngineConfig.kv_cache_dtype, --kv-cache-dtype): auto = the model's dtype.
KV_CACHE_DTYPES = ("auto", "int8")
SCALE_DTYPE = torch.float32  # an int8 pool's per (slot, kv head) scales


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V cost across all layers: ``head_dim`` values of ``dtype`` a kv
    head (``"auto"``), or ``head_dim`` int8 codes plus one float32 scale (``"int8"``).

    Raises:
        ValueError: ``kv_cache_dtype`` not in :data:`KV_CACHE_DTYPES`.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    per_head = head_dim * dtype.itemsize if kv_cache_dtype == "auto" else head_dim + SCALE_DTYPE.itemsize
    return 2 * num_layers * num_kv_heads * per_head


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raises ``ValueError`` unless ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of x ``[..., head_dim]`` (any float dtype) per last-dim row.

    Returns ``(codes int8 [..., head_dim], scales float32 [...])``: scale = absmax / 127 (float32),
    code = round-half-even(x / scale) clamped to [-127, 127], 0 where the row is all zeros. The
    native store (``store_kv_``, the decode plan's head prep) computes the same bits.
    """
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    div = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    codes = torch.round(xf / div).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 ``[..., head_dim]`` times scales float32 ``[...]`` (in float32), as ``dtype``."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def default_pool_tokens(bytes_per_token: int, available: int | None = None) -> int:
    """The KV pool's size in tokens when none is given: :data:`KV_SPACE_BYTES` or a quarter of
    ``available`` bytes (default: the system's ``MemAvailable`` now), whichever is less, at
    ``bytes_per_token`` (K and V of every layer); at least :data:`MIN_DEFAULT_TOKENS`."""
    if available is None:
        available = _mem_available()
    return max(MIN_DEFAULT_TOKENS, min(KV_SPACE_BYTES, available // 4) // max(1, bytes_per_token))


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, else physical memory (other systems)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages are made when first written: an anonymous private mapping
    (``mmap``), which the kernel fills with zeros page by page, where ``torch.zeros`` writes every
    byte at once. A KV pool sized for long contexts then costs resident memory only for the slots
    requests have used (the tensor keeps the mapping alive). Other devices: ``torch.zeros``."""
    count = torch.Size(shape).numel()
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    size = count * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class KVPool:
    """Fixed-size token-slot KV storage.

    Args:
        num_slots: usable token slots (one more is allocated for padding).
        num_layers, num_kv_heads, head_dim: model shape.
        dtype, device: the model's activation dtype and device (the storage dtype with
            ``kv_cache_dtype="auto"``; what :meth:`read` gives back in every case).
        kv_cache_dtype: ``"auto"`` (K/V in ``dtype``) or ``"int8"`` (int8 codes plus float32
            scales ``k_scale`` / ``v_scale`` ``[num_layers, num_slots + 1, num_kv_heads]``; module
            docstring).

    Attributes:
        k, v: ``[num_layers, num_slots + 1, num_kv_heads, head_dim]`` in ``dtype`` or int8.
        k_scale, v_scale: the int8 pool's scales, or None.
        k_layers, v_layers, k_scale_layers, v_scale_layers: per-layer views (scales: None each).

    Raises:
        ValueError: ``num_slots < 1`` or an unknown ``kv_cache_dtype``.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        check_kv_cache_dtype(kv_cache_dtype)
        self.num_slots = num_slots
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_cache_dtype == "int8"
        device = torch.device(device)
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        store = torch.int8 if self.quantized else dtype
        self.k = zeros_on_demand(shape, store, device)
        self.v = zeros_on_demand(shape, store, device)
        # One layer's view of each, made once (indexing k[layer] is an op, twice a layer a step).
        self.k_layers: list[torch.Tensor] = list(self.k.unbind(0))
        self.v_layers: list[torch.Tensor] = list(self.v.unbind(0))
        self.k_scale = self.v_scale = None
        self.k_scale_layers: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale_layers: list[torch.Tensor | None] = [None] * num_layers
        if self.quantized:
            self.k_scale = zeros_on_demand(shape[:3], SCALE_DTYPE, device)
            self.v_scale = zeros_on_demand(shape[:3], SCALE_DTYPE, device)
            self.k_scale_layers = list(self.k_scale.unbind(0))
            self.v_scale_layers = list(self.v_scale.unbind(0))
        # Free slots are 1..num_slots; popped from the end so recently freed slots are reused. The
        # list's tail is kept descending where it can be, so that a request's tokens get ascending
        # consecutive slots: the decode attention kernel streams such rows in order (its fast path,
        # and the hardware prefetcher's direction).
        self._free: list[int] = list(range(num_slots, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers (K and V, and an int8 pool's scales)."""
        n = 2 * self.k[:, 0].numel() * self.k.element_size()
        if self.quantized:
            n += 2 * self.k_scale[:, 0].numel() * self.k_scale.element_size()
        return n

    def total_bytes(self) -> int:
        """Bytes of every K/V tensor of the pool (padding slot included; pages made on first write)."""
        return (self.num_slots + 1) * self.bytes_per_token()

    def describe(self) -> str:
        """The KV dtype for a load / start line: ``"bfloat16"``, or ``"int8 (+ float32 scales)"``."""
        return "int8 (+ float32 scales)" if self.quantized else str(self.dtype).replace("torch.", "")

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free slots.

        Raises:
            CapacityError: fewer than ``n`` slots are free (callers evict first).
        """
        if n > len(self._free):
            raise CapacityError(f"KV pool has {len(self._free)} free slots, {n} requested")
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        slots.reverse()
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list (the next ``alloc`` of as many gets them in this order)."""
        self._free.extend(reversed(slots))

    def free_slot_set(self) -> set[int]:
        """The free slots as a set (integrity checks only; O(num_slots))."""
        return set(self._free)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ``[T, num_kv_heads, head_dim]`` at ``slots`` ``[T]`` for one layer (an int8
        pool: their codes and scales, :func:`quantize_int8`)."""
        if self.quantized:
            for codes, scales, x in ((self.k_layers, self.k_scale_layers, k), (self.v_layers, self.v_scale_layers, v)):
                q, s = quantize_int8(x)
                codes[layer].index_copy_(0, slots, q)
                scales[layer].index_copy_(0, slots, s)
            return
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer at slots ``index`` ``[N]`` -> two ``[N, num_kv_heads, head_dim]``
        in the model's dtype (an int8 pool's dequantized in float32, then cast)."""
        if self.quantized:
            return (dequantize_int8(self.k_layers[layer].index_select(0, index),
                                    self.k_scale_layers[layer].index_select(0, index), self.dtype),
                    dequantize_int8(self.v_layers[layer].index_select(0, index),
                                    self.v_scale_layers[layer].index_select(0, index), self.dtype))
        return self.k_layers[layer].index_select(0, index), self.v_layers[layer].index_select(0, index)
