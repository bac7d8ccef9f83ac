"""Master metrics: per-RPC counters and latency histograms, rendered as Prometheus text.

Contract: :class:`Metrics` is owned by the master's event loop (not thread-safe);
:meth:`Metrics.observe` is O(buckets) with no allocation per call; :func:`render`
turns the metrics plus a :class:`~mooncake_core.store.state.MasterState` snapshot into
the text exposition format (``/metrics``).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_core.store.state import MasterState

__all__ = ["Metrics", "render", "BUCKETS"]

BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0)


class _Hist:
    __slots__ = ("counts", "total", "n", "errors")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.n = 0
        self.errors = 0


class Metrics:
    """Per-method request counts, error counts and latency histograms."""

    def __init__(self) -> None:
        self.ops: dict[str, _Hist] = {}
        self.started = time.time()
        self.bad_frames = 0

    def observe(self, method: str, seconds: float, ok: bool) -> None:
        h = self.ops.get(method)
        if h is None:
            if len(self.ops) > 64:  # bounded: unknown method names are lumped together
                method = "other"
                h = self.ops.get(method)
            if h is None:
                h = self.ops[method] = _Hist()
        h.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        h.total += seconds
        h.n += 1
        if not ok:
            h.errors += 1


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(m: Metrics, state: MasterState, role: str) -> str:
    """Prometheus text for ``/metrics``."""
    now = time.monotonic()
    out: list[str] = []

    def gauge(name: str, help_: str, value: float, labels: str = "") -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{labels} {value}")

    def counter(name: str, help_: str, value: float) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} counter\n{name} {value}")

    objs = [o for o in state.objects.values() if o.complete]
    gauge(
        "mooncake_master_is_leader",
        "1 when this master is the leader",
        1 if role == "leader" else 0,
    )
    gauge("mooncake_master_objects", "complete objects", len(objs))
    gauge("mooncake_master_object_bytes", "bytes of complete objects", sum(o.size for o in objs))
    gauge(
        "mooncake_master_pending_puts",
        "puts started and not yet ended",
        len(state.objects) - len(objs),
    )
    gauge("mooncake_master_clients", "live clients", len(state.clients))
    gauge(
        "mooncake_master_leased_objects",
        "objects with an unexpired read lease",
        sum(1 for o in objs if o.lease_until > now),
    )
    gauge(
        "mooncake_master_pinned_objects", "hard-pinned objects", sum(1 for o in objs if o.hard_pin)
    )
    gauge("mooncake_master_ssd_objects", "objects with an SSD copy", sum(1 for o in objs if o.disk))
    used, total = state.usage()
    gauge("mooncake_master_used_bytes", "allocated bytes over all segments", used)
    gauge("mooncake_master_capacity_bytes", "mounted bytes over all segments", total)
    out.append(
        "# HELP mooncake_master_segment_used_bytes allocated bytes per segment\n"
        "# TYPE mooncake_master_segment_used_bytes gauge"
    )
    for s in state.segments.values():
        out.append(
            f'mooncake_master_segment_used_bytes{{segment="{_esc(s.name)}",'
            f'client="{_esc(s.client_id)}"}} '
            f"{s.allocator.used}"
        )
    out.append(
        "# HELP mooncake_master_segment_capacity_bytes size per segment\n"
        "# TYPE mooncake_master_segment_capacity_bytes gauge"
    )
    for s in state.segments.values():
        out.append(f'mooncake_master_segment_capacity_bytes{{segment="{_esc(s.name)}"}} {s.size}')
    c = state.counters
    counter(
        "mooncake_master_evictions_total", "replicas evicted (dropped or offloaded)", c["evictions"]
    )
    counter("mooncake_master_evicted_bytes_total", "bytes evicted", c["evicted_bytes"])
    counter("mooncake_master_ssd_offloads_total", "objects offloaded to SSD", c["offloads"])
    counter("mooncake_master_ssd_promotions_total", "promotions from SSD started", c["promotions"])
    counter(
        "mooncake_master_expired_clients_total",
        "clients dropped for missing heartbeats",
        c["expired_clients"],
    )
    counter(
        "mooncake_master_reclaimed_puts_total", "unfinished puts reclaimed", c["reclaimed_puts"]
    )
    counter(
        "mooncake_master_bad_frames_total", "malformed RPC frames (connection closed)", m.bad_frames
    )
    out.append(
        "# HELP mooncake_master_requests_total RPC requests by method\n"
        "# TYPE mooncake_master_requests_total counter"
    )
    for meth, h in sorted(m.ops.items()):
        out.append(f'mooncake_master_requests_total{{method="{meth}"}} {h.n}')
    out.append(
        "# HELP mooncake_master_request_errors_total RPC requests that failed, by method\n"
        "# TYPE mooncake_master_request_errors_total counter"
    )
    for meth, h in sorted(m.ops.items()):
        out.append(f'mooncake_master_request_errors_total{{method="{meth}"}} {h.errors}')
    out.append(
        "# HELP mooncake_master_request_seconds RPC handling latency\n"
        "# TYPE mooncake_master_request_seconds histogram"
    )
    for meth, h in sorted(m.ops.items()):
        acc = 0
        for b, n in zip(BUCKETS, h.counts, strict=False):
            acc += n
            out.append(
                f'mooncake_master_request_seconds_bucket{{method="{meth}",le="{b:g}"}} {acc}'
            )
        out.append(f'mooncake_master_request_seconds_bucket{{method="{meth}",le="+Inf"}} {h.n}')
        out.append(f'mooncake_master_request_seconds_sum{{method="{meth}"}} {h.total:.6f}')
        out.append(f'mooncake_master_request_seconds_count{{method="{meth}"}} {h.n}')
    return "\n".join(out) + "\n"
