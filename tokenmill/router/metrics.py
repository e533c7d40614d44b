"""The router's Prometheus metrics, per backend: what it routed where and why, what failed, and each backend's
state and load as the router last saw them."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from tokenmill.router.backend import Backend

FAILURE_REASONS = ("connect", "lost", "down")  # refused before sending (retried elsewhere) | broke mid-request |
                                               # failed by the health check


class _BackendCollector:
    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        gauges = [
            ("backend_up", "1 while the backend takes requests", lambda b: float(b.healthy)),
            ("in_flight", "requests the router has open on the backend", lambda b: b.in_flight),
            ("backend_load", "the load score routing compares", Backend.load),
            ("backend_num_requests_running", "the backend's running requests, last poll", lambda b: b.running),
            ("backend_num_requests_waiting", "the backend's waiting requests, last poll", lambda b: b.waiting),
            ("backend_kv_cache_usage_perc", "the backend's KV cache usage (0-1), last poll", lambda b: b.kv_usage),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"tokenmill:router_{name}", doc, labels=["backend", "pool"])
            for b in self.backends:
                g.add_metric([b.url, b.pool], value(b))
            yield g


class RouterMetrics:
    def __init__(self, backends: list[Backend]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_BackendCollector(backends))
        self.requests = Counter("tokenmill:router_requests", "requests sent to a backend, by routing policy",
                                ["backend", "pool", "policy"], registry=self.registry)
        self.failures = Counter("tokenmill:router_request_failures", "requests a backend failed, by reason",
                                ["backend", "pool", "reason"], registry=self.registry)
        self.unroutable = Counter("tokenmill:router_unroutable", "requests refused: no healthy backend",
                                  registry=self.registry)
        for b in backends:
            for policy in ("affinity", "least_load"):
                self.requests.labels(b.url, b.pool, policy)
            for reason in FAILURE_REASONS:
                self.failures.labels(b.url, b.pool, reason)

    def routed(self, backend: Backend, policy: str) -> None:
        self.requests.labels(backend.url, backend.pool, policy).inc()

    def failed(self, backend: Backend, reason: str) -> None:
        self.failures.labels(backend.url, backend.pool, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
