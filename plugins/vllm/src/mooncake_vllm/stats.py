"""The connectors' counters through vLLM's own connector-stats interface.

vLLM (0.32) asks a connector, on the scheduler and on every worker, for
``get_kv_connector_stats()`` after each step; it aggregates what the workers return with
the scheduler's, logs the reduced figures every logging interval ("KV Transfer metrics:
...") and feeds them to the connector's ``build_prom_metrics`` object, whose counters then
appear on vLLM's ``/metrics`` with vLLM's ``model_name``/``engine`` labels.

:class:`ConnectorStatsMixin` gives a connector those three hooks from the
:class:`~mooncake_vllm.common.Counters` its scheduler/worker parts already keep: each call
reports the increase since the previous call (:class:`MooncakeKVStats`). The Prometheus
names are ``vllm:mooncake_<counter>_total`` for the counters in :data:`PROM_COUNTERS`
(lookups: full hits, partial hits, misses; loads and saves: requests, pages, bytes,
seconds, failures; fallbacks to recompute: failed lookups and loads; PD receives).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = [
    "ConnectorStatsMixin",
    "MooncakeKVStats",
    "MooncakePromMetrics",
    "PROM_COUNTERS",
    "lookup_outcome",
]

#: counter -> help text; each becomes ``vllm:mooncake_<counter>_total`` on vLLM's /metrics.
PROM_COUNTERS: dict[str, str] = {
    "lookup_requests": "prompt lookups in the KV store",
    "lookup_pages": "pages asked for in those lookups",
    "lookup_full_hits": "lookups that found every page asked for",
    "lookup_partial_hits": "lookups that found some leading pages, not all",
    "lookup_misses": "lookups that found nothing",
    "lookup_failures": "lookups that failed (the store was unreachable): prompts recomputed",
    "lookup_seconds": "seconds the scheduler spent asking the store",
    "hit_requests": "requests that loaded KV pages from the store",
    "hit_pages": "pages loaded from the store for those requests",
    "load_requests": "store loads started (worker)",
    "load_pages": "pages loaded (worker)",
    "load_bytes": "bytes loaded from the store",
    "load_seconds": "seconds spent loading from the store",
    "load_wait_seconds": "seconds the forward pass waited for loads",
    "load_failures": "loads that failed: vLLM's kv_load_failure_policy recomputes them",
    "save_objects": "pages saved to the store",
    "save_bytes": "bytes saved to the store",
    "save_seconds": "seconds spent saving to the store",
    "save_failures": "saves that failed",
    "save_skipped": "pages not saved because the store failed recently",
    "send_requests": "PD: requests whose KV this prefill instance sends",
    "recv_requests": "PD: requests whose KV this decode instance received",
    "recv_bytes": "PD: bytes received",
    "recv_seconds": "PD: seconds spent receiving",
    "recv_failures": "PD: receives that failed: prompts recomputed",
}


def lookup_outcome(hit_pages: int, asked_pages: int) -> dict[str, int]:
    """The hit/partial/miss counter increment of one lookup."""
    if asked_pages <= 0:
        return {}
    if hit_pages <= 0:
        return {"lookup_misses": 1}
    if hit_pages >= asked_pages:
        return {"lookup_full_hits": 1}
    return {"lookup_partial_hits": 1}


@dataclass
class MooncakeKVStats(KVConnectorStats):
    """Counter increases over an interval (``data``: counter name -> increase)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items())
        }
        asked = self.data.get("lookup_requests", 0)
        if asked:
            hits = self.data.get("lookup_full_hits", 0) + self.data.get("lookup_partial_hits", 0)
            out["lookup_hit_rate"] = round(hits / asked, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


_prom_lock = threading.Lock()
_prom_counters: dict[tuple[Any, str, tuple[str, ...]], Any] = {}


def _shared_counter(cls: Any, name: str, doc: str, labelnames: list[str]) -> Any:
    """One counter per name in the process. Both our connectors (PD and store) under vLLM's
    MultiConnector build their metrics; registering the same name twice would stop vLLM at
    start with DuplicateTimeseries, so the second one adds to the first one's counter."""
    key = (cls, name, tuple(labelnames))
    with _prom_lock:
        c = _prom_counters.get(key)
        if c is None:
            c = _prom_counters[key] = cls(name=name, documentation=doc, labelnames=labelnames)
        return c


class MooncakePromMetrics(KVConnectorPromMetrics):
    """One vLLM counter per entry of :data:`PROM_COUNTERS`, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, doc in PROM_COUNTERS.items():
            c = _shared_counter(self._counter_cls, f"vllm:mooncake_{key}", doc, labelnames)
            self.counters[key] = {
                idx: c.labels(*vals) for idx, vals in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self.counters.get(key)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


_last: weakref.WeakKeyDictionary[Any, dict[str, float]] = weakref.WeakKeyDictionary()
_last_lock = threading.Lock()


def interval(counters: Any) -> dict[str, float]:
    """Increase of ``counters`` (a ``Counters``) since the previous call for it."""
    now = counters.snapshot()
    with _last_lock:
        before = _last.get(counters, {})
        _last[counters] = now
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


class ConnectorStatsMixin:
    """vLLM's connector-stats hooks for a connector whose parts (``sched``/``scheduler``,
    ``worker``) keep ``counters``. List it before ``KVConnectorBase_V1``."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, float] = {}
        for part in ("sched", "scheduler", "worker"):
            counters = getattr(getattr(self, part, None), "counters", None)
            if counters is not None:
                for k, v in interval(counters).items():
                    data[k] = data.get(k, 0) + v
        return MooncakeKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return MooncakeKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return MooncakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
