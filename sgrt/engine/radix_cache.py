"""A radix tree over token ids whose values are KV slot indices (the prefix cache).

Follows SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured
Language Model Programs", arXiv:2312.07104): requests, forks and conversation turns that share a
prefix share its KV slots. Locked paths (reference counts) belong to running requests and are
never evicted; unlocked leaves are evicted least-recently-used first. The contract it keeps is
:class:`sgrt.engine.prefix_cache.PrefixCache`'s.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.prefix_cache import InsertResult, MatchResult, PrefixCache
from sgrt.token_ids import common_prefix_len

_clock = itertools.count()


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: ``key`` token ids and their ``value`` KV slots (same length)."""

    key: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    parent: "TreeNode | None" = None
    children: dict[int, "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class RadixCache(PrefixCache):
    """Radix-tree prefix cache over a :class:`KVPool` (match handles are :class:`TreeNode`)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.root = TreeNode(lock_ref=1)
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    # -- queries -----------------------------------------------------------------------------
    def match_prefix(self, ids: list[int]) -> MatchResult:
        """Longest cached prefix of ``ids``. Splits a node on a partial match so that the
        returned node ends exactly where the match ends (the caller can lock it)."""
        node = self.root
        slots: list[int] = []
        pos = 0
        now = next(_clock)
        node.last_access = now
        while pos < len(ids) and ids[pos] in node.children:
            child = node.children[ids[pos]]
            n = common_prefix_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            child.last_access = now
            node = child
            pos += n
        return MatchResult(slots, node)

    @property
    def total_size(self) -> int:
        """Tokens in the tree, locked or not."""
        return self.evictable_size + self.protected_size

    # -- updates -----------------------------------------------------------------------------
    def insert(self, ids: list[int], slots: list[int]) -> InsertResult:
        """Insert ``ids`` with their KV ``slots``; ``cached_len`` says how many leading tokens
        were already cached. The caller frees its own slots for those tokens (the tree keeps
        its copies) unless they are the very same slots."""
        if len(ids) != len(slots):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        node = self.root
        pos = 0
        now = next(_clock)
        while pos < len(ids):
            first = ids[pos]
            if first not in node.children:
                leaf = TreeNode(key=list(ids[pos:]), value=list(slots[pos:]), parent=node, last_access=now)
                node.children[first] = leaf
                self.evictable_size += len(leaf.key)
                return InsertResult(cached_len=pos, kept=True)
            child = node.children[first]
            n = common_prefix_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            pos += n
        return InsertResult(cached_len=pos, kept=True)

    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (a running request uses it)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release one :meth:`lock` of the path root..node."""
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent

    def evict(self, n_tokens: int) -> int:
        """Free at least ``n_tokens`` slots from unlocked leaves, LRU first, if that many are
        evictable; return how many were freed."""
        leaves = [node for node in self._nodes() if not node.children and node.lock_ref == 0 and node is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < n_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry (flush). Locked paths stay (their requests still run)."""
        self.evict(self.evictable_size)

    # -- checks ------------------------------------------------------------------------------
    def all_slots(self) -> list[int]:
        """Every slot held by the tree (for integrity checks)."""
        return [s for node in self._nodes() for s in node.value]

    def check_integrity(self) -> None:
        """Assert the tree's internal invariants; raise ``AssertionError`` naming the first broken one."""
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root:
                continue
            assert len(node.key) == len(node.value) > 0, "node key/value length mismatch or empty"
            assert node.parent.children.get(node.key[0]) is node, "child not indexed by first token"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "a child holds more locks than its parent"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, f"evictable_size {self.evictable_size} != {evictable}"
        assert protected == self.protected_size, f"protected_size {self.protected_size} != {protected}"
        slots = self.all_slots()
        assert len(slots) == len(set(slots)), "a slot appears twice in the tree"

    # -- internals ---------------------------------------------------------------------------
    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens; return the new upper node."""
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=child.parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        child.parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
