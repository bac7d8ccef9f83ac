"""Transfer-engine metrics, per peer and transport, in the process-wide registry.

The engine calls :meth:`TransferMetrics.path` once per transport attempt and
:meth:`PathMetrics.record` after it. Each (peer, transport) pair keeps plain integers
under one lock of its own (an attempt costs a dict lookup, one lock and a bisect; measured
in docs/observability.md); a scrape turns them into Prometheus counters and a histogram.
Names:

- ``mooncake_transfer_bytes_total{peer,transport,op}``: bytes moved (op = read | write)
- ``mooncake_transfer_requests_total{peer,transport}``: requests (of a batch) attempted
- ``mooncake_transfer_slices_total{peer,transport}``: slices attempted
- ``mooncake_transfer_slice_errors_total{peer,transport}``: slices the transport did not
  complete (they fail over or fail)
- ``mooncake_transfer_retries_total{peer,transport}``: slices retried on a fresh connection
- ``mooncake_transfer_failovers_total{peer,transport}``: attempts failed over *to* transport
- ``mooncake_transfer_seconds{peer,transport}``: latency of one attempt (histogram)
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_core.metrics.core import LATENCY_BUCKETS

__all__ = ["PathMetrics", "TransferMetrics", "TRANSFER", "SliceLike"]

_READ = 0  # mooncake_core.transfer.types.READ (this layer sits below transfer)


class SliceLike(Protocol):
    """What :meth:`PathMetrics.record` reads of a transfer slice (a ``WorkItem``)."""

    req: int
    op: int
    length: int
    done: bool


class PathMetrics:
    """The tallies of one (peer, transport) pair."""

    __slots__ = (
        "peer",
        "transport",
        "lock",
        "read_bytes",
        "write_bytes",
        "requests",
        "slices",
        "errors",
        "retries",
        "failovers",
        "buckets",
        "seconds",
    )

    def __init__(self, peer: str, transport: str) -> None:
        self.peer, self.transport = peer, transport
        self.lock = threading.Lock()
        self.read_bytes = self.write_bytes = self.requests = self.slices = self.errors = 0
        self.retries = self.failovers = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # last: above the largest bound
        self.seconds = 0.0

    def record(self, items: Iterable[SliceLike], seconds: float) -> None:
        """One attempt of ``items`` on this path took ``seconds``."""
        rd = wr = bad = n = reqs = 0
        last_req = -1
        for it in items:
            n += 1
            if it.req != last_req:
                reqs += 1
                last_req = it.req
            if not it.done:
                bad += 1
            elif it.op == _READ:
                rd += it.length
            else:
                wr += it.length
        b = bisect_left(LATENCY_BUCKETS, seconds)
        with self.lock:
            self.read_bytes += rd
            self.write_bytes += wr
            self.errors += bad
            self.slices += n
            self.requests += reqs
            self.buckets[b] += 1
            self.seconds += seconds

    def retry(self, slices: int) -> None:
        """``slices`` were retried on a fresh connection."""
        with self.lock:
            self.retries += slices

    def failover(self) -> None:
        """An attempt failed over to this path."""
        with self.lock:
            self.failovers += 1


class TransferMetrics(Collector):
    """The transfer engine's metric families (one per process: :data:`TRANSFER`)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._paths: dict[tuple[str, str], PathMetrics] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def path(self, peer: str, transport: str) -> PathMetrics:
        """The (cached) tallies of ``(peer, transport)``."""
        key = (peer, transport)
        p = self._paths.get(key)
        if p is None:
            with self._lock:
                p = self._paths.get(key)
                if p is None:
                    p = self._paths[key] = PathMetrics(peer, transport)
        return p

    def describe(self) -> list[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            paths = list(self._paths.values())
        return self._families(paths)

    def _families(self, paths: list[PathMetrics]) -> Iterator[Metric]:
        lp = ["peer", "transport"]
        fams = {
            name: CounterMetricFamily(f"mooncake_transfer_{name}", doc, labels=lp)
            for name, doc in (
                ("requests", "requests attempted"),
                ("slices", "slices attempted"),
                ("slice_errors", "slices a transport did not complete"),
                ("retries", "slices retried on a fresh connection"),
                ("failovers", "attempts failed over to this transport"),
            )
        }
        by = CounterMetricFamily("mooncake_transfer_bytes", "bytes moved", labels=[*lp, "op"])
        hist = HistogramMetricFamily(
            "mooncake_transfer_seconds", "latency of one transfer attempt", labels=lp
        )
        bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS), "+Inf"]
        for p in paths:
            with p.lock:
                vals = (p.requests, p.slices, p.errors, p.retries, p.failovers)
                rd, wr, counts, total = p.read_bytes, p.write_bytes, list(p.buckets), p.seconds
            labels = [p.peer, p.transport]
            for fam, v in zip(fams.values(), vals, strict=True):
                fam.add_metric(labels, v)
            by.add_metric([*labels, "read"], rd)
            by.add_metric([*labels, "write"], wr)
            acc, cum = 0, []
            for le, c in zip(bounds, counts, strict=True):
                acc += c
                cum.append((le, acc))
            hist.add_metric(labels, cum, total)
        yield by
        yield from fams.values()
        yield hist


#: The process-wide transfer metrics (default registry).
TRANSFER = TransferMetrics()
