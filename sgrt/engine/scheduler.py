"""Which requests run in the next forward, and where their KV goes.

Each step the scheduler builds one ragged batch: every decoding request contributes a row of
one token, then prefill work shares the step's prefill token budget: chunks of the running
requests still prefilling and the admission of waiting ones. Policies: ``short`` (the default:
the shortest next prefill chunk first, running and waiting alike, where a waiting request's
chunk counts only what the prefix cache does not hold; so an agent's next turn, a long cached
conversation plus a short tool result, is not stuck behind other sessions' long prefills: a
request, running or waiting, skipped twice goes first (the oldest such first); and a step takes
one prefill piece of any size but adds more only while its prefill stays within
``batch_prefill_tokens``, so of several turns arriving together the first streams its first
token after its own prefill, not after all of theirs), ``lpm`` (running chunks first, then the
waiting ones with the longest prefix match first, as in SGLang) and ``fcfs``. When the KV pool
runs short it evicts unlocked prefix-cache entries first, then retracts the newest running
requests back to the waiting queue (their output is kept; they re-prefill later), as SGLang and
vLLM preempt by recomputation.

The scheduler is the only owner of KV slots: it allocates them for rows and for draft tokens
(:meth:`Scheduler.attach_draft`, asked by the speculative planner), frees rejected drafts'
(:meth:`Scheduler.release_draft_slots`), moves computed prefixes into the prefix cache and
releases a finished request's; :meth:`Scheduler.check_integrity` checks that every slot is in
exactly one place.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.prefix_cache import PrefixCache
from sgrt.engine.request import Req, ReqStatus
from sgrt.errors import InvalidRequest
from sgrt.token_ids import common_prefix_len

POLICIES = ("short", "lpm", "fcfs")
# Steps a running request's prefill may be passed over by shorter work before it goes first.
MAX_PREFILL_SKIPS = 2


@dataclass
class SchedulerConfig:
    """Batching limits (tokens unless stated; fields of the same names in
    :class:`sgrt.engine.engine.EngineConfig`).

    Attributes:
        max_running_requests: requests admitted at once (>= 1).
        max_prefill_tokens: new prefill tokens admitted per step (>= 1).
        chunked_prefill_size: most prefill tokens one request feeds per step (>= 1).
        schedule_policy: prefill order, ``"short"`` (shortest next chunk first, running and
            waiting alike), ``"lpm"`` (running chunks, then waiting by longest prefix match) or
            ``"fcfs"`` (module docstring).
        dedup_min_tokens: a shared uncached prefix this long makes a waiting request wait for
            the one prefilling it.
        batch_prefill_tokens: ``"short"``: a step's first prefill piece may be any size (up to
            the budget); further pieces join only while the step's prefill stays within this
            many tokens. Small pieces (short new turns) share a step, whose fixed cost is
            comparable to theirs; of larger ones one goes per step, so each streams its first
            token a step's time after it starts, instead of all after the last (TTFT). At
            ~600 prefill tokens a second on 2 cores, 256 tokens take ~0.4 s.

    Raises:
        InvalidRequest: a field out of its range (named).
    """

    max_running_requests: int = 64
    max_prefill_tokens: int = 1024
    chunked_prefill_size: int = 512
    schedule_policy: str = "short"
    dedup_min_tokens: int = 32
    batch_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise InvalidRequest(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}",
                                 field="schedule_policy")
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size", "dedup_min_tokens",
                     "batch_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}", field=name)


@dataclass
class Row:
    """One request's part of a forward: feed ``fill_ids[start:start + n]``.

    A verify row (speculative decoding, exact jump-forward) also feeds ``draft``: then ``n``
    counts the draft too, the fed tokens are ``fill_ids[start:] + draft``, and the request's
    slots already hold KV slots for the draft (``sgrt.engine.speculative``)."""

    req: Req
    start: int
    n: int
    draft: list[int] = field(default_factory=list)

    @property
    def completes_fill(self) -> bool:
        """After this row the request's KV covers all its tokens, so it samples next."""
        return self.start + self.n - len(self.draft) == self.req.num_fill

    def input_ids(self) -> list[int]:
        """The token ids this row feeds (``n`` of them)."""
        fed = self.req.fill_slice(self.start, self.start + self.n - len(self.draft))
        return fed + self.draft if self.draft else fed


class Scheduler:
    """Owns the waiting and running queues and every KV slot of the pool (free, a request's,
    or lent to the prefix cache).

    Args:
        config: the batching limits.
        pool: the target model's KV pool.
        cache: the prefix cache over ``pool``.
    """

    def __init__(self, config: SchedulerConfig, pool: KVPool, cache: PrefixCache):
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.num_retracted = 0

    # -- queues ------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a new request (it holds no slots until admitted)."""
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> list[Row]:
        """Rows for the next forward (possibly empty when everything waits on compilation)."""
        rows: list[Row] = []
        budget = self.config.max_prefill_tokens
        short = self.config.schedule_policy == "short"
        prefilling: list[Req] = []  # ("short": running prefills, ordered with the waiting below)
        # Running requests first, oldest first; retraction takes the newest.
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted earlier in this loop
            if short and req.remaining_prefill > 1:
                prefilling.append(req)
                continue
            budget -= self._chunk(req, rows, budget)
        if short:
            self._prefill_shortest_first(rows, prefilling, budget)
        else:
            self._admit(rows, budget)
        return rows

    def _chunk(self, req: Req, rows: list[Row], budget: int) -> int:
        """A row for running ``req``: one token when decoding, else its next prefill chunk within
        ``budget``; returns the prefill tokens it took (0 for a decode row or none)."""
        need = req.remaining_prefill
        n = 1 if need == 1 else min(need, self.config.chunked_prefill_size, budget)
        if n <= 0 or not self._reserve(n, protect=req, rows=rows):
            return 0
        start = len(req.slots)
        req.slots.extend(self.pool.alloc(n))
        rows.append(Row(req, start, n))
        return n if need > 1 else 0

    def _waiting_candidates(self) -> list[Req]:
        return [r for r in self.waiting if r.grammar_future is None or r.grammar_future.done()]

    def _admit(self, rows: list[Row], budget: int) -> None:
        candidates = self._waiting_candidates()
        if not candidates:
            return
        if self.config.schedule_policy == "lpm":
            matches = {id(r): len(self.cache.match_prefix(r.fill_ids[: self._match_limit(r)]).slots)
                       for r in candidates}
            candidates.sort(key=lambda r: -matches[id(r)])
        prefilling = [r for r in self.running if r.remaining_prefill > 1]
        for req in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            n = self._admit_one(req, rows, budget, prefilling)
            if n < 0:
                break
            budget -= n

    def _prefill_shortest_first(self, rows: list[Row], prefilling: list[Req], budget: int) -> None:
        """The ``short`` policy: the running prefills' next chunks and the waiting requests'
        admissions, shortest next chunk first (a waiting one's counts only its uncached tokens),
        under ``budget``; prefills passed over :data:`MAX_PREFILL_SKIPS` steps, running or waiting
        for admission, go first, oldest first (else a steady stream of short requests would keep a
        long one waiting forever). After the first piece, another joins only while the step's
        prefill stays within ``batch_prefill_tokens``."""
        chunk = self.config.chunked_prefill_size

        def order(req: Req, size: int) -> tuple[int, float, float]:
            # (passed over too often: oldest first, whatever its size; else shortest first)
            if req.prefill_skips >= MAX_PREFILL_SKIPS:
                return (0, req.arrival, size)
            return (1, size, req.arrival)

        work: list[tuple[tuple[int, float, float], int, Req, bool]] = []
        for req in prefilling:
            size = min(req.remaining_prefill, chunk)
            work.append((order(req, size), size, req, True))
        waiting = self._waiting_candidates()
        for req in waiting:
            uncached = req.num_fill - len(self.cache.match_prefix(req.fill_ids[: self._match_limit(req)]).slots)
            size = min(uncached, chunk)
            work.append((order(req, size), size, req, False))
        work.sort(key=lambda w: w[0])
        served: set[int] = set()
        admitting = [r for r in prefilling]
        taken = 0  # prefill tokens this step
        for _, size, req, running in work:
            if budget <= 0:
                break
            if taken and taken + size > self.config.batch_prefill_tokens:
                continue
            if running:
                if req.status is ReqStatus.RUNNING:
                    n = self._chunk(req, rows, budget)
                    budget -= n
                    taken += n
                    if n:
                        served.add(id(req))
                continue
            if len(self.running) >= self.config.max_running_requests:
                continue
            n = self._admit_one(req, rows, budget, admitting)
            if n < 0:
                break
            budget -= n
            taken += n
            if n:
                served.add(id(req))
        for req in prefilling + waiting:
            req.prefill_skips = 0 if id(req) in served else req.prefill_skips + 1

    def _admit_one(self, req: Req, rows: list[Row], budget: int, prefilling: list[Req]) -> int:
        """Admit waiting ``req`` with a first chunk of at most ``budget`` tokens after its cached
        prefix: the prefill tokens it took (0: it waits, another request is prefilling the same
        text), or -1 when the pool cannot hold it (admission stops for this step)."""
        # Match again: admitting an earlier candidate may have evicted part of a match.
        match = self.cache.match_prefix(req.fill_ids[: self._match_limit(req)])
        if self._shares_uncached_prefix(req, len(match.slots), prefilling):
            return 0  # another request is prefilling the same text; reuse it next step
        n = min(req.num_fill - len(match.slots), self.config.chunked_prefill_size, budget)
        self.cache.lock(match.node)  # before evicting, so our own prefix stays
        if not self._reserve(n, protect=None, rows=rows, may_retract=False):
            self.cache.unlock(match.node)
            return -1
        req.last_node = match.node
        req.cached_len = len(match.slots)
        if req.prompt_cached_tokens < 0:
            req.prompt_cached_tokens = min(req.cached_len, len(req.prompt_ids))
        req.slots = array("q", match.slots)
        req.slots.extend(self.pool.alloc(n))
        req.status = ReqStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        rows.append(Row(req, req.cached_len, n))
        prefilling.append(req)
        return n

    def _match_limit(self, req: Req) -> int:
        # At least one token must run through the model to get logits; prompt log-probabilities
        # from position p need the logits at p - 1, so those positions must be recomputed.
        limit = req.num_fill - 1
        if req.params.logprob_start_len >= 0:
            next_pos = req.params.logprob_start_len + len(req.prompt_logprobs)  # first not yet scored
            if next_pos < len(req.prompt_ids):
                limit = min(limit, max(next_pos - 1, 0))
        return max(limit, 0)

    def _shares_uncached_prefix(self, req: Req, matched: int, others: list[Req]) -> bool:
        threshold = self.config.dedup_min_tokens
        ids = req.fill_ids
        for other in others:
            other_ids = other.prompt_ids
            if common_prefix_len(ids, other_ids) - matched >= threshold:
                return True
        return False

    # -- draft tokens (asked by the speculative planner) --------------------------------------
    def attach_draft(self, row: Row, tokens: list[int]) -> bool:
        """Make ``row`` (about to sample) a verify row that also feeds ``tokens``: reserve one
        KV slot per token, evicting unlocked cache entries but never retracting a request.
        False (the row unchanged) when the slots cannot be had."""
        k = len(tokens)
        if not self._reserve(k, protect=row.req, rows=[], may_retract=False):
            return False
        row.req.slots.extend(self.pool.alloc(k))
        row.draft = list(tokens)
        row.n += k
        return True

    def release_draft_slots(self, req: Req, n: int) -> None:
        """Free the KV slots of ``req``'s last ``n`` draft tokens (rejected by verification).
        The accepted ones' stay: their KV is computed, and their tokens join the output next
        (a request that finishes before all of them are appended frees the rest on release)."""
        if n > 0:
            self.pool.free(req.slots[-n:])
            del req.slots[-n:]

    # -- memory ------------------------------------------------------------------------------
    def _reserve(self, n: int, protect: Req | None, rows: list[Row], may_retract: bool = True) -> bool:
        """Make ``n`` slots free: evict cache, then retract the newest running requests that
        are not ``protect`` and not already in ``rows``. False if impossible."""
        if self.pool.num_free >= n:
            return True
        self.cache.evict(n - self.pool.num_free)
        if self.pool.num_free >= n:
            return True
        if not may_retract:
            return False
        in_rows = {id(r.req) for r in rows}
        for victim in reversed(list(self.running)):
            if victim is protect or id(victim) in in_rows:
                continue
            self.retract(victim)
            self.cache.evict(max(n - self.pool.num_free, 0))
            if self.pool.num_free >= n:
                return True
        return False

    def retract(self, req: Req) -> None:
        """Preempt a running request: free its KV and queue it first (it keeps its output)."""
        self.release(req, insert=False)
        req.status = ReqStatus.WAITING
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_retracted += 1

    def release(self, req: Req, insert: bool) -> None:
        """Give back a request's KV: optionally insert it into the radix cache first, then
        unlock its prefix and free what the cache does not keep."""
        if len(req.slots) > req.num_fill:
            # NOTE: KV of draft tokens not in the output: never verified (a forward failed in
            # between), or accepted after the token that finished the request.
            self.pool.free(req.slots[req.num_fill:])
            del req.slots[req.num_fill:]
        if insert and req.slots:
            self.cache_prefix(req)
        own = req.slots[req.cached_len:]
        self.pool.free(own)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = None
        req.slots = array("q")
        req.cached_len = 0

    def cache_prefix(self, req: Req) -> None:
        """Insert the tokens whose KV is computed into the prefix cache, free our duplicate
        slots, and move our lock to the new end node (SGLang's ``cache_unfinished_req``)."""
        n = len(req.slots)
        ids = req.fill_ids[:n]
        inserted = self.cache.insert(ids, req.slots)
        if not inserted.kept:
            return  # a cache that keeps nothing: the request keeps owning its slots
        already = inserted.cached_len
        if already > req.cached_len:
            dup = req.slots[req.cached_len:already]
            match = self.cache.match_prefix(ids)
            tree_slots = match.slots[req.cached_len:already]
            self.pool.free([s for s, t in zip(dup, tree_slots) if s != t])
        match = self.cache.match_prefix(ids)
        assert len(match.slots) == n, "radix insert lost tokens"
        self.cache.lock(match.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = match.node
        req.slots = array("q", match.slots)
        req.cached_len = n

    def finish(self, req: Req) -> None:
        """Remove a finished (or aborted) request from the queues and release its KV."""
        if req in self.running:
            self.running.remove(req)
            self.release(req, insert=True)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def flush_cache(self) -> None:
        """Drop every unlocked prefix-cache entry (its slots go back to the pool)."""
        self.cache.reset()

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every KV slot is free, held by a running request, or in the prefix cache, exactly
        once (DESIGN.md invariant); raise ``AssertionError`` naming the first broken rule."""
        self.cache.check_integrity()
        free = self.pool.free_slot_set()
        assert len(free) == self.pool.num_free, "a slot is on the free list twice"
        owned: list[int] = []
        for req in self.running:
            owned.extend(req.slots[req.cached_len:])
        tree = self.cache.all_slots()
        everything = list(free) + owned + tree
        assert len(everything) == len(set(everything)), "a KV slot is in two places"
        assert len(everything) == self.pool.num_slots, (
            f"{self.pool.num_slots - len(everything)} KV slots are lost"
        )
