"""One metrics layer (prometheus_client) for the transfer engine, store, proxy and adapters.

Contract:

- Metrics are kept up to date where things change (counters, gauges, histograms of
  ``prometheus_client``); a scrape reads them and costs nothing that grows with the number
  of objects, keys or requests served.
- Process-wide metrics (the transfer engine's, see :mod:`mooncake_core.metrics.transfer`)
  live in ``prometheus_client``'s default registry, so any process that already exposes it
  (vLLM's ``/metrics``) shows them; services that may run several times in one process
  (store master, proxy) own a :func:`new_registry` each.
- :func:`serve` exposes a registry on HTTP ``/metrics``, bound to 127.0.0.1 unless told
  otherwise; :func:`serve_process` does it once per process (``transfer.metrics_port``).
- :func:`parse` reads the text format back (``mooncake-core top``, tests).
"""

from mooncake_core.metrics.core import (
    LATENCY_BUCKETS,
    MetricsServer,
    Sample,
    new_registry,
    parse,
    render,
    serve,
    serve_process,
)

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
