"""``GET /metrics``: the server's and the engine's metrics in the Prometheus text format
(https://prometheus.io/docs/instrumenting/exposition_formats/), through ``prometheus-client``.

Per server (one :class:`ServerMetrics` per HTTP app, in its own registry):

- ``sgrt_http_requests_total{method, path, status}``: HTTP requests answered (an ASGI
  middleware sees every response's status line);
- ``sgrt_time_to_first_token_seconds``, ``sgrt_inter_token_latency_seconds``,
  ``sgrt_e2e_request_latency_seconds``: histograms over finished engine requests (TTFT, ITL
  per token, end to end), and ``sgrt_prompt_tokens_total`` / ``sgrt_generation_tokens_total``
  / ``sgrt_cached_prompt_tokens_total``;
- ``sgrt_grammar_compile_seconds``: time to get a request's grammar (compilation, or a hit in
  the compiler's cache);
- read from ``engine.stats()`` at scrape time: ``sgrt_num_requests_running`` /
  ``_waiting``, ``sgrt_kv_pool_usage_ratio``, ``sgrt_prefix_cache_hit_rate``,
  ``sgrt_spec_decode_acceptance_rate`` and the drafted / accepted token counters.

Finished requests are observed by wrapping the engine's ``metrics.record_finish`` (and the
grammar's compile call), so every request counts, whatever server submitted it.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    """Gauges and counters read from ``engine.stats()`` when scraped."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Any:
        try:
            st = self.engine.stats()
        except Exception:  # noqa: BLE001 - a stopped engine has no stats: report none
            return
        gauges = {
            "sgrt_num_requests_running": ("requests being decoded", st.get("running", 0)),
            "sgrt_num_requests_waiting": ("requests waiting for a KV slot or a prefill", st.get("waiting", 0)),
            "sgrt_kv_pool_usage_ratio": ("fraction of the KV pool in use", st.get("kv_pool_usage", 0.0)),
            "sgrt_prefix_cache_hit_rate": ("cached prompt tokens / prompt tokens", st.get("cache_hit_rate", 0.0)),
            "sgrt_spec_decode_acceptance_rate": ("accepted / drafted speculative tokens",
                                                 st.get("spec_acceptance_rate", 0.0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "sgrt_spec_decode_draft_tokens": ("speculative tokens drafted", st.get("spec_drafted", 0)),
            "sgrt_spec_decode_accepted_tokens": ("speculative tokens accepted", st.get("spec_accepted", 0)),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    """The metrics of one HTTP server over one engine (its own registry)."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sgrt_http_requests", "HTTP requests answered", ["method", "path", "status"],
                                registry=r)
        self.ttft = Histogram("sgrt_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("sgrt_inter_token_latency_seconds", "time between two output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sgrt_e2e_request_latency_seconds", "arrival to finish of an engine request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sgrt_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("sgrt_cached_prompt_tokens", "prompt tokens read from the radix cache",
                                     registry=r)
        self.generation_tokens = Counter("sgrt_generation_tokens", "generated tokens", registry=r)
        self.compile = Histogram("sgrt_grammar_compile_seconds", "time to get a request's grammar",
                                 buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=r)
        r.register(_EngineCollector(engine))
        self._watch(engine)

    def _watch(self, engine: Any) -> None:
        metrics = getattr(engine, "metrics", None)
        if metrics is not None and hasattr(metrics, "record_finish"):
            record = metrics.record_finish

            def record_finish(result: Any) -> None:
                record(result)
                self.observe(result)

            metrics.record_finish = record_finish
        # NOTE: the engine's intake compiles grammars on its workers (sgrt/engine/intake.py).
        intake = getattr(engine, "intake", None)
        compile_grammar = getattr(intake, "_compile_grammar", None)
        if compile_grammar is not None:
            def timed(params: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return compile_grammar(params)
                finally:
                    self.compile.observe(time.perf_counter() - t0)

            intake._compile_grammar = timed

    def observe(self, result: Any) -> None:
        """Record one finished engine request (runs on the engine thread)."""
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.generation_tokens.inc(result.completion_tokens)
        if result.ttft is not None:
            self.ttft.observe(result.ttft)
        for gap in result.itl or ():
            self.itl.observe(gap)
        self.e2e.observe(result.total_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: counts every HTTP response by method, route path and status
    (``app.add_middleware(RequestCounter, metrics=...)``)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.requests = metrics.requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", None) or "other"
                self.requests.labels(scope["method"], path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def metrics_of(api: Any) -> ServerMetrics:
    """The server's :class:`ServerMetrics` (made, and the engine watched, on first use)."""
    m = getattr(api, "server_metrics", None)
    if m is None:
        m = ServerMetrics(api.engine)
        api.server_metrics = m
    return m


async def metrics_endpoint(api: Any, request: Request) -> Response:
    """``GET /metrics`` (needs the Bearer token when the server has one)."""
    api.check_auth(request)
    return Response(metrics_of(api).render(), media_type=CONTENT_TYPE)
