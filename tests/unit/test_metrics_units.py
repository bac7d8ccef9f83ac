"""The metrics layer: exposition on loopback, parsing, transfer paths, master hit/miss and
leases, the top command's quantiles, and the Grafana dashboard naming only exported metrics."""

from __future__ import annotations

import ast
import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from mooncake_core.cli.top import quantile
from mooncake_core.metrics import new_registry, parse, render, serve
from mooncake_core.metrics.transfer import TransferMetrics
from mooncake_core.store.master import MasterServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "mooncake.json"
VLLM_STATS = ROOT / "plugins" / "vllm" / "src" / "mooncake_vllm" / "stats.py"


def test_serve_binds_loopback_and_exposes_the_registry() -> None:
    reg = new_registry()
    Counter("demo_things", "things", registry=reg).inc(3)
    srv = serve(reg)
    try:
        assert srv.host == "127.0.0.1" and srv.port > 0
        with urllib.request.urlopen(srv.url, timeout=5) as r:
            samples = parse(r.read().decode())
    finally:
        srv.close()
    assert any(s.sample == "demo_things_total" and s.value == 3 for s in samples)
    assert any(s.sample == "process_resident_memory_bytes" and s.value > 0 for s in samples)


def test_parse_refuses_malformed_text() -> None:
    with pytest.raises(ValueError):
        parse("this is { not prometheus\n")


def test_transfer_paths_count_bytes_slices_errors_and_requests() -> None:
    reg = CollectorRegistry()
    tm = TransferMetrics(reg)
    p = tm.path("peer-1", "tcp")
    assert tm.path("peer-1", "tcp") is p  # cached: no label lookup per transfer
    items = [
        SimpleNamespace(req=0, op=0, length=100, done=True),
        SimpleNamespace(req=0, op=0, length=50, done=True),
        SimpleNamespace(req=1, op=1, length=70, done=True),
        SimpleNamespace(req=1, op=1, length=30, done=False),
    ]
    p.record(items, 0.002)
    p.retry(2)
    p.failover()
    s = parse(render(reg).decode())

    def v(name: str, **labels: str) -> float:
        return sum(
            x.value
            for x in s
            if x.sample == name and all(x.labels.get(k) == w for k, w in labels.items())
        )

    assert v("mooncake_transfer_bytes_total", op="read", peer="peer-1") == 150
    assert v("mooncake_transfer_bytes_total", op="write", transport="tcp") == 70
    assert v("mooncake_transfer_slices_total") == 4
    assert v("mooncake_transfer_requests_total") == 2
    assert v("mooncake_transfer_slice_errors_total") == 1
    assert v("mooncake_transfer_retries_total") == 2
    assert v("mooncake_transfer_failovers_total") == 1
    assert v("mooncake_transfer_seconds_count") == 1
    assert v("mooncake_transfer_seconds_bucket", le="0.0025") == 1


def _master() -> MasterServer:
    return MasterServer(rpc_port=0, http_port=-1)  # not started: its state and metrics only


def _values(m: MasterServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in parse(render(m.metrics.registry).decode()):
        key = s.sample + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
        out[key] = s.value
    return out


def test_master_counts_hits_misses_ssd_hits_and_leases() -> None:
    m = _master()
    met = m.metrics
    args = SimpleNamespace(key="k1")
    met.observe("get_replica_list", 1e-4, True, args, (4096, [[("seg", 0, 4096)]], 5.0, 1))
    met.observe("get_replica_list", 1e-4, True, SimpleNamespace(key="k2"), (100, [], 5.0, 2))
    met.observe("get_replica_list", 1e-4, False, SimpleNamespace(key="nope"), None)
    batch = SimpleNamespace(keys=["k1", "x", "k3"])
    res = [(0, 10, [[1]], 5.0, 1), (3, "no object", [], 0.0, 0), (0, 20, [[1]], 5.0, 2)]
    met.observe("batch_get_replica_list", 1e-4, True, batch, res)
    met.observe("exists", 1e-4, True, SimpleNamespace(key="k4"), True)
    met.observe("ping", 1e-4, True)
    v = _values(m)
    assert v["total_get_nums_"] == 6 and v["valid_get_nums_"] == 4
    assert v["mem_cache_hit_nums_"] == 3 and v["file_cache_hit_nums_"] == 1
    assert v["mem_cache_hit_bytes_total"] == 4096 + 10 + 20
    assert v["file_cache_hit_bytes_total"] == 100
    assert v['mooncake_master_gets_total{"result": "miss"}'] == 2
    assert v["master_get_replica_list_requests_total"] == 3
    assert v["master_get_replica_list_failures_total"] == 1
    assert v["master_ping_requests_total"] == 1
    assert v['mooncake_master_requests_total{"method": "get_replica_list"}'] == 3
    assert v['mooncake_master_request_errors_total{"method": "get_replica_list"}'] == 1
    assert v["mooncake_master_lease_grants_total"] == 5
    assert met.leased_now() == 4  # k1 (leased twice, counted once), k2, k3, k4
    assert v['mooncake_master_role{"role": "starting"}'] == 1
    assert v["mooncake_master_is_leader"] == 0


def test_master_scrape_does_not_walk_objects() -> None:
    """A scrape reads counts the state keeps; it never iterates the objects."""
    m = _master()

    class NoIter(dict):  # type: ignore[type-arg]
        def values(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the scrape walked the objects")

        def items(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the scrape walked the objects")

        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the scrape walked the objects")

    objs = NoIter()
    dict.update(objs, {f"k{i}": object() for i in range(1000)})
    m.state.objects = objs
    assert _values(m)["master_key_count"] == 1000


def test_bad_frames_counter_keeps_the_old_increment_idiom() -> None:
    m = _master()
    m.metrics.bad_frames += 1
    m.metrics.bad_frames += 1
    assert _values(m)["mooncake_master_bad_frames_total"] == 2


def test_quantile_interpolates_like_prometheus() -> None:
    reg = CollectorRegistry()
    h = Histogram("lat_seconds", "x", buckets=(0.1, 0.2, 0.4), registry=reg)
    for x in (0.05, 0.15, 0.15, 0.3):
        h.observe(x)
    s = parse(render(reg).decode())
    assert quantile(s, "lat_seconds", 0.5) == pytest.approx(0.15)  # rank 2: middle of (0.1,0.2]
    assert quantile(s, "lat_seconds", 1.0) == pytest.approx(0.4)
    assert quantile(parse(""), "lat_seconds", 0.5) != quantile(parse(""), "lat_seconds", 0.5)


# ---------------------------------------------------------------------- the dashboard
_METRIC = re.compile(
    r"\b(?:vllm:mooncake_|mooncake_|master_|ha_|mem_cache_|file_cache_|valid_get|total_get|"
    r"process_)[A-Za-z0-9_:]*"
)


def _exported(text: str) -> set[str]:
    """Sample names a registry's exposition can carry (also for families without samples)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(fam.type, ("",))
        names |= {fam.name + sfx for sfx in suffixes}
        names |= {s.name for s in fam.samples}
    return names


def _vllm_counters() -> list[str]:
    """PROM_COUNTERS of the vLLM adapter's stats module, read from its source (importing it
    imports vLLM, which takes a minute here)."""
    tree = ast.parse(VLLM_STATS.read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "PROM_COUNTERS"
            and isinstance(node.value, ast.Dict)
        ):
            return [str(ast.literal_eval(k)) for k in node.value.keys if k is not None]
    raise AssertionError(f"no PROM_COUNTERS in {VLLM_STATS}")


def _all_exported() -> set[str]:
    import mooncake_core.metrics.transfer  # noqa: F401  (registers the transfer families)
    from mooncake_core.proxy.metrics import ProxyMetrics

    m = _master()
    names = _exported(render(m.metrics.registry).decode())
    names |= _exported(render().decode())  # the default registry: transfer + process
    names |= _exported(render(ProxyMetrics("p", []).registry).decode())
    names |= {f"vllm:mooncake_{k}_total" for k in _vllm_counters()}
    return names


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _all_exported()
    seen = 0
    for p in dash["panels"]:
        for t in p.get("targets", []):
            names = set(_METRIC.findall(t["expr"]))
            assert names, f"panel {p['title']!r}: query {t['expr']!r} names no known metric"
            missing = names - exported
            assert not missing, f"panel {p['title']!r} queries {sorted(missing)}, not exported"
            seen += 1
    for var in dash["templating"]["list"]:
        assert set(_METRIC.findall(var["query"])) <= exported
    assert seen >= 40
    titles = {p["title"] for p in dash["panels"]}
    for want in ("Hit rate", "TTFT", "Throughput by peer and transport", "Fallbacks to recompute"):
        assert want in titles


def test_master_exports_the_published_names_dashboards_query() -> None:
    """Names the published mooncake_master 0.3.13 exports (curled from it) that ours share."""
    names = _exported(render(_master().metrics.registry).decode())
    published = {
        "master_key_count",
        "master_allocated_bytes",
        "master_total_capacity_bytes",
        "master_active_clients",
        "master_put_start_requests_total",
        "master_put_start_failures_total",
        "master_get_replica_list_requests_total",
        "master_batch_get_replica_list_requests_total",
        "master_exist_key_requests_total",
        "master_remove_requests_total",
        "master_mount_segment_requests_total",
        "master_ping_requests_total",
        "master_put_end_requests_total",
        "master_put_revoke_requests_total",
        "master_batch_put_start_requests_total",
        "master_batch_put_end_requests_total",
        "master_batch_exist_key_requests_total",
        "master_remove_by_regex_requests_total",
        "master_remove_all_requests_total",
        "master_unmount_segment_requests_total",
        "master_create_copy_task_requests_total",
        "master_create_move_task_requests_total",
        "master_query_task_requests_total",
        "master_batch_get_replica_list_items_total",
        "master_batch_get_replica_list_failed_items_total",
        "master_batch_get_replica_list_partial_successes_total",
        "master_batch_exist_key_items_total",
        "master_batch_put_start_items_total",
        "master_batch_put_end_failed_items_total",
        "mem_cache_hit_nums_",
        "file_cache_hit_nums_",
        "mem_cache_hit_bytes_total",
        "file_cache_hit_bytes_total",
        "file_cache_nums_",
        "valid_get_nums_",
        "total_get_nums_",
        "master_evicted_key_count",
        "master_evicted_size_bytes",
        "ha_oplog_last_sequence_id",
        "ha_oplog_applied_sequence_id",
    }
    assert published <= names, sorted(published - names)


#: published mooncake_master names we do not export, each for a reason (no such part, or a
#: different meaning); every other published name must be exported (see the next test)
NOT_OURS = {
    # HA: the published standby replays an oplog through states of its own; ours applies the
    # etcd-replicated log (role: mooncake_master_role, sequence: ha_oplog_*_sequence_id)
    "ha_oplog_pending_entries": "no out-of-order applier queue",
    "ha_oplog_standby_lag": "no standby lag figure kept",
    "ha_pending_mutation_queue_size": "no etcd write-retry queue",
    "ha_standby_state": "different state machine (mooncake_master_role)",
    "master_allocated_file_size_bytes": "no 3FS/NFS file storage",
    "master_total_file_capacity_bytes": "no 3FS/NFS file storage",
    "master_nof_allocated_bytes": "no NVMe-oF tier",
    "master_total_nof_capacity_bytes": "no NVMe-oF tier",
    "master_soft_pin_key_count": "no soft pins",
    "mem_cache_nums_": "objects with a memory replica are not counted in O(1)",
    "master_attempted_evictions_total": "eviction runs are not counted (evicted keys are)",
    "master_successful_evictions_total": "eviction runs are not counted (evicted keys are)",
    "master_put_start_alloc_failures_total": "put_start failures are not split by cause",
    "master_put_start_partial_allocations_total": "no best-effort replica degradation",
    "master_put_start_discard_cnt": "unfinished puts: mooncake_master_reclaimed_puts_total",
    "master_put_start_release_cnt": "unfinished puts: mooncake_master_reclaimed_puts_total",
    "master_put_start_discarded_staging_size": "no staging of discarded puts",
    "master_get_replica_list_by_regex_requests_total": "keys_by_regex returns keys only",
    "master_get_replica_list_by_regex_failures_total": "keys_by_regex returns keys only",
    "master_remount_segment_requests_total": "no remount call",
    "master_remount_segment_failures_total": "no remount call",
    "master_evict_disk_replica_requests_total": "no such call",
    "master_evict_disk_replica_failures_total": "no such call",
    "master_fetch_tasks_requests_total": "tasks reach clients through poll",
    "master_fetch_tasks_failures_total": "tasks reach clients through poll",
    "master_update_task_requests_total": "tasks are reported through task_done",
    "master_update_task_failures_total": "tasks are reported through task_done",
}
NOT_OURS_PREFIXES = {
    "master_promotion_": "the published promotion queue (ours: mooncake_master_ssd_promotions_*)",
    "master_batch_put_revoke_": "revokes go in batch_put_end's per-key ok flags",
    "master_batch_query_ip_": "no such call",
    "master_batch_replica_clear_": "no such call",
    "master_copy_": "copies are master-driven tasks, not client copy_start/end/revoke",
    "master_move_": "moves are master-driven tasks, not client move_start/end/revoke",
}


def test_every_published_master_name_is_exported_or_explained() -> None:
    """The published master's whole list (scraped from the wheel, in
    published_master_metrics.txt): each name is exported by ours, or not ours for a reason."""
    lines = (Path(__file__).with_name("published_master_metrics.txt")).read_text().splitlines()
    published = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    assert len(published) > 100
    ours = _exported(render(_master().metrics.registry).decode())
    unexplained = {
        n
        for n in published - ours
        if n not in NOT_OURS and not any(n.startswith(p) for p in NOT_OURS_PREFIXES)
    }
    assert not unexplained, sorted(unexplained)
    # and nothing is explained away that we do export
    assert not (set(NOT_OURS) & ours), sorted(set(NOT_OURS) & ours)
    shared = published & ours
    assert len(shared) >= 60, len(shared)


def test_published_put_batch_and_task_counters_follow_our_calls() -> None:
    """A put into a lent extent (put_commit) is one published put_start and put_end; batch
    calls count their keys, failed keys and partial successes; replica tasks by kind."""
    m = _master()
    met = m.metrics
    met.observe("put_start", 1e-4, True, SimpleNamespace(key="a"), (1, []))
    met.observe("put_commit", 1e-4, True, SimpleNamespace(key="b"), (5.0, 2))
    met.observe("put_commit", 1e-4, False, SimpleNamespace(key="c"), None)
    keys = SimpleNamespace(keys=["x", "y", "z"])
    met.observe(
        "batch_put_commit", 1e-4, True, keys, [(0, 5.0, 1), (7, "no space", 0), (0, 5.0, 2)]
    )
    met.observe("batch_put_end", 1e-4, True, keys, [(0, ""), (0, ""), (0, "")])
    met.observe("batch_exists", 1e-4, True, keys, [True, False, True])
    met.observe("batch_get_replica_list", 1e-4, False, keys, None)
    met.observe("create_replica_task", 1e-4, True, SimpleNamespace(kind="copy"), "t1")
    met.observe("create_replica_task", 1e-4, False, SimpleNamespace(kind="move"), None)
    met.observe("query_replica_task", 1e-4, True, SimpleNamespace(task_id="t1"), None)
    v = _values(m)
    assert v["master_put_start_requests_total"] == 3  # put_start + two put_commits
    assert v["master_put_start_failures_total"] == 1
    assert v["master_put_end_requests_total"] == 2 and v["master_put_end_failures_total"] == 1
    assert v["master_batch_put_start_requests_total"] == 1
    assert v["master_batch_put_end_requests_total"] == 2
    assert v["master_batch_put_start_items_total"] == 3
    assert v["master_batch_put_start_failed_items_total"] == 1
    assert v["master_batch_put_start_partial_successes_total"] == 1
    assert v["master_batch_put_end_items_total"] == 6
    assert v["master_batch_put_end_failed_items_total"] == 1
    assert v["master_batch_put_end_partial_successes_total"] == 1
    assert v["master_batch_exist_key_items_total"] == 3
    assert v["master_batch_exist_key_failed_items_total"] == 0
    assert v["master_batch_get_replica_list_items_total"] == 3
    assert v["master_batch_get_replica_list_failed_items_total"] == 3
    assert v["master_batch_get_replica_list_partial_successes_total"] == 0
    assert v["master_create_copy_task_requests_total"] == 1
    assert v["master_create_copy_task_failures_total"] == 0
    assert v["master_create_move_task_requests_total"] == 1
    assert v["master_create_move_task_failures_total"] == 1
    assert v["master_query_task_requests_total"] == 1
    # our own per-method counters stay per method
    assert v['mooncake_master_requests_total{"method": "put_commit"}'] == 2


def test_leases_expire_from_the_gauge() -> None:
    from mooncake_core.config import StoreConfig

    m = MasterServer(StoreConfig(lease_ttl_s=0.0), rpc_port=0, http_port=-1)
    for i in range(1000):
        m.metrics.observe("exists", 1e-5, True, SimpleNamespace(key=f"k{i}"), True)
    assert _values(m)["mooncake_master_leased_objects"] == 0
    assert _values(m)["mooncake_master_lease_grants_total"] == 1000


def test_lease_table_stays_bounded_without_scrapes() -> None:
    """Grants of unique keys must not pile up between scrapes (a master nobody scrapes)."""
    from mooncake_core.config import StoreConfig

    m = MasterServer(StoreConfig(lease_ttl_s=0.0), rpc_port=0, http_port=-1)
    for i in range(5000):
        m.metrics.observe("exists", 1e-5, True, SimpleNamespace(key=f"u{i}"), True)
    assert len(m.metrics.leases) <= 2
