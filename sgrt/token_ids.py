"""Comparisons of token-id sequences (prompts, cached keys, slot lists) that run in C.

The radix cache, the scheduler, the drafter and the DSL's select all ask how far two sequences
agree, over whole prompts: compared token by token in Python that is ~50 ns a token (8,000
tokens: ~0.4 ms, several times a request, and once a step where a drafter catches up).
"""
from __future__ import annotations

from collections.abc import Sequence

# Tokens a slice comparison covers while looking for the first difference.
_BLOCK = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many leading items of ``a`` equal those of ``b[start:]`` (0 where either is empty).

    By slice comparisons, which run in C for lists, tuples and ``array.array``s: the whole
    overlap in one (the usual case: a turn extends its conversation), else ``_BLOCK`` items a
    comparison up to the block with the first difference, then item by item. Sequences of
    different types (a list against an array) are correct too, item by item. NumPy arrays and
    tensors are not taken: their ``==`` compares item-wise, not whole sequences (callers pass
    token-id lists, as intake builds them).
    """
    n = min(len(a), len(b) - start)
    if n <= 0:
        return 0
    if a[:n] == b[start:start + n]:
        return n
    i = 0
    while i + _BLOCK <= n and a[i:i + _BLOCK] == b[start + i:start + i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[start + i]:
        i += 1
    return i
