"""Which requests run in the next forward, and where their KV goes.

Each step the scheduler builds one ragged batch: every running request contributes a row (one
token when decoding, a chunk when prefilling), then waiting requests are admitted under the
prefill token budget. Policies: ``lpm`` (longest prefix match first, the default, as in SGLang)
and ``fcfs``. When the KV pool runs short it evicts unlocked radix-cache entries first, then
retracts the newest running requests back to the waiting queue (their output is kept; they
re-prefill later), as SGLang and vLLM preempt by recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.prefix_cache import PrefixCache
from sgrt.engine.request import Req, ReqStatus

POLICIES = ("lpm", "fcfs")


@dataclass
class SchedulerConfig:
    """Batching limits (tokens unless stated)."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 1024  # new prefill tokens admitted per step
    chunked_prefill_size: int = 512  # most prefill tokens one request feeds per step
    policy: str = "lpm"
    dedup_min_tokens: int = 32  # shared uncached prefix that makes a waiting request wait


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
        fill = self.req.fill_ids
        return fill[self.start: self.start + self.n - len(self.draft)] + self.draft


class Scheduler:
    """Owns the waiting and running queues; allocates and frees KV slots."""

    def __init__(self, config: SchedulerConfig, pool: KVPool, cache: PrefixCache):
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {config.policy!r}")
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.num_retracted = 0

    # -- queues ------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> list[Row]:
        """Rows for the next forward (possibly empty when everything waits on compilation)."""
        rows: list[Row] = []
        budget = self.config.max_prefill_tokens
        # Running requests first, oldest first; retraction takes the newest.
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted earlier in this loop
            need = req.remaining_prefill
            n = 1 if need == 1 else min(need, self.config.chunked_prefill_size, budget)
            if n <= 0:
                continue
            if not self._reserve(n, protect=req, rows=rows):
                continue
            start = len(req.slots)
            req.slots.extend(self.pool.alloc(n))
            rows.append(Row(req, start, n))
            if need > 1:
                budget -= n
        self._admit(rows, budget)
        return rows

    def _admit(self, rows: list[Row], budget: int) -> None:
        candidates = [r for r in self.waiting if r.grammar_future is None or r.grammar_future.done()]
        if not candidates:
            return
        matches = {id(r): self.cache.match_prefix(r.fill_ids[: self._match_limit(r)]) for r in candidates}
        if self.config.policy == "lpm":
            candidates.sort(key=lambda r: -len(matches[id(r)].slots))
        prefilling = [r for r in self.running if r.remaining_prefill > 1]
        for req in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            # Match again: admitting an earlier candidate may have evicted part of this match.
            match = self.cache.match_prefix(req.fill_ids[: self._match_limit(req)])
            if self._shares_uncached_prefix(req, len(match.slots), prefilling):
                continue  # another request is prefilling the same text; reuse it next step
            n = min(req.num_fill - len(match.slots), self.config.chunked_prefill_size, budget)
            self.cache.lock(match.node)  # before evicting, so our own prefix stays
            if not self._reserve(n, protect=None, rows=rows, may_retract=False):
                self.cache.unlock(match.node)
                break
            req.last_node = match.node
            req.cached_len = len(match.slots)
            if req.prompt_cached_tokens < 0:
                req.prompt_cached_tokens = min(req.cached_len, len(req.prompt_ids))
            req.slots = list(match.slots) + self.pool.alloc(n)
            req.status = ReqStatus.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            rows.append(Row(req, req.cached_len, n))
            prefilling.append(req)
            budget -= n

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
            n = 0
            limit = min(len(ids), len(other_ids))
            while n < limit and ids[n] == other_ids[n]:
                n += 1
            if n - matched >= threshold:
                return True
        return False

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
            # NOTE: KV of speculative drafts never verified (a forward failed in between).
            self.pool.free(req.slots[req.num_fill:])
            del req.slots[req.num_fill:]
        if insert and req.slots:
            self.cache_prefix(req)
        own = req.slots[req.cached_len:]
        self.pool.free(own)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = None
        req.slots = []
        req.cached_len = 0

    def cache_prefix(self, req: Req) -> None:
        """Insert the tokens whose KV is computed into the radix cache, free our duplicate
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
        req.slots = list(match.slots)
        req.cached_len = n

    def finish(self, req: Req) -> None:
        """Remove a finished (or aborted) request from the queues and release its KV."""
        if req in self.running:
            self.running.remove(req)
            self.release(req, insert=True)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
