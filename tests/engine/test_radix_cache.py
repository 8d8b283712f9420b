"""RadixCache unit tests: random insert / match / lock / evict sequences keep every KV slot in
exactly one place (free list, a live request, or the tree)."""
from __future__ import annotations

import random

import pytest
import torch

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.prefix_cache import InsertResult, NoPrefixCache
from sgrt.engine.radix_cache import RadixCache


def make_cache(slots: int = 512) -> tuple[KVPool, RadixCache]:
    pool = KVPool(slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    return pool, RadixCache(pool)


def test_match_insert_and_split():
    pool, cache = make_cache()
    a = [1, 2, 3, 4, 5]
    slots_a = pool.alloc(5)
    assert cache.insert(a, slots_a) == InsertResult(cached_len=0, kept=True)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots == slots_a[:3]
    # The partial match split the edge: the returned node ends after 3 tokens.
    assert m.node.key == [1, 2, 3]
    assert m.node.children[4].key == [4, 5]
    b = [1, 2, 3, 9, 9]
    slots_b = pool.alloc(5)
    already = cache.insert(b, slots_b).cached_len
    assert already == 3
    pool.free(slots_b[:3])  # the caller frees its duplicates
    assert cache.match_prefix(b).slots == slots_a[:3] + slots_b[3:]
    cache.check_integrity()
    assert cache.total_size == 7


@pytest.mark.parametrize("differ_at", [0, 1, 255, 256, 257, 511, 512, 700, 999, None])
@pytest.mark.parametrize("query_len", [600, 1000, 1300])
def test_match_and_insert_stop_at_the_first_different_token(differ_at, query_len):
    # (the common length is found by slice comparisons, 256 tokens at a time: differences on
    # and around those blocks' bounds, queries shorter and longer than the cached edge)
    rng = random.Random(differ_at or 0)
    pool, cache = make_cache(slots=4096)
    cached = [rng.randrange(1, 50) for _ in range(1000)]
    cached_slots = pool.alloc(len(cached))
    cache.insert(cached, cached_slots)
    query = (cached + [rng.randrange(1, 50) for _ in range(300)])[:query_len]
    if differ_at is not None and differ_at < query_len:
        query[differ_at] += 50
    expected = 0
    while expected < min(len(cached), len(query)) and cached[expected] == query[expected]:
        expected += 1
    assert cache.match_prefix(query).slots == cached_slots[:expected]
    query_slots = pool.alloc(len(query))
    assert cache.insert(query, query_slots).cached_len == expected
    pool.free(query_slots[:expected])
    cache.check_integrity()


def test_lock_protects_from_eviction_and_lru_order():
    pool, cache = make_cache()
    old, new = [1, 1, 1], [2, 2, 2]
    cache.insert(old, pool.alloc(3))
    cache.insert(new, pool.alloc(3))
    cache.match_prefix(new)  # touch: `old` is now least recently used
    free_before = pool.num_free
    assert cache.evict(1) == 3
    assert pool.num_free == free_before + 3
    assert cache.match_prefix(old).slots == []
    m = cache.match_prefix(new)
    cache.lock(m.node)
    assert cache.evictable_size == 0 and cache.protected_size == 3
    assert cache.evict(10) == 0
    cache.unlock(m.node)
    assert cache.evict(10) == 3
    assert cache.total_size == 0
    assert pool.num_free == pool.num_slots


def test_unlock_of_unlocked_node_raises():
    pool, cache = make_cache()
    cache.insert([1, 2], pool.alloc(2))
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_no_prefix_cache_keeps_nothing_and_takes_no_slots():
    pool = KVPool(64, 1, 1, 2, torch.float32, "cpu")
    cache = NoPrefixCache(pool)
    slots = pool.alloc(3)
    assert cache.insert([1, 2, 3], slots) == InsertResult(cached_len=0, kept=False)
    assert pool.num_free == 61  # the caller still owns its slots
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert cache.evict(10) == 0 and cache.total_size == 0 and cache.all_slots() == []
    with pytest.raises(ValueError):
        cache.insert([1, 2], [5])


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_every_slot_in_one_place(seed: int):
    rng = random.Random(seed)
    pool, cache = make_cache(400)
    live: list[dict] = []  # simulated requests: own slots + locked node

    def check() -> None:
        cache.check_integrity()
        free = pool.free_slot_set()
        owned = [s for r in live for s in r["own"]]
        tree = cache.all_slots()
        everything = list(free) + owned + tree
        assert len(everything) == len(set(everything)), "a slot is in two places"
        assert sorted(everything) == list(range(1, pool.num_slots + 1)), "a slot was lost"

    for _ in range(300):
        op = rng.random()
        if op < 0.45:  # a request arrives: match, lock, allocate the rest
            ids = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
            m = cache.match_prefix(ids)
            need = len(ids) - len(m.slots)
            cache.lock(m.node)
            if pool.num_free < need:
                cache.evict(need - pool.num_free)
            if pool.num_free < need:
                cache.unlock(m.node)
                continue
            live.append({"ids": ids, "cached": m.slots, "own": pool.alloc(need), "node": m.node})
        elif op < 0.85 and live:  # a request finishes: insert, free duplicates, unlock
            r = live.pop(rng.randrange(len(live)))
            slots = r["cached"] + r["own"]
            already = cache.insert(r["ids"], slots).cached_len
            pool.free(slots[len(r["cached"]):already])
            cache.unlock(r["node"])
        else:
            cache.evict(rng.randrange(1, 40))
        check()
    for r in live:
        pool.free(r["own"])
        cache.unlock(r["node"])
    live.clear()
    cache.reset()
    check()
    assert pool.num_free == pool.num_slots
