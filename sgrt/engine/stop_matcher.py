"""Stop strings matched by one automaton (Aho-Corasick), fed the text as it is generated.

A request may carry many stop strings; checking each one with ``str.find`` on every token made
the cost of a token grow with their number (780,000 strings: 13 s for 64 tokens, and every
other request of the batch waited for it). :class:`StopMatcher` is built once per request, in
time linear in the strings' total length, and then costs a dictionary step or two per generated
character, whatever the number of strings.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """An Aho-Corasick automaton over ``stops`` that reads text incrementally.

    :meth:`feed` takes each new piece of the text in order and returns the stop string whose
    match ends inside that piece and starts earliest (a match may start in earlier pieces: stop
    strings are found across token boundaries). At equal starts the one that ends first wins.

    Args:
        stops: non-empty strings (duplicates allowed).
    """

    __slots__ = ("stops", "max_len", "_goto", "_fail", "_best", "_state", "_pos")

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        goto: list[dict[str, int]] = [{}]
        best: list[int] = [-1]  # per state: index of the longest stop string ending here, or -1
        for k, s in enumerate(self.stops):
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    best.append(-1)
                state = nxt
            if best[state] == -1:
                best[state] = k
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            # NOTE: a state's longest match is its own string, else its failure state's (the
            # longest proper suffix that is a trie state); BFS order settles the latter first.
            if best[state] == -1:
                best[state] = best[fail[state]]
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                cand = goto[f].get(ch, 0)
                fail[nxt] = cand if cand != nxt else 0
                queue.append(nxt)
        self._goto = goto
        self._fail = fail
        self._best = best
        self._state = 0
        self._pos = 0  # characters fed so far

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read ``text`` (the next piece); return ``(start, stop)`` for the earliest-starting
        stop string whose match ends in it (``start`` counts characters from the first piece
        fed), or None."""
        goto, fail, best, stops = self._goto, self._fail, self._best, self.stops
        state, pos = self._state, self._pos
        hit: tuple[int, str] | None = None
        for ch in text:
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            pos += 1
            k = best[state]
            if k >= 0:
                start = pos - len(stops[k])
                if hit is None or start < hit[0]:
                    hit = (start, stops[k])
        self._state, self._pos = state, pos
        return hit
