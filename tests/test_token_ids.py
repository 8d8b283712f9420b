"""sgrt.token_ids.common_prefix_len against a token-by-token reference: differences on and around
the bounds of its 256-token slice comparisons, offsets, and every mix of lists, tuples and int64
arrays (the radix cache's keys are lists, a request's slots arrays)."""
from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from sgrt.token_ids import common_prefix_len


def reference(a, b, start=0):
    n = 0
    while n < len(a) and start + n < len(b) and a[n] == b[start + n]:
        n += 1
    return n


KINDS = [list, tuple, lambda x: array("q", x)]


@st.composite
def pairs(draw):
    length = draw(st.sampled_from([0, 1, 255, 256, 257, 511, 512, 513, 1000]))
    a = draw(st.lists(st.integers(0, 3), min_size=length, max_size=length))
    start = draw(st.integers(0, 3))
    b = draw(st.lists(st.integers(0, 3), min_size=start, max_size=start)) + list(a)
    cut = draw(st.integers(0, len(b)))
    b = b[:cut] + draw(st.lists(st.integers(0, 3), max_size=300))
    for _ in range(draw(st.integers(0, 2))):  # (changes at chosen places: block bounds included)
        if b:
            at = draw(st.sampled_from([min(len(b) - 1, x) for x in (0, 255, 256, 257, 511, 512, len(b) - 1)]))
            b[at] += 1
    kind_a, kind_b = draw(st.sampled_from(KINDS)), draw(st.sampled_from(KINDS))
    return kind_a(a), kind_b(b), start


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_common_prefix_len_matches_the_token_by_token_count(case):
    a, b, start = case
    assert common_prefix_len(a, b, start) == reference(a, b, start)
    assert common_prefix_len(b, a) == reference(b, a)


def test_a_whole_match_and_a_difference_in_the_last_block():
    a = list(range(1000))
    assert common_prefix_len(a, a + [5]) == 1000
    assert common_prefix_len(a, a[:999] + [-1]) == 999
    assert common_prefix_len(a, [7] + a, 1) == 1000
    assert common_prefix_len(array("q", a), array("q", a[:600] + [-1] + a[601:])) == 600
