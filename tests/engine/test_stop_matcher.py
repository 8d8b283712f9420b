"""The stop strings' automaton (``sgrt.engine.stop_matcher``): fed text piece by piece, it finds
what a search of every stop string in the whole text finds, and its work per character does not
grow with the number of strings."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgrt.engine.stop_matcher import StopMatcher


def reference(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest-starting stop string whose match ends in ``text[old_len:]`` (at equal starts:
    the one that ends first), by brute force over every occurrence."""
    best = None
    for s in stops:
        start = text.find(s)
        while start != -1:
            end = start + len(s)
            if end > old_len and (best is None or (start, end) < (best[0], best[0] + len(best[1]))):
                best = (start, s)
            start = text.find(s, start + 1)
    return best


ALPHABET = "abc\n"


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
       pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12))
def test_feeding_pieces_finds_what_a_full_search_finds(stops, pieces):
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:
        old_len = len(text)
        text += piece
        got = matcher.feed(piece)
        want = reference(text, stops, old_len)
        assert (got is None) == (want is None), (stops, pieces, got, want)
        if got is not None:
            assert got[0] == want[0] and text[got[0]:].startswith(got[1]), (stops, pieces, got, want)
            assert len(got[1]) == len(want[1]), (stops, pieces, got, want)


def test_a_match_across_pieces_and_overlapping_strings():
    matcher = StopMatcher(["<|end|>", "end", "nd|"])
    assert matcher.feed("text <|e") is None
    assert matcher.feed("n") is None
    # "end" (from 7) and "nd|" (from 8) both end in "d|"; "<|end|>" never completes
    assert matcher.feed("d|") == (7, "end")
    assert matcher.max_len == 7


def test_work_per_character_does_not_grow_with_the_number_of_strings():
    """Counted in automaton transitions, not time: 100,000 strings that share prefixes with the
    text cost at most two steps per character fed (the failure links' amortized bound)."""
    stops = [f"x{i:06d}y" for i in range(100_000)]
    matcher = StopMatcher(stops)
    text = "".join(f"x{i:06d}" for i in range(0, 100_000, 7))  # every piece a prefix, no match
    steps = 0
    goto, fail = matcher._goto, matcher._fail
    original = matcher.feed

    def counting_feed(piece: str):
        nonlocal steps
        state = matcher._state
        for ch in piece:  # replay the same walk, counting transitions taken
            while True:
                steps += 1
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
        return original(piece)

    for k in range(0, len(text), 5):
        assert counting_feed(text[k:k + 5]) is None
    assert steps <= 2 * len(text)
    assert matcher.feed("x000007y") == (len(text), "x000007y")
