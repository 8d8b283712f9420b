"""``GET /metrics``: the server's and the engine's metrics in the Prometheus text format
(https://prometheus.io/docs/instrumenting/exposition_formats/), through ``prometheus-client``.

Per server (one :class:`ServerMetrics` per HTTP app, in its own registry):

- ``sgrt_http_requests_total{method, path, status}``: HTTP requests answered (an ASGI
  middleware sees every response's status line);
- read from the engine's own :class:`~sgrt.engine.metrics.EngineMetrics` at scrape time (a
  pull: the engine observes itself and never calls into a server):
  ``sgrt_time_to_first_token_seconds``, ``sgrt_inter_token_latency_seconds``,
  ``sgrt_e2e_request_latency_seconds`` (histograms over finished engine requests: TTFT, ITL per
  token, end to end), ``sgrt_grammar_compile_seconds`` (time to get a request's grammar: a
  compilation or a hit in the compiler's cache), ``sgrt_prompt_tokens_total`` /
  ``sgrt_generation_tokens_total`` / ``sgrt_cached_prompt_tokens_total``;
- read from ``engine.stats()``: ``sgrt_num_requests_running`` / ``_waiting``,
  ``sgrt_kv_pool_usage_ratio``, ``sgrt_prefix_cache_hit_rate``,
  ``sgrt_spec_decode_acceptance_rate`` and the drafted / accepted token counters.

The engine's figures count every request since the engine started, whatever server submitted it.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from sgrt.engine.client import EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Gauges, counters and histograms read from the engine when scraped."""

    def __init__(self, engine: EngineClient):
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
        yield from self._observed(self.engine.metrics)

    @staticmethod
    def _observed(m: Any) -> Any:
        """The engine's own observations of finished requests and grammar compiles."""
        if m is None or not hasattr(m, "ttft"):
            return
        counters = {
            "sgrt_prompt_tokens": ("prompt tokens of finished requests", m.prompt_tokens),
            "sgrt_cached_prompt_tokens": ("prompt tokens read from the radix cache", m.cached_tokens),
            "sgrt_generation_tokens": ("generated tokens", m.completion_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
        histograms = {
            "sgrt_time_to_first_token_seconds": ("time to first token", m.ttft),
            "sgrt_inter_token_latency_seconds": ("time between two output tokens", m.itl),
            "sgrt_e2e_request_latency_seconds": ("arrival to finish of an engine request", m.e2e),
            "sgrt_grammar_compile_seconds": ("time to get a request's grammar", m.grammar_compile),
        }
        for name, (doc, hist) in histograms.items():
            buckets, total, _ = hist.cumulative()
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class ServerMetrics:
    """The metrics of one HTTP server over one engine (its own registry)."""

    def __init__(self, engine: EngineClient):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sgrt_http_requests", "HTTP requests answered", ["method", "path", "status"],
                                registry=r)
        r.register(_EngineCollector(engine))

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
    """The server's :class:`ServerMetrics` (made on first use)."""
    m = getattr(api, "server_metrics", None)
    if m is None:
        m = ServerMetrics(api.engine)
        api.server_metrics = m
    return m


async def metrics_endpoint(api: Any, request: Request) -> Response:
    """``GET /metrics`` (needs the Bearer token when the server has one)."""
    api.check_auth(request)
    return Response(metrics_of(api).render(), media_type=CONTENT_TYPE)
