"""Engine-wide counters, latency histograms and the derived figures of ``Engine.stats()``.

The engine observes itself here; a server that exports metrics (``sgrt/server/http/metrics.py``)
reads these figures when scraped: nothing in the engine calls back into a server.
"""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sgrt.engine.outputs import Result


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COMPILE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """A cumulative histogram of durations in seconds, Prometheus-style: ``counts[i]`` counts the
    observations ``<= bounds[i]`` that exceed ``bounds[i-1]``; the last count is the overflow
    (``+Inf``). Safe to observe from several threads (grammar compiles run on workers)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self.total += seconds
            self.count += 1

    def cumulative(self) -> tuple[list[tuple[str, int]], float, int]:
        """``([(upper bound, observations <= it), ..., ("+Inf", count)], sum, count)``, one
        consistent reading."""
        with self._lock:
            counts, total, count = list(self.counts), self.total, self.count
        out, running = [], 0
        for bound, n in zip([*map(repr, self.bounds), "+Inf"], counts):
            running += n
            out.append((bound, running))
        return out, total, count


@dataclass
class EngineMetrics:
    """Counters updated by the loop thread; read (racily but harmlessly) by ``stats()``.

    Hit rate = cached prompt tokens / prompt tokens (DESIGN.md). Throughput = output tokens
    per second of wall time since the first request arrived.
    """

    started: float = field(default_factory=time.monotonic)
    first_arrival: float | None = None
    steps: int = 0
    forward_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run through the model (not served from cache)
    decode_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    forced_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    completion_tokens: int = 0  # output tokens of finished requests
    # Latency of finished requests (TTFT, each inter-token gap, arrival to finish) and the time
    # to get each constrained request's grammar (a compile or a hit in the compiler's cache).
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    grammar_compile: Histogram = field(default_factory=lambda: Histogram(COMPILE_BUCKETS))

    def record_forward(self, rows: list, seconds: float) -> None:
        if self.first_arrival is None:
            self.first_arrival = time.monotonic() - seconds
        self.steps += 1
        self.forward_seconds += seconds
        for row in rows:
            if row.draft:  # a verify row: the last token and its draft
                self.decode_tokens += 1 + len(row.draft)
                self.prefill_tokens += row.n - 1 - len(row.draft)
            elif row.n == 1 and row.req.output_ids:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += row.n

    def record_finish(self, result: Result) -> None:
        self.finished += 1
        self.aborted += result.finish_reason == "abort"
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        self.forced_tokens += result.forced_tokens
        self.spec_drafted += result.spec_drafted
        self.spec_accepted += result.spec_accepted
        self.completion_tokens += result.completion_tokens
        if result.ttft is not None:
            self.ttft.observe(result.ttft)
        for gap in result.itl or ():
            self.itl.observe(gap)
        self.e2e.observe(result.total_time)

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        elapsed = time.monotonic() - (self.first_arrival or self.started)
        pool_total = gauges.get("pool_total", 0)
        out = dict(
            steps=self.steps,
            finished=self.finished,
            aborted=self.aborted,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cache_hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            generated_tokens=self.generated_tokens,
            throughput_tok_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0,
            forward_seconds=self.forward_seconds,
            forced_tokens=self.forced_tokens,
            spec_drafted=self.spec_drafted,
            spec_accepted=self.spec_accepted,
            spec_acceptance_rate=self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
        )
        out.update(gauges)
        if pool_total:
            out["kv_pool_usage"] = 1.0 - gauges.get("pool_free", 0) / pool_total
        return out
