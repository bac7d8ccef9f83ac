"""The PD proxy's ``/metrics`` (Prometheus), on the shared metrics layer.

One :class:`ProxyMetrics` per :class:`~mooncake_core.proxy.server.ProxyServer` (a registry
of its own, so several proxies may share a process). Names:

- ``mooncake_proxy_requests_total{policy,outcome}``: outcome = ok | rejected |
  upstream_error | bad_request
- ``mooncake_proxy_routed_total{policy,prefill,decode}``: routing decisions
- ``mooncake_proxy_rejections_total{policy}``: requests refused early (429, before any
  instance saw them)
- ``mooncake_proxy_upstream_errors_total{stage,instance,status}``: stage = prefill | decode;
  status = the upstream's HTTP status, or ``timeout`` / ``unreachable`` / ``invalid``
- ``mooncake_proxy_ttft_seconds{policy}``: time to first byte sent back (streaming: the
  first chunk; otherwise the whole answer)
- ``mooncake_proxy_e2e_seconds{policy}``: arrival to the end of the answer
- ``mooncake_proxy_prefill_seconds{instance}``: the prefill leg
- ``mooncake_proxy_in_flight{role,instance}``: requests an instance is serving now
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_core.metrics import new_registry, render

__all__ = ["ProxyMetrics", "TTFT_BUCKETS"]

#: Seconds: 5 ms .. 60 s (TTFT and end-to-end latency of LLM requests).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """The proxy's metric families; ``instances`` (objects with ``url``, ``role`` and
    ``in_flight``) feed the in-flight gauge at scrape time."""

    def __init__(self, policy: str, instances: Sequence[Any]) -> None:
        self.policy = policy
        self.registry = reg = new_registry()
        self.requests = Counter(
            "mooncake_proxy_requests",
            "requests by outcome",
            ["policy", "outcome"],
            registry=reg,
        )
        self.routed = Counter(
            "mooncake_proxy_routed",
            "routing decisions",
            ["policy", "prefill", "decode"],
            registry=reg,
        )
        self.rejections = Counter(
            "mooncake_proxy_rejections", "requests refused early", ["policy"], registry=reg
        )
        self.upstream_errors = Counter(
            "mooncake_proxy_upstream_errors",
            "failed upstream calls",
            ["stage", "instance", "status"],
            registry=reg,
        )
        self.ttft = Histogram(
            "mooncake_proxy_ttft_seconds",
            "time to the first byte of the answer",
            ["policy"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "mooncake_proxy_e2e_seconds",
            "request arrival to the end of the answer",
            ["policy"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.prefill = Histogram(
            "mooncake_proxy_prefill_seconds",
            "the prefill leg",
            ["instance"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        for outcome in ("ok", "rejected", "upstream_error", "bad_request"):
            self.requests.labels(policy, outcome)
        self.rejections.labels(policy)
        self._ttft = self.ttft.labels(policy)
        self._e2e = self.e2e.labels(policy)
        reg.register(_InFlight(instances))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.policy, outcome).inc()

    def rejected(self) -> None:
        self.rejections.labels(self.policy).inc()
        self.outcome("rejected")

    def routed_to(self, prefill: str, decode: str) -> None:
        self.routed.labels(self.policy, prefill, decode).inc()

    def upstream_error(self, stage: str, instance: str, status: int | str) -> None:
        self.upstream_errors.labels(stage, instance, str(status)).inc()

    def first_byte(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def done(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    async def handler(self, _request: web.Request) -> web.Response:
        """``GET /metrics``."""
        return web.Response(
            body=render(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


class _InFlight(Collector):
    def __init__(self, instances: Sequence[Any]) -> None:
        self.instances = instances

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "mooncake_proxy_in_flight",
            "requests an instance serves now",
            labels=["role", "instance"],
        )
        for inst in self.instances:
            fam.add_metric([str(inst.role), str(inst.url)], float(inst.in_flight))
        yield fam
