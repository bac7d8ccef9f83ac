"""Registries, the HTTP exposition and the text parser shared by every component."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    start_http_server,
)
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "LATENCY_BUCKETS",
    "MetricsServer",
    "Sample",
    "new_registry",
    "parse",
    "render",
    "serve",
    "serve_process",
]

logger = logging.getLogger(__name__)

#: Latency buckets (seconds) for RPCs and transfers: 25 us .. 10 s.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


def new_registry(*, process: bool = True) -> CollectorRegistry:
    """A registry of its own (one per service instance), with the process metrics
    (``process_*``: RSS, CPU, open fds; ``python_*``: GC, version) unless ``process`` is
    False."""
    reg = CollectorRegistry(auto_describe=True)
    if process:
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            reg.register(c)
    return reg


def render(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The registry in the Prometheus text format."""
    return generate_latest(registry)


class MetricsServer:
    """A ``/metrics`` endpoint on a daemon thread; :meth:`close` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd: WSGIServer
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self.registry = registry

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(
    registry: CollectorRegistry = REGISTRY, host: str = "127.0.0.1", port: int = 0
) -> MetricsServer:
    """Expose ``registry`` at ``http://host:port/metrics`` (port 0 picks a free one)."""
    return MetricsServer(registry, host, port)


_process_server: MetricsServer | None = None
_process_lock = threading.Lock()


def serve_process(host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """The process-wide endpoint of the default registry (transfer engine metrics, process
    metrics), started on first call; later calls return the running one whatever they ask
    (one endpoint per process, however many engines it has)."""
    global _process_server
    with _process_lock:
        if _process_server is None:
            _process_server = serve(REGISTRY, host, port)
            logger.info("metrics on %s", _process_server.url)
        elif port and port != _process_server.port:
            logger.warning(
                "metrics already served on port %d in this process; not opening %d",
                _process_server.port,
                port,
            )
        return _process_server


@dataclass(frozen=True)
class Sample:
    """One sample of a scrape: metric family ``name`` (``x`` for ``x_total``), the sample's
    own ``sample`` name (``x_total``, ``x_bucket``...), its labels and value."""

    name: str
    sample: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (raises ``ValueError`` on malformed text)."""
    out: list[Sample] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append(Sample(fam.name, s.name, dict(s.labels), float(s.value)))
    return out
