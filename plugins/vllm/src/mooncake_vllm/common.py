"""Helpers shared by the vLLM connectors: option parsing, config mapping, counters.

Nothing here imports vLLM; the connectors hand in plain dicts.

Options (``kv_connector_extra_config`` keys; env vars in brackets win over nothing
but lose to the JSON):

- ``send_timeout_s`` [``MOONCAKE_VLLM_SEND_TIMEOUT_S``], 120: how long a prefill
  instance keeps a finished request's blocks for a decode instance that never fetches.
- ``transfer_timeout_s``, 30: deadline of one KV fetch.
- ``stats_dir`` [``MOONCAKE_VLLM_STATS_DIR``]: write counters as JSON files there.
- ``mooncake``: dict of :class:`~mooncake_core.config.MooncakeConfig` overrides
  (e.g. ``{"protocol": "tcp"}``), applied over the project's file/env config.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from mooncake_core.config import MooncakeConfig, env_str, load_config

__all__ = ["Counters", "config_from_engine", "option", "tenant_of_config"]

logger = logging.getLogger(__name__)


_ENV = {
    "send_timeout_s": "MOONCAKE_VLLM_SEND_TIMEOUT_S",
    "stats_dir": "MOONCAKE_VLLM_STATS_DIR",
}


def option(extra: dict[str, Any] | None, key: str, default: Any) -> Any:
    """Read one connector option: extra_config, then env var, then ``default``."""
    if extra and key in extra:
        return extra[key]
    env = _ENV.get(key)
    raw = env_str(env) if env else ""
    if raw:
        return type(default)(raw) if default is not None and not isinstance(default, str) else raw
    return default


def config_from_engine(extra: dict[str, Any] | None) -> MooncakeConfig:
    """The one place that maps vLLM connector settings to our config."""
    cfg = load_config()
    overrides = (extra or {}).get("mooncake") or {}
    if not isinstance(overrides, dict):
        raise TypeError(f"kv_connector_extra_config.mooncake must be an object, got {overrides!r}")
    return cfg.replace(**overrides) if overrides else cfg


class Counters:
    """Thread-safe counters, mirrored to ``<stats_dir>/<name>.json`` when configured.

    The file is rewritten atomically after each :meth:`add`; tests and benchmarks read
    it to prove what the connector really did.
    """

    def __init__(self, name: str, stats_dir: str | None) -> None:
        self.name = name
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        self._path = Path(stats_dir) / f"{name}.json" if stats_dir else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._flush()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] = self._values.get(k, 0) + v
        self._flush()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def _flush(self) -> None:
        if self._path is None:
            return
        data = {"name": self.name, "pid": os.getpid(), "time": time.time(), **self.snapshot()}
        tmp = self._path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self._path)
        except OSError as exc:  # counters must never break serving
            logger.debug("writing %s failed: %s", self._path, exc)


def tenant_of_config(extra: dict[str, Any]) -> str:
    """The ``tenant`` option, checked (a bad name stops the engine with one clear line)."""
    from mooncake_core.store.tenants import check_tenant

    return check_tenant(str(option(extra, "tenant", "") or ""), "kv_connector_extra_config.tenant")
