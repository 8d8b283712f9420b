"""How many threads each forward runs on: all of them while the process has its cores, fewer
while other work takes them (issue 39).

A forward's parallel regions (every matmul, the decode plan's thread team) end at a barrier, so
a step runs at the pace of its slowest thread. On a quiet machine two threads halve a decode
step; with another process busy on one of the 2 cores, the thread that shares a core gets half
of it in time slices, and every barrier waits for its slice (measured here: SmolLM2 int4 decode at
0.17x its quiet speed, and packing's small 2-thread ops up to 100x slower than on one thread).
One thread then runs at the physical share (~0.5x). Nothing in the process can see the other
work directly (load averages and steal time lag by seconds and count our own threads), but every
step is timed: :class:`ThreadGovernor` keeps, for each kind of forward, its recent time at
each thread count it tries (the median of the last few forwards), runs the count with the lowest, and now and then runs
another one to see whether that changed. A step much slower than the kind's recent best (the
machine got busier) triggers that look at once.

Kinds: a decode-only forward by its rows (1, 2-3, 4-7, ...), a small extend by its tokens (powers
of two): step times within a kind are comparable. A decode step's time grows with its rows'
contexts (each reads its K/V besides the weights): it is timed per unit of work too
(:func:`decode_work`: the weights' bytes plus the K/V bytes it reads), so a step over 8,000 tokens
after steps over 500 (an agent switching conversations) is not taken for a busier machine.
Every forward of :data:`PREFILL_TOKENS` tokens or more is one kind, ``("prefill",
PREFILL_TOKENS)``, timed per unit of work (:func:`extend_work`: its tokens plus its attention's
query-key pairs, weighed by the model's FLOPs): a 1,000-token step over a 3,000-token context and
a 200-token one over none then compare, so one of them being slower is not taken for a busier
machine, and the thread counts are tried once for all prefill sizes, not once per size (each try
of one thread on a heavy prefill step costs that step half its speed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# How often (forwards of a kind) another thread count is tried when the choice holds; the interval
# doubles every time the try confirms the choice, up to EXPLORE_MAX.
EXPLORE_MIN = 16
EXPLORE_MAX = 256
# A forward this much slower than its kind's best recent time at the same thread count means the
# machine changed: look at the other counts now.
SLOWDOWN = 1.5
# A count's time is the median of its last WINDOW forwards: one slow forward (a page fault, a
# collection, another thread of ours) does not move the choice, three in a row do. (A running
# mean moved by one 10x outlier kept a quiet 2-core machine on one thread until the next try:
# decode ~20% under all-threads speed.)
WINDOW = 5
# Forwards of this many tokens or more (prefill chunks, batched extends) form one kind, timed per
# unit of work.
PREFILL_TOKENS = 64


def kind_of(decode_rows: int | None, tokens: int) -> tuple[str, int]:
    """A forward's kind: ``("decode", rows bucket)`` for a decode-only batch of ``decode_rows``
    rows, ``("prefill", PREFILL_TOKENS)`` for any other of at least :data:`PREFILL_TOKENS` tokens,
    else ``("extend", tokens bucket)``; buckets are powers of two."""
    if decode_rows is not None:
        return ("decode", 1 << max(0, decode_rows.bit_length() - 1))
    if tokens >= PREFILL_TOKENS:
        return ("prefill", PREFILL_TOKENS)
    return ("extend", 1 << max(0, tokens.bit_length() - 1))


def pair_weight(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> float:
    """The FLOPs of one attention query-key pair (scores and weighted values: ``4 * heads *
    head_dim``) over one token's through the layer's projections (``2 * (hidden * (heads + 2 *
    kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * ffn)``, a gated MLP), per layer.
    SmolLM2-135M: ~1/3,000 (a token over a 3,000-token context costs twice one over none)."""
    proj = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * ffn
    return (4 * heads * head_dim) / (2 * proj)


def kv_weight(kv_bytes_per_token: int, weight_bytes: int) -> float:
    """The K/V bytes of one context token (all layers) over the weights' bytes, which a decode step
    reads once: what one token of context adds to a memory-bound decode step, in steps (SmolLM2-135M
    int4, ~97 MB of weights: ~1.3e-4 with int8 K/V, ~2.4e-4 with bfloat16). 0 without weights."""
    return kv_bytes_per_token / weight_bytes if weight_bytes > 0 else 0.0


def decode_work(contexts: list[int], weight: float) -> float:
    """A decode-only forward's work in units of one pass over the weights: ``1 + weight *
    sum(contexts)`` (``contexts``: each row's keys attended, ``weight``: :func:`kv_weight`)."""
    return 1.0 + weight * sum(contexts)


def extend_work(rows: list[tuple[int, int]], weight: float) -> float:
    """A forward's work in token units: ``sum(n + weight * pairs)`` over its rows ``(start, n)``
    (``n`` tokens fed after ``start`` in context, so ``n * start + n * (n + 1) / 2`` causal
    query-key pairs); ``weight``: :func:`pair_weight`."""
    return sum(n + weight * (n * start + n * (n + 1) / 2) for start, n in rows)


@dataclass
class KindStats:
    """One kind's recent seconds per thread count (their median: ``average``), and its
    exploration state."""

    samples: dict[int, list[float]] = field(default_factory=dict)  # the last WINDOW per count
    average: dict[int, float] = field(default_factory=dict)
    best: dict[int, float] = field(default_factory=dict)  # the fastest recent forward per count
    tried: dict[int, int] = field(default_factory=dict)  # the forward number of each count's last try
    forwards: int = 0
    since_explore: int = 0
    interval: int = EXPLORE_MIN
    exploring: int | None = None  # the count a forward is trying now
    fewer_now: bool = False  # a forward was much slower than lately: try fewer threads next


class ThreadGovernor:
    """Chooses the thread count of each forward (module docstring).

    Args:
        max_threads: the most threads a forward may use (the process's torch threads).
        adaptive: False keeps ``max_threads`` always (an engine option; for measurements).

    Use: ``n = governor.choose(kind)``, run the forward on ``n`` threads, then
    ``governor.record(kind, n, seconds)``.
    """

    def __init__(self, max_threads: int, adaptive: bool = True) -> None:
        self.max_threads = max(1, int(max_threads))
        self.adaptive = adaptive and self.max_threads > 1
        counts, n = [], self.max_threads
        while n >= 1:
            counts.append(n)
            n //= 2
        self.counts: list[int] = counts  # max, max/2, ..., 1
        self.kinds: dict[tuple[str, int], KindStats] = {}

    def choose(self, kind: tuple[str, int]) -> int:
        """The thread count for the next forward of ``kind``: every count once, from the most, in
        a kind's first forwards; then the fastest, and another one every ``interval`` forwards
        (the one tried longest ago) or, after a slow forward, the next fewer at once."""
        if not self.adaptive:
            return self.max_threads
        st = self.kinds.setdefault(kind, KindStats())
        untried = [n for n in self.counts if n not in st.average]
        if untried:
            st.exploring = untried[0]
            return untried[0]
        current = self._best(st)
        if st.fewer_now and current > self.counts[-1]:
            st.fewer_now = False
            st.exploring = self.counts[self.counts.index(current) + 1]
            return st.exploring
        if st.since_explore >= st.interval:
            others = [n for n in self.counts if n != current]
            st.exploring = min(others, key=lambda n: st.tried.get(n, 0))
            return st.exploring
        st.exploring = None
        return current

    def record(self, kind: tuple[str, int], threads: int, seconds: float, work: float = 1.0) -> None:
        """Account one forward of ``kind`` that ran on ``threads`` threads for ``seconds``, its
        ``work`` (> 0) in any unit the kind's forwards share (:func:`extend_work`): what is
        compared is seconds per unit."""
        if not self.adaptive:
            return
        seconds = seconds / work if work > 0 else seconds
        st = self.kinds.setdefault(kind, KindStats())
        st.forwards += 1
        before = self._best(st) if st.average else None
        # (a tried count's samples date from its last try, the machine as it was then: the new
        # time replaces them; if it was luck, the next forwards on that count move it back)
        explored = st.exploring == threads
        window = [] if explored else st.samples.get(threads, [])
        window = (window + [seconds])[-WINDOW:]
        st.samples[threads] = window
        st.average[threads] = sorted(window)[len(window) // 2]
        best = st.best.get(threads)
        # (the recent best drifts up slowly, so that a lasting change of the machine is learnt)
        st.best[threads] = seconds if best is None or seconds < best else best * 1.01
        if explored:
            st.exploring = None
            st.tried[threads] = st.forwards
            st.since_explore = 0
            after = self._best(st)
            st.interval = min(EXPLORE_MAX, st.interval * 2) if after == before else EXPLORE_MIN
            return
        st.since_explore += 1
        if best is not None and seconds > SLOWDOWN * best:
            st.fewer_now = True  # (much slower than lately: the machine may have got busier)

    @staticmethod
    def _best(st: KindStats) -> int:
        return min(st.average, key=st.average.__getitem__)

    def summary(self) -> dict[str, int]:
        """Each kind's current choice, ``{"decode/1": 2, ...}`` (for stats and logs)."""
        return {f"{k}/{b}": self._best(st) for (k, b), st in self.kinds.items() if st.average}
