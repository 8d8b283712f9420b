"""sgrt/constrained/bitmask.py: allocation and in-place application of token bitmasks."""
from __future__ import annotations

import torch

from sgrt.constrained import allocate_token_bitmask, apply_token_bitmask_
from sgrt.constrained.bitmask import allowed_tokens, row_view, set_bits


def test_allocate_all_allowed():
    bm = allocate_token_bitmask(3, 100)
    assert bm.shape == (3, 4) and bm.dtype == torch.int32 and bool((bm == -1).all())


def test_apply_matches_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 100
    bm = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab + 7, generator=g)  # logits wider than the mask: extra -> -inf
    expected = logits.clone()
    for b in range(3):
        for t in range(vocab + 7):
            allowed = t < 128 and (int(bm[b, t // 32]) >> (t % 32)) & 1
            if not allowed:
                expected[b, t] = float("-inf")
    apply_token_bitmask_(logits, bm)
    assert torch.equal(logits, expected)
    one = torch.randn(vocab)  # 1-D logits and mask work too
    ref = one.clone().unsqueeze(0)
    apply_token_bitmask_(one, bm[0])
    apply_token_bitmask_(ref, bm[:1])
    assert torch.equal(one, ref[0])


def test_set_bits_and_allowed_tokens():
    bm = torch.zeros(2, 2, dtype=torch.int32)
    set_bits(row_view(bm, 1), [0, 31, 33], True)
    assert allowed_tokens(bm, 1) == [0, 31, 33] and allowed_tokens(bm, 0) == []
    set_bits(row_view(bm, 1), [31], False)
    assert allowed_tokens(bm, 1) == [0, 33]
