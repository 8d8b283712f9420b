"""The KV pool: preallocated K and V tensors for every layer and a free list of token slots.

Layout follows DESIGN.md: ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads,
head_dim]``. A request owns a list of slot indices, one per token; the radix cache owns the
slots of the tokens it holds. Slot 0 is reserved as a padding target and never handed out.
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
        dtype, device: storage dtype and device (the model's).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k = zeros_on_demand(shape, dtype, torch.device(device))
        self.v = zeros_on_demand(shape, dtype, torch.device(device))
        # One layer's view of each, made once (indexing k[layer] is an op, twice a layer a step).
        self.k_layers: list[torch.Tensor] = list(self.k.unbind(0))
        self.v_layers: list[torch.Tensor] = list(self.v.unbind(0))
        # Free slots are 1..num_slots; popped from the end so recently freed slots are reused.
        self._free: list[int] = list(range(num_slots, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers (K and V)."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

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
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list."""
        self._free.extend(slots)

    def free_slot_set(self) -> set[int]:
        """The free slots as a set (integrity checks only; O(num_slots))."""
        return set(self._free)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ``[T, num_kv_heads, head_dim]`` at ``slots`` ``[T]`` for one layer."""
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)
