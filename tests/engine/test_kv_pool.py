"""KVPool unit tests (sgrt/engine/kv_pool.py): the free list, slot 0 kept for padding, writes
landing at the given slots of one layer only, the per-token byte count, pages made on first write."""
from __future__ import annotations

import pytest
import torch

from sgrt.engine.kv_pool import KVPool
from sgrt.errors import CapacityError


def make(slots: int = 8, layers: int = 2, heads: int = 2, dim: int = 4, dtype=torch.float32) -> KVPool:
    return KVPool(slots, num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype, device="cpu")


def test_alloc_hands_out_every_slot_once_and_never_slot_zero():
    pool = make(8)
    taken = pool.alloc(3) + pool.alloc(5)
    assert sorted(taken) == list(range(1, 9))
    assert pool.num_free == 0 and pool.alloc(0) == []
    with pytest.raises(CapacityError, match="0 free slots, 1 requested"):
        pool.alloc(1)
    # The tensors have one extra row, slot 0, the padding target.
    assert pool.k.shape == (2, 9, 2, 4) and pool.v.shape == (2, 9, 2, 4)


def test_freed_slots_are_reused_first():
    pool = make(8)
    a = pool.alloc(4)
    pool.free(a[:2])
    assert pool.num_free == 6 and pool.free_slot_set() == set(range(1, 9)) - set(a[2:])
    assert sorted(pool.alloc(2)) == sorted(a[:2])  # most recently freed first


def test_write_stores_k_and_v_at_the_slots_of_one_layer():
    pool = make(8)
    slots = torch.tensor([5, 2])
    k = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    v = -k
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1, 5], k[0]) and torch.equal(pool.k[1, 2], k[1])
    assert torch.equal(pool.v[1, 5], v[0]) and torch.equal(pool.v_layers[1][2], v[1])
    assert float(pool.k[0].abs().sum()) == 0.0, "another layer was written"
    assert float(pool.k[1, [0, 1, 3, 4, 6, 7, 8]].abs().sum()) == 0.0, "another slot was written"


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert make(8, layers=3, heads=2, dim=4).bytes_per_token() == 2 * 3 * 2 * 4 * 4
    assert make(8, layers=3, heads=2, dim=4, dtype=torch.bfloat16).bytes_per_token() == 2 * 3 * 2 * 4 * 2


def test_a_pool_needs_a_slot():
    with pytest.raises(ValueError, match="num_slots"):
        make(0)


def test_pool_pages_are_made_when_first_written():
    """A CPU pool's memory is an anonymous mapping the kernel zero-fills page by page: a 2 GB pool
    starts as zeros without 2 GB of resident memory, and grows by the slots written."""
    from pathlib import Path

    def rss() -> int:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["RssAnon"].split()[0]) * 1024

    before = rss()
    pool = KVPool(num_slots=(1 << 20) - 1, num_layers=4, num_kv_heads=4, head_dim=16, dtype=torch.float32,
                  device="cpu")
    assert pool.k.numel() * 4 == pool.v.numel() * 4 == 1 << 30
    assert rss() - before < 64 << 20
    slots = pool.alloc(1000)
    pool.k[:, slots] = 1.0
    assert float(pool.k[:, slots].sum()) == 4 * 1000 * 4 * 16 and float(pool.v[0, 1:5000].abs().sum()) == 0.0
    assert rss() - before < 64 << 20  # (a thousand slots' pages, not the pool)


def test_default_pool_size_follows_memory():
    """No size given: 4 GiB of K/V or a quarter of the available memory, whichever is less, at the
    model's bytes a token, and never below the floor."""
    from sgrt.engine.kv_pool import KV_SPACE_BYTES, MIN_DEFAULT_TOKENS, default_pool_tokens

    per_token = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M in bfloat16: 23,040 bytes
    assert default_pool_tokens(per_token, available=64 << 30) == KV_SPACE_BYTES // per_token == 186413
    assert default_pool_tokens(per_token, available=8 << 30) == (2 << 30) // per_token
    assert default_pool_tokens(per_token, available=1 << 20) == MIN_DEFAULT_TOKENS


def test_engine_sizes_its_pool_from_memory_and_says_so(loaded_model):
    from sgrt.engine import Engine
    from sgrt.engine.kv_pool import default_pool_tokens

    cfg = loaded_model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32
    with Engine(model=loaded_model) as eng:
        expected = default_pool_tokens(per_token)
        assert abs(eng.pool.num_slots - expected) <= expected // 20  # (MemAvailable moves a little)
        assert f"KV pool {eng.pool.num_slots} tokens" in eng.describe()


# ---- the int8 KV cache (kv_cache_dtype="int8") ---------------------------------------------------

def test_int8_pool_holds_about_twice_the_tokens_in_the_same_bytes():
    """At SmolLM2's shape (30 layers, 3 kv heads, head_dim 64) a token costs 12,240 bytes in int8
    (codes + float32 scales) against 23,040 in bfloat16: a pool sized from the same memory holds
    1.88x the tokens, and the pool's own count agrees with the sizing function."""
    from sgrt.engine.kv_pool import default_pool_tokens, kv_bytes_per_token

    bf16 = kv_bytes_per_token(30, 3, 64, torch.bfloat16)
    int8 = kv_bytes_per_token(30, 3, 64, torch.bfloat16, "int8")
    assert (bf16, int8) == (23040, 12240)
    budget = 1 << 30
    ratio = default_pool_tokens(int8, available=4 * budget) / default_pool_tokens(bf16, available=4 * budget)
    assert 1.85 <= ratio <= 2.0
    pool = KVPool(16, 30, 3, 64, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    assert pool.bytes_per_token() == int8 and pool.total_bytes() == 17 * int8
    assert pool.k.dtype == torch.int8 and pool.k_scale.shape == (30, 17, 3) and pool.k_scale.dtype == torch.float32
    assert make(16, 30, 3, 64, torch.bfloat16).bytes_per_token() == bf16


def test_int8_write_quantizes_per_token_and_head_and_read_dequantizes():
    """write stores symmetric codes (absmax / 127 per slot and kv head) and their scales; read
    gives code * scale in the model's dtype: within half a step of each row's scale; an all-zero
    row reads back as zeros."""
    pool = KVPool(8, 2, 2, 16, torch.float32, "cpu", kv_cache_dtype="int8")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 16, generator=g) * torch.tensor([0.001, 50.0]).view(1, 2, 1)
    v = torch.randn(3, 2, 16, generator=g)
    v[1, 0] = 0
    slots = torch.tensor([6, 2, 3])
    pool.write(1, slots, k, v)
    scale = k.abs().amax(-1) / 127
    assert torch.equal(pool.k_scale[1, slots], scale)
    assert int(pool.k[1, slots].abs().amax()) == 127
    got_k, got_v = pool.read(1, slots)
    assert got_k.dtype == torch.float32 and got_k.shape == (3, 2, 16)
    assert bool(((got_k - k).abs() <= scale.unsqueeze(-1) / 2 * 1.0001).all())
    assert not got_v[1, 0].any() and float(pool.v_scale[1, 2, 0]) == 0.0
    assert not pool.k[0].any() and not pool.k_scale[0].any(), "another layer was written"


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVPool(8, 1, 1, 4, torch.float32, "cpu", kv_cache_dtype="fp8")
