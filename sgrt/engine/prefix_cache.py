"""The prefix-cache interface, and the cache that keeps nothing.

A prefix cache maps token-id prefixes to the KV slots that hold their keys and values, so that
requests sharing a prefix (a system prompt, a program's fixed text, a conversation's earlier
turns, a fork's siblings) compute it once. The scheduler is its only caller (it owns the KV
slots; DESIGN.md, "The path of one gen"). Two implementations:

* :class:`sgrt.engine.radix_cache.RadixCache`: a radix tree with LRU eviction (SGLang's
  RadixAttention, arXiv:2312.07104).
* :class:`NoPrefixCache`: matches nothing and keeps nothing (``enable_radix_cache=False``, the
  "cache off" baseline of the benchmarks).

Contract, for any implementation:

* :meth:`PrefixCache.match_prefix` returns the slots of the longest cached prefix and a
  :class:`MatchResult` ``node`` handle where it ends; those slots stay valid only while the
  handle is locked (:meth:`PrefixCache.lock`), since :meth:`PrefixCache.evict` may free any
  unlocked entry.
* :meth:`PrefixCache.insert` takes ownership of the slots of the tokens it did not hold yet
  (when ``InsertResult.kept``); the caller still owns (and must free) its own slots of the
  ``InsertResult.cached_len`` tokens that were already cached, unless they are the very same
  slots. A cache that keeps nothing takes nothing: the caller keeps every slot.
* Every slot the cache holds is in exactly one entry (:meth:`PrefixCache.check_integrity`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from sgrt.engine.kv_pool import KVPool


class MatchResult(NamedTuple):
    """The longest cached prefix of a query.

    Attributes:
        slots: KV slot indices of the matched tokens, one per token (``len(slots)`` tokens
            matched).
        node: the handle to :meth:`PrefixCache.lock` so that the prefix is not evicted while a
            request reads it (a :class:`sgrt.engine.radix_cache.TreeNode`, or None for
            :class:`NoPrefixCache`).
    """

    slots: list[int]
    node: Any


class InsertResult(NamedTuple):
    """What :meth:`PrefixCache.insert` did.

    Attributes:
        cached_len: how many leading tokens were cached before the insert; the caller's slots
            for them are duplicates (free them, unless they are the same slots).
        kept: whether the cache now holds the tokens (False for :class:`NoPrefixCache`: the
            caller still owns every slot it passed).
    """

    cached_len: int
    kept: bool


class PrefixCache(ABC):
    """A cache of token-id prefixes over the KV slots of one :class:`KVPool`.

    Sizes are in tokens (one KV slot per token). Callers run on the engine's loop thread.
    """

    pool: KVPool

    @abstractmethod
    def match_prefix(self, ids: list[int]) -> MatchResult:
        """The longest cached prefix of ``ids`` (possibly empty). Marks it recently used."""

    @abstractmethod
    def insert(self, ids: list[int], slots: list[int]) -> InsertResult:
        """Cache ``ids`` with their KV ``slots`` (same length).

        Raises:
            ValueError: ``ids`` and ``slots`` differ in length.
        """

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect the prefix ending at ``node`` (a :class:`MatchResult` handle) from eviction."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Release one :meth:`lock` of ``node``.

        Raises:
            RuntimeError: ``node`` is not locked.
        """

    @abstractmethod
    def evict(self, n_tokens: int) -> int:
        """Free at least ``n_tokens`` slots of unlocked entries to the pool, if that many are
        unlocked; return how many were freed (``evict(0)`` frees nothing)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every unlocked entry (a flush); locked prefixes stay."""

    @property
    @abstractmethod
    def total_size(self) -> int:
        """Tokens held, locked or not."""

    @abstractmethod
    def all_slots(self) -> list[int]:
        """Every slot held (integrity checks)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's own invariants; raise ``AssertionError`` naming the first broken
        one."""


class NoPrefixCache(PrefixCache):
    """A prefix cache that matches nothing and keeps nothing: :meth:`insert` takes no slots,
    so a finished request's KV goes straight back to the pool when the scheduler frees it."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def match_prefix(self, ids: list[int]) -> MatchResult:
        return MatchResult([], None)

    def insert(self, ids: list[int], slots: list[int]) -> InsertResult:
        if len(ids) != len(slots):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        return InsertResult(cached_len=0, kept=False)

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def evict(self, n_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    @property
    def total_size(self) -> int:
        return 0

    def all_slots(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        pass
