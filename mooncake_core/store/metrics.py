"""Master metrics on the shared metrics layer (:mod:`mooncake_core.metrics`).

Contract: one :class:`Metrics` per master, owned by the master's event loop (its
``/metrics`` handler runs there too, so nothing here is locked). :meth:`Metrics.observe`
is called once per RPC and keeps every counter current (requests, failures, latency,
hits and misses, lease grants); a scrape reads those plus values the state keeps in
O(1) or O(segments + clients) (key count, memory used, clients, SSD keys, HA role): it
never walks the objects.

Names: ours (``mooncake_master_*``) and, where the meaning is the same, the ones the
published ``mooncake_master`` 0.3.13 exports (``master_key_count``,
``master_allocated_bytes``, ``master_put_start_requests_total``, ``mem_cache_hit_nums_``,
``valid_get_nums_``, ``master_evicted_key_count``, ``ha_oplog_last_sequence_id``...), so
a dashboard built for the published master reads ours. docs/observability.md lists both.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

from mooncake_core.metrics import LATENCY_BUCKETS, new_registry
from mooncake_core.metrics import render as render_registry

__all__ = ["Metrics", "render", "PUBLISHED_ALSO", "PUBLISHED_METHODS", "ROLES"]

#: our RPC method -> the published master's name for the same call (its counters are
#: ``master_<name>_requests_total`` / ``master_<name>_failures_total``).
PUBLISHED_METHODS = {
    "put_start": "put_start",
    "put_end": "put_end",
    "put_revoke": "put_revoke",
    "batch_put_start": "batch_put_start",
    "batch_put_end": "batch_put_end",
    "get_replica_list": "get_replica_list",
    "batch_get_replica_list": "batch_get_replica_list",
    "exists": "exist_key",
    "batch_exists": "batch_exist_key",
    "remove": "remove",
    "remove_by_regex": "remove_by_regex",
    "remove_all": "remove_all",
    "mount": "mount_segment",
    "unmount": "unmount_segment",
    "ping": "ping",
    "query_replica_task": "query_task",
}
#: our calls that do the work of more published calls: a put into a lent extent
#: (``put_commit``) both starts and ends its key's put, so it counts as one of each.
PUBLISHED_ALSO = {
    "put_commit": ("put_start", "put_end"),
    "batch_put_commit": ("batch_put_start", "batch_put_end"),
}
_PUB_SOURCES: dict[str, list[str]] = {}
for _ours, _pub in PUBLISHED_METHODS.items():
    _PUB_SOURCES.setdefault(_pub, []).append(_ours)
for _ours, _pubs in PUBLISHED_ALSO.items():
    for _pub in _pubs:
        _PUB_SOURCES.setdefault(_pub, []).append(_ours)
#: batch calls with per-item results -> the published batch name they count under
#: (``master_<name>_items_total``, ``..._failed_items_total``, ``..._partial_successes_total``)
_BATCHES = {
    "batch_get_replica_list": ("batch_get_replica_list",),
    "batch_exists": ("batch_exist_key",),
    "batch_put_start": ("batch_put_start",),
    "batch_put_end": ("batch_put_end",),
    "batch_put_commit": ("batch_put_start", "batch_put_end"),
}
ROLES = ("leader", "standby", "starting", "deposed")
_MAX_METHODS = 64  # unknown method names beyond this are lumped together as "other"


class MasterView(Protocol):
    """What the metrics read of a master (``MasterServer``)."""

    state: Any
    role: str


class _Get:
    """Hit/miss tallies of replica-list lookups (reads)."""

    __slots__ = ("total", "valid", "mem", "file", "mem_bytes", "file_bytes")

    def __init__(self) -> None:
        self.total = self.valid = self.mem = self.file = self.mem_bytes = self.file_bytes = 0

    def hit(self, size: int, in_memory: bool) -> None:
        self.total += 1
        self.valid += 1
        if in_memory:
            self.mem += 1
            self.mem_bytes += size
        else:
            self.file += 1
            self.file_bytes += size


class _Op:
    """Tallies of one RPC method: plain numbers bumped on the event loop (no lock, no
    prometheus_client call on the hot path); exported at scrape time by :class:`_OpCollector`."""

    __slots__ = ("n", "errors", "buckets", "seconds")

    def __init__(self) -> None:
        self.n = self.errors = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # last: above the largest bound
        self.seconds = 0.0


class Metrics:
    """Per-RPC counters and latency histograms plus the master's gauges, in a registry of
    its own (several masters may share a process).

    The per-RPC figures are plain tallies (one dict lookup, a bisect and a few integer
    additions per call, about 1 us); a scrape turns them into the counter and histogram
    families (:class:`_OpCollector`)."""

    def __init__(self, server: MasterView | None = None) -> None:
        self.server = server
        self.registry = new_registry()
        reg = self.registry
        self.ops: dict[str, _Op] = {}
        self.bad_frames = 0
        self.lease_grants = 0
        self.gets = _Get()
        self.leases: OrderedDict[str, float] = OrderedDict()  # key -> lease expiry (monotonic)
        # published batch name -> [items, failed items, partially successful requests]
        self.batch_items: dict[str, list[int]] = {}
        # replica task kind (copy / move) -> [create requests, failed ones]
        self.task_kinds: dict[str, list[int]] = {"copy": [0, 0], "move": [0, 0]}
        reg.register(_OpCollector(self))
        reg.register(_StateCollector(self))

    # ------------------------------------------------------------------ updates
    def _op(self, method: str) -> _Op:
        if len(self.ops) >= _MAX_METHODS:  # unknown method names are lumped together
            method = "other"
        op = self.ops.get(method)
        if op is None:
            op = self.ops[method] = _Op()
        return op

    def observe(
        self, method: str, seconds: float, ok: bool, args: Any = None, result: Any = None
    ) -> None:
        """One RPC ``method`` took ``seconds``; ``args``/``result`` (decoded arguments and the
        handler's result when ``ok``) feed the hit/miss and lease counters."""
        op = self.ops.get(method)
        if op is None:
            op = self._op(method)
        op.n += 1
        op.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        op.seconds += seconds
        if not ok:
            op.errors += 1
        if args is None:
            return
        if method in _BATCHES:
            self._batch(method, ok, args, result)
        elif method == "create_replica_task":
            kind = self.task_kinds.get(getattr(args, "kind", ""))
            if kind is not None:
                kind[0] += 1
                kind[1] += not ok
        if method == "get_replica_list":
            if ok:
                size, reps, ttl, _tok = result
                self.gets.hit(int(size), bool(reps))
                self._leased(args.key, ttl)
            else:
                self.gets.total += 1
        elif method == "batch_get_replica_list":
            if ok:
                for key, (code, size, reps, ttl, _tok) in zip(args.keys, result, strict=False):
                    if code == 0:
                        self.gets.hit(int(size), bool(reps))
                        self._leased(key, ttl)
                    else:
                        self.gets.total += 1
            else:
                self.gets.total += len(getattr(args, "keys", ()) or ())
        elif method == "exists" and ok and result:
            self._leased(args.key, None)
        elif method == "batch_exists" and ok:
            for key, found in zip(args.keys, result, strict=False):
                if found:
                    self._leased(key, None)

    def _batch(self, method: str, ok: bool, args: Any, result: Any) -> None:
        """Items, failed items and partial successes of one batch call."""
        n = len(getattr(args, "keys", ()) or ())
        if not ok:
            failed = n
        elif method == "batch_exists":
            failed = 0  # a key that is not there is an answer, not a failure
        else:
            failed = sum(1 for r in result if r[0] != 0)
        for pub in _BATCHES[method]:
            t = self.batch_items.get(pub)
            if t is None:
                t = self.batch_items[pub] = [0, 0, 0]
            t[0] += n
            t[1] += failed
            t[2] += ok and 0 < failed < n

    def _leased(self, key: str, ttl: float | None) -> None:
        if ttl is None:
            server = self.server
            ttl = float(server.state.cfg.lease_ttl_s) if server is not None else 0.0
        self.lease_grants += 1
        now = time.monotonic()
        leases = self.leases
        leases[key] = now + float(ttl)
        leases.move_to_end(key)
        # Drop a few expired grants from the front on every grant, so the table stays bounded
        # by the keys leased within one TTL even when nobody scrapes (unique KV-cache keys
        # would otherwise grow it without end).
        for _ in range(4):
            if not leases or next(iter(leases.values())) > now:
                break
            leases.popitem(last=False)

    def leased_now(self) -> int:
        """Keys with an unexpired lease (amortised O(1): expired grants are dropped here)."""
        now = time.monotonic()
        leases = self.leases
        while leases:
            key, until = next(iter(leases.items()))
            if until > now:
                break
            leases.popitem(last=False)
        return len(leases)


def _g(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _OpCollector(Collector):
    """The per-RPC families, built from :class:`Metrics`' tallies at scrape time (the same
    names prometheus_client's Counter/Histogram would export)."""

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.m
        ops = sorted(m.ops.items())
        req = CounterMetricFamily(
            "mooncake_master_requests", "RPC requests by method", labels=["method"]
        )
        err = CounterMetricFamily(
            "mooncake_master_request_errors",
            "RPC requests that failed, by method",
            labels=["method"],
        )
        sec = HistogramMetricFamily(
            "mooncake_master_request_seconds", "RPC handling latency", labels=["method"]
        )
        bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS), "+Inf"]
        for name, op in ops:
            req.add_metric([name], op.n)
            err.add_metric([name], op.errors)
            acc, cum = 0, []
            for le, c in zip(bounds, op.buckets, strict=True):
                acc += c
                cum.append((le, acc))
            sec.add_metric([name], cum, op.seconds)
        yield req
        yield err
        yield sec
        for pub, sources in _PUB_SOURCES.items():
            seen = [op for op in map(m.ops.get, sources) if op is not None]
            n, errors = sum(op.n for op in seen), sum(op.errors for op in seen)
            yield _counter(f"master_{pub}_requests", f"{pub} requests", n)
            yield _counter(f"master_{pub}_failures", f"failed {pub} requests", errors)
        for kind, (n, errors) in m.task_kinds.items():
            yield _counter(f"master_create_{kind}_task_requests", f"{kind} tasks requested", n)
            yield _counter(f"master_create_{kind}_task_failures", f"{kind} tasks refused", errors)
        for pub in (
            "batch_get_replica_list",
            "batch_exist_key",
            "batch_put_start",
            "batch_put_end",
        ):
            items, failed, partial = m.batch_items.get(pub, (0, 0, 0))
            yield _counter(f"master_{pub}_items", f"keys in {pub} requests", items)
            yield _counter(f"master_{pub}_failed_items", f"failed keys in {pub} requests", failed)
            yield _counter(
                f"master_{pub}_partial_successes",
                f"{pub} requests with some keys failed, not all",
                partial,
            )
        yield _counter(
            "mooncake_master_bad_frames", "malformed RPC frames (connection closed)", m.bad_frames
        )
        yield _counter(
            "mooncake_master_lease_grants",
            "read leases granted (replica lookups and exists that found the object)",
            m.lease_grants,
        )


class _StateCollector(Collector):
    """Gauges read at scrape time from values the master keeps in O(1) or O(segments)."""

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # collected on demand (names depend on nothing else in the registry)

    def collect(self) -> Iterator[Metric]:
        m = self.m
        server = m.server
        role = server.role if server is not None else "starting"
        yield _g("mooncake_master_is_leader", "1 when this master is the leader", role == "leader")
        fam = GaugeMetricFamily("mooncake_master_role", "1 for this master's role", labels=["role"])
        for r in ROLES:
            fam.add_metric([r], 1 if role == r else 0)
        yield fam
        seq = int(getattr(server, "_seq", 0) or 0)
        yield _g("ha_oplog_last_sequence_id", "last oplog sequence id written or read", seq)
        yield _g("ha_oplog_applied_sequence_id", "last oplog sequence id applied", seq)
        g = m.gets
        for name, doc, val in (
            ("mem_cache_hit_nums_", "replica lookups served from memory", g.mem),
            ("file_cache_hit_nums_", "replica lookups served from the SSD tier", g.file),
            ("valid_get_nums_", "replica lookups that found the object", g.valid),
            ("total_get_nums_", "replica lookups", g.total),
        ):
            yield UnknownMetricFamily(name, doc + " (counter)", value=val)
        yield _counter("mem_cache_hit_bytes", "bytes of lookups served from memory", g.mem_bytes)
        yield _counter("file_cache_hit_bytes", "bytes of lookups served from SSD", g.file_bytes)
        fam2 = _counter_family("mooncake_master_gets", "replica lookups by result", ["result"])
        fam2.add_metric(["hit"], g.valid)
        fam2.add_metric(["miss"], g.total - g.valid)
        yield fam2
        yield _g("mooncake_master_leased_objects", "keys with an unexpired lease", m.leased_now())
        if server is None:
            return
        st = server.state
        c = st.counters
        for name, doc, key in (
            ("mooncake_master_evictions", "replicas evicted (dropped or offloaded)", "evictions"),
            ("mooncake_master_evicted_bytes", "bytes evicted", "evicted_bytes"),
            ("mooncake_master_ssd_offloads", "objects offloaded to SSD", "offloads"),
            ("mooncake_master_ssd_promotions", "promotions from SSD started", "promotions"),
            (
                "mooncake_master_expired_clients",
                "clients dropped (no heartbeat)",
                "expired_clients",
            ),
            ("mooncake_master_reclaimed_puts", "unfinished puts reclaimed", "reclaimed_puts"),
            (
                "mooncake_master_suspect_marks",
                "holders marked suspect (a writer could not reach them)",
                "suspect_marks",
            ),
            *_TIER_COUNTERS,
        ):
            yield _counter(name, doc, c.get(key, 0))
        for name, doc, key in _TIER_GAUGES:  # store/hotkeys.py
            yield _g(name, doc, st.hot_stats()[key])
        yield UnknownMetricFamily(
            "master_evicted_key_count", "keys evicted (counter)", value=c.get("evictions", 0)
        )
        yield UnknownMetricFamily(
            "master_evicted_size_bytes", "bytes evicted (counter)", value=c.get("evicted_bytes", 0)
        )
        keys = len(st.objects)
        yield _g("mooncake_master_objects", "keys (complete objects and puts in flight)", keys)
        yield _g("master_key_count", "keys managed by the master", keys)
        clients = len(st.clients)
        yield _g("mooncake_master_clients", "live clients", clients)
        yield _g("master_active_clients", "live clients", clients)
        used, total = st.usage()
        yield _g("mooncake_master_used_bytes", "allocated bytes over all segments", used)
        yield _g("mooncake_master_capacity_bytes", "mounted bytes over all segments", total)
        yield _g("master_allocated_bytes", "allocated bytes over all segments", used)
        yield _g("master_total_capacity_bytes", "mounted bytes over all segments", total)
        ssd = sum(len(ci.disk_keys) for ci in st.clients.values())
        yield _g("mooncake_master_ssd_objects", "objects with an SSD copy", ssd)
        yield _g("file_cache_nums_", "objects with an SSD copy", ssd)
        yield _g(
            "mooncake_master_offload_pending_bytes",
            "bytes queued for SSD offload",
            sum(st.offload_pending.values()),
        )
        yield _g(
            "mooncake_master_suspect_holders",
            "holders placement avoids until they are heard from again",
            len(st.suspects),
        )
        yield _g("mooncake_master_reservations", "extents lent to clients", len(st.reservations))
        yield _g(
            "mooncake_master_early_commits", "puts committed early, unconfirmed", len(st.early)
        )
        used_f = GaugeMetricFamily(
            "mooncake_master_segment_used_bytes",
            "allocated bytes per segment",
            labels=["segment", "client"],
        )
        cap_f = GaugeMetricFamily(
            "mooncake_master_segment_capacity_bytes", "size per segment", labels=["segment"]
        )
        keys_f = GaugeMetricFamily(
            "mooncake_master_segment_keys", "replicas (keys) held per segment", labels=["segment"]
        )
        for s in st.segments.values():
            used_f.add_metric([s.name, s.client_id], s.allocator.used)
            cap_f.add_metric([s.name], s.size)
            keys_f.add_metric([s.name], len(s.keys))
        yield used_f
        yield cap_f
        yield keys_f


def _counter_family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


_TIER_COUNTERS = (  # hot keys and tier moves (store/hotkeys.py, store/tiering.py)
    (
        "mooncake_master_hot_replicas_added",
        "extra replicas given to hot keys",
        "hot_replicas_added",
    ),
    (
        "mooncake_master_hot_replicas_dropped",
        "extra replicas freed, key cooled",
        "hot_replicas_dropped",
    ),
    ("mooncake_master_hot_copies_failed", "hot-key copies failed or lost", "hot_copies_failed"),
    (
        "mooncake_master_ssd_offload_dropped",
        "evictions dropped: offload queue full",
        "offload_dropped",
    ),
    (
        "mooncake_master_ssd_promotions_admitted",
        "SSD promotions kept in memory",
        "promotions_admitted",
    ),
    (
        "mooncake_master_ssd_promotions_transient",
        "promoted copies freed again",
        "promotions_transient",
    ),
)
_TIER_GAUGES = (
    ("mooncake_master_hot_keys", "keys counted as hot", "hot_keys"),
    ("mooncake_master_hot_bytes", "bytes of extra hot-key replicas", "hot_bytes"),
)


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def render(m: Metrics, *_compat: Any) -> str:
    """Prometheus text for ``/metrics`` (the extra arguments of the old signature are
    ignored: the metrics read their master)."""
    return render_registry(m.registry).decode()
