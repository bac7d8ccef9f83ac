"""The connector-stats bridge: interval deltas, aggregation across workers, vLLM counters."""

from __future__ import annotations

from typing import Any

from mooncake_vllm.common import Counters
from mooncake_vllm.stats import (
    PROM_COUNTERS,
    ConnectorStatsMixin,
    MooncakeKVStats,
    MooncakePromMetrics,
    lookup_outcome,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


def test_lookup_outcomes() -> None:
    assert lookup_outcome(0, 5) == {"lookup_misses": 1}
    assert lookup_outcome(2, 5) == {"lookup_partial_hits": 1}
    assert lookup_outcome(5, 5) == {"lookup_full_hits": 1}
    assert lookup_outcome(0, 0) == {}


class _Part:
    def __init__(self) -> None:
        self.counters = Counters("t", None)


class _Conn(ConnectorStatsMixin):
    def __init__(self) -> None:
        self.sched = _Part()
        self.worker = None


def test_stats_report_increases_since_the_last_call() -> None:
    c = _Conn()
    assert c.get_kv_connector_stats() is None
    c.sched.counters.add(lookup_requests=2, lookup_full_hits=1, lookup_misses=1)
    s = c.get_kv_connector_stats()
    assert s is not None and s.data == {
        "lookup_requests": 2,
        "lookup_full_hits": 1,
        "lookup_misses": 1,
    }
    assert c.get_kv_connector_stats() is None  # nothing new
    c.sched.counters.add(lookup_requests=1, lookup_partial_hits=1)
    s2 = c.get_kv_connector_stats()
    assert s2 is not None and s2.data == {"lookup_requests": 1, "lookup_partial_hits": 1}


def test_aggregate_and_reduce() -> None:
    a = MooncakeKVStats(data={"load_bytes": 100, "lookup_requests": 4, "lookup_full_hits": 1})
    b = _Conn.build_kv_connector_stats({"load_bytes": 50, "lookup_partial_hits": 1})
    assert b is not None
    agg = a.aggregate(b)
    assert agg.data["load_bytes"] == 150
    red = agg.reduce()
    assert red["lookup_hit_rate"] == 0.5 and red["load_bytes"] == 150
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty()


def test_prom_metrics_count_per_engine() -> None:
    reg = CollectorRegistry()

    def bound(cls: Any) -> Any:
        class B(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, registry=reg, **kw)

        return B

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}

    class Cfg:
        kv_transfer_config = None

    prom = MooncakePromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"load_bytes": 4096, "lookup_misses": 2, "unknown_key": 9}, 0)
    text = generate_latest(reg).decode()
    assert 'vllm:mooncake_load_bytes_total{engine="0",model_name="m"} 4096.0' in text
    assert 'vllm:mooncake_lookup_misses_total{engine="0",model_name="m"} 2.0' in text
    typed = [ln for ln in text.splitlines() if ln.startswith("# TYPE vllm:mooncake_")]
    assert sum(ln.endswith(" counter") for ln in typed) == len(PROM_COUNTERS)


def test_both_connectors_under_multiconnector_share_their_counters() -> None:
    """vLLM's MultiConnector builds the metrics of every connector class it holds (our PD and
    store connectors both): the same names must not be registered twice (vLLM would stop at
    start with DuplicateTimeseries), and both connectors' counts must land."""
    reg = CollectorRegistry()

    class BoundCounter(Counter):  # type: ignore[misc]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, registry=reg, **kw)

    types = {Counter: BoundCounter, Gauge: Gauge, Histogram: Histogram}

    class Cfg:
        kv_transfer_config = None

    pd = MooncakePromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    store = MooncakePromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    pd.observe({"load_bytes": 100}, 0)
    store.observe({"load_bytes": 28}, 0)
    text = generate_latest(reg).decode()
    assert 'vllm:mooncake_load_bytes_total{engine="0",model_name="m"} 128.0' in text
