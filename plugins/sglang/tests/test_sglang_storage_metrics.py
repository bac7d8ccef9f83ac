"""``MooncakeCoreStorage.get_stats()`` reports what was moved, in SGLang's own terms.

Real parts: a master and memory node (``StoreCluster``), SGLang's host pool, storage
config, backend factory (``dynamic``), ``HiCacheController``'s own backup/prefetch
methods, SGLang's ``StorageMetrics`` and ``StorageMetricsCollector`` (the class its radix
cache feeds ``get_stats()`` into for ``/metrics``), on a private Prometheus registry.
One stand-in: the backend module's clock, so every operation lasts exactly 0.25 s and the
reported bandwidth is an exact function of the bytes moved.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup.sh)"
)

import torch  # noqa: E402
from mooncake_conformance import KVLayout  # noqa: E402
from mooncake_conformance.store import StoreCluster  # noqa: E402
from mooncake_sglang import hicache  # noqa: E402
from mooncake_sglang.keys import page_hashes  # noqa: E402
from mooncake_sglang.testing.harness import build_host_pool  # noqa: E402

LAYOUT = KVLayout(
    "page_first", num_layers=4, page_size=16, num_kv_heads=4, head_dim=32, num_slots=24
)
P = LAYOUT.page_size
OP_S = 0.25  # each backend operation, on the stepping clock


class _Op:
    """What HiCacheController's storage methods read of a storage operation."""

    def __init__(self, hashes: list[str], host_indices: torch.Tensor) -> None:
        self.hash_value = hashes
        self.host_indices = host_indices
        self.prefix_keys: list[str] | None = None
        self.completed_tokens = 0
        self.request_id = "storage-metrics"


def _indices(slots: range) -> torch.Tensor:
    return torch.cat([torch.arange(s * P, s * P + P, dtype=torch.int64) for s in slots])


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        yield c


def _rank(cluster: StoreCluster, metrics: bool, namespace: str) -> tuple[Any, Any, Any]:
    """(pool, backend, controller) built as SGLang builds them."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = build_host_pool(LAYOUT)
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name="storage-metrics/model",
        extra_config={
            "backend_name": "mooncake_core",
            "module_path": "mooncake_sglang.hicache",
            "class_name": "MooncakeCoreStorage",
            "interface_v1": 1,
            "master_server_address": cluster.master_address,
            "global_segment_size": 0,
            "key_namespace": namespace,
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    ctrl: Any = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend = backend
    ctrl.storage_host_pool = pool
    ctrl.mem_pool_host = pool
    ctrl.page_size = P
    ctrl.page_get_func = ctrl._page_get_zero_copy
    ctrl.page_set_func = ctrl._page_set_zero_copy
    return pool, backend, ctrl


def _page(pool: Any, slot: int) -> bytes:
    flat = pool.get_data_page(slot * P, flat=True).contiguous()
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def test_get_stats_reports_pages_and_bandwidth_of_real_operations(
    cluster: StoreCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from sglang.srt.observability.metrics_collector import (
        StorageMetrics,
        StorageMetricsCollector,
    )

    pool, backend, ctrl = _rank(cluster, True, "stats-on")
    try:
        g = torch.Generator().manual_seed(19)
        for slot in range(6):
            n = pool.get_dummy_flat_data_page().numel()
            pool.set_from_flat_data_page(slot * P, torch.randn(n, generator=g).to(pool.dtype))
        page_bytes = backend._view.page_nbytes
        hashes = page_hashes(list(range(6 * P)), P)
        steps = itertools.count()
        monkeypatch.setattr(
            hicache, "time", SimpleNamespace(perf_counter=lambda: next(steps) * OP_S)
        )

        assert backend.get_stats() == StorageMetrics()  # nothing done yet

        op = _Op(hashes[:4], _indices(range(4)))
        type(ctrl)._page_backup(ctrl, op)  # 4 new pages
        assert op.completed_tokens == 4 * P
        op = _Op(hashes, _indices(range(6)))
        type(ctrl)._page_backup(ctrl, op)  # 6 pages, 4 already stored: 2 written
        assert op.completed_tokens == 6 * P
        assert backend.batch_exists(hashes) == 6
        got = ctrl.page_get_func(
            _Op(hashes, _indices(range(8, 14))), hashes, _indices(range(8, 14))
        )
        assert got == 6  # 6 hits, read into slots 8..13
        assert [_page(pool, 8 + i) for i in range(6)] == [_page(pool, i) for i in range(6)]
        unknown = page_hashes([7] * (3 * P), P)
        assert (
            ctrl.page_get_func(
                _Op(unknown, _indices(range(14, 17))), unknown, _indices(range(14, 17))
            )
            == 0
        )

        stats = backend.get_stats()
        assert type(stats) is StorageMetrics
        assert stats.backup_pgs == [4, 2]  # the already stored pages are not written again
        assert stats.prefetch_pgs == [6]  # the all-miss batch moved nothing: not recorded
        gbps = [n * page_bytes / OP_S / 1e9 for n in (4, 2)]
        assert stats.backup_bandwidth == pytest.approx(gbps, rel=1e-12)
        assert stats.prefetch_bandwidth == pytest.approx([6 * page_bytes / OP_S / 1e9], rel=1e-12)
        assert backend.get_stats() == StorageMetrics()  # since the last call

        # SGLang's consumer: its radix cache hands get_stats() to this collector.
        registry = CollectorRegistry()

        class Collector(StorageMetricsCollector):  # type: ignore[misc]
            _counter_cls = functools.partial(Counter, registry=registry)
            _gauge_cls = functools.partial(Gauge, registry=registry)
            _histogram_cls = functools.partial(Histogram, registry=registry)

        labels = {"model_name": "storage-metrics/model"}
        Collector(labels).log_storage_metrics(stats)

        def sample(name: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert sample("sglang:backup_pgs_count") == 2
        assert sample("sglang:backup_pgs_sum") == 6
        assert sample("sglang:prefetch_pgs_count") == 1
        assert sample("sglang:prefetch_pgs_sum") == 6
        assert sample("sglang:backup_bandwidth_sum") == pytest.approx(sum(gbps), rel=1e-12)
        assert sample("sglang:prefetch_bandwidth_sum") == pytest.approx(
            6 * page_bytes / OP_S / 1e9, rel=1e-12
        )
    finally:
        backend.close()


def test_no_stats_are_kept_when_sglang_storage_metrics_are_off(cluster: StoreCluster) -> None:
    """SGLang never drains get_stats() then; per-batch figures must not pile up."""
    pool, backend, ctrl = _rank(cluster, False, "stats-off")
    try:
        hashes = page_hashes(list(range(2 * P)), P)
        op = _Op(hashes, _indices(range(2)))
        type(ctrl)._page_backup(ctrl, op)
        assert op.completed_tokens == 2 * P
        assert ctrl.page_get_func(op, hashes, _indices(range(4, 6))) == 2
        assert all(not v for v in backend._metrics.values())
        assert backend.get_stats().backup_pgs == []
    finally:
        backend.close()
