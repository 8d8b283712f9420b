"""EngineMetrics: the engine's own observations of finished requests (read by the server's
Prometheus collector at scrape time, never pushed to it)."""
from __future__ import annotations

import threading

from sgrt.engine.metrics import EngineMetrics, Histogram
from sgrt.engine.outputs import Result


def test_histogram_buckets_are_cumulative_with_overflow():
    h = Histogram((0.1, 1.0))
    for s in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(s)
    buckets, total, count = h.cumulative()
    # 0.1 falls in the <= 0.1 bucket (upper bounds are inclusive, as in Prometheus).
    assert buckets == [("0.1", 2), ("1.0", 3), ("+Inf", 5)]
    assert count == 5 and abs(total - 5.65) < 1e-9


def test_histogram_counts_every_observation_from_several_threads():
    h = Histogram((0.5,))
    threads = [threading.Thread(target=lambda: [h.observe(0.25) for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.cumulative()[0] == [("0.5", 8000), ("+Inf", 8000)]


def test_record_finish_fills_the_latency_histograms_and_token_counters():
    m = EngineMetrics()
    m.record_finish(Result("a", prompt_tokens=7, completion_tokens=3, cached_tokens=2, ttft=0.02,
                           total_time=0.3, itl=[0.01, 0.2]))
    m.record_finish(Result("b", prompt_tokens=4, completion_tokens=0, finish_reason="abort", total_time=0.001))
    assert (m.prompt_tokens, m.cached_tokens, m.completion_tokens, m.finished, m.aborted) == (11, 2, 3, 2, 1)
    assert m.ttft.count == 1 and m.itl.count == 2 and m.e2e.count == 2
    assert abs(m.itl.total - 0.21) < 1e-9
    assert m.grammar_compile.count == 0
