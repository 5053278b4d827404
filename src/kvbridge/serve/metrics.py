"""The proxy's Prometheus metrics (seconds for durations, ``_total`` for counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvbridge_proxy_requests_total",
            "Requests by route and outcome.",
            ["route", "outcome"],
            registry=r,
        )
        self.stage = Histogram(
            "kvbridge_proxy_stage_seconds",
            "Time of each stage of a P/D request.",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvbridge_proxy_time_to_first_token_seconds",
            "From the request's arrival to D's first streamed chunk (or full reply).",
            buckets=_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "kvbridge_proxy_backend_errors_total",
            "Failed calls to a backend, by role and cause.",
            ["role", "cause"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvbridge_proxy_in_flight",
            "Requests in flight per backend.",
            ["role", "url"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
