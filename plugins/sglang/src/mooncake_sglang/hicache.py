"""SGLang HiCache L3 backend on mooncake-core's store: :class:`MooncakeCoreStorage`.

Select it with SGLang's ``dynamic`` backend (one line; see docs/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"mooncake_core",
      "module_path":"mooncake_sglang.hicache","class_name":"MooncakeCoreStorage",
      "interface_v1":1,"master_server_address":"127.0.0.1:50051"}'

Contract (SGLang's ``HiCacheStorage``; every method is *Called by* HiCache's storage
threads (prefetch, backup), never the scheduler thread; *Blocking*; *Thread-safe*):

- construction ``(storage_config, kwargs)``: connect a store client (our own keys in
  ``extra_config``, below); then ``register_mem_pool_host(pool)``: learn the layout,
  register the pool's K/V (or MLA latent) buffers for zero-copy transfers.
- ``batch_exists(keys) -> int``: leading pages whose every object is present.
- ``batch_set_v1(keys, host_indices) -> list[bool]`` / ``batch_get_v1``: zero-copy
  pages between the host pool and the store (``interface_v1: 1``); pages already
  stored are skipped; with MLA only the storage writer rank writes, the others
  report success.
- ``get``/``batch_get``/``set``/``batch_set``/``exists``: the generic path over SGLang's
  flat pages (``get_data_page``), same objects as the v1 path.
- ``clear()`` removes this rank's objects (leased ones survive their lease, as
  upstream); ``get_stats()`` returns SGLang's ``StorageMetrics``; ``close()``.

Store trouble (master or holder gone, timeouts) turns into misses and ``False``, logged
once per outage; bad calls from the engine (wrong sizes, host indices outside the
pool, layouts we do not serve) raise ``ValueError``/``IndexError``/``ConfigError``.

``extra_config`` keys read here: ``master_server_address``, ``global_segment_size``
(memory this rank lends; default: the config's, divided by tp_size * pp_size),
``protocol`` (``tcp``/``shm``), ``failover_timeout_s`` (how long a call waits for a
master; default 3), ``key_namespace``, ``mooncake_config_path``; SGLang's own
``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``allocator`` are
accepted and ignored. Anything else raises ``ConfigError`` naming the closest key.
"""

from __future__ import annotations

import difflib
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from mooncake_core.config import load_config, parse_size
from mooncake_core.errors import ConfigError, MooncakeError, ObjectExists, ObjectNotFound
from mooncake_core.store import ObjectBusy, StoreClient
from mooncake_sglang.keys import KeyScheme
from mooncake_sglang.layout import PoolView

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

__all__ = ["MooncakeCoreStorage", "EXTRA_CONFIG_KEYS"]

logger = logging.getLogger(__name__)

#: keys of --hicache-storage-backend-extra-config this backend reads
EXTRA_CONFIG_KEYS = (
    "master_server_address",
    "global_segment_size",
    "protocol",
    "failover_timeout_s",
    "key_namespace",
    "mooncake_config_path",
)
_SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "allocator",
    "hicache_storage_pass_prefix_keys",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "tp_lcm_size",
)
_STORE_TROUBLE = (MooncakeError, OSError)
_ALREADY = (ObjectExists, ObjectBusy)


def _check_extra(extra: dict[str, Any]) -> None:
    known = EXTRA_CONFIG_KEYS + _SGLANG_KEYS
    for k in extra:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; known keys: {', '.join(EXTRA_CONFIG_KEYS)}"
            )
            raise ConfigError(f"--hicache-storage-backend-extra-config: unknown key {k!r}{hint}")


class MooncakeCoreStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    """HiCache L3 storage on a mooncake-core store (see module doc).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, MLA, model, extra_config).
        kwargs: the factory's extra arguments (``{}`` from SGLang's controller).
        client: an already started ``StoreClient`` to use instead of building one (tests,
            benchmarks); it is not closed by :meth:`close`.
    """

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: dict[str, Any] | None = None,
        client: StoreClient | None = None,
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        _check_extra(extra)
        self.storage_config = storage_config
        self.is_writer = bool(storage_config.is_storage_writer)
        # SGLang drains get_stats() only when its storage metrics are on; keep nothing otherwise
        self._keep_stats = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.namespace = str(extra.get("key_namespace", ""))
        self._lock = threading.Lock()
        self._healthy = True
        self._view: PoolView | None = None
        self._scheme: KeyScheme | None = None
        self._registered: list[int] = []
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self.counters = {
            "set_pages": 0,
            "set_skipped": 0,
            "get_pages": 0,
            "get_failed": 0,
            "store_errors": 0,
        }
        self._closed = False
        if client is not None:
            self.client = client
            self._own_client = False
            return
        overrides: dict[str, Any] = {}
        if "master_server_address" in extra:
            overrides["master_server_address"] = str(extra["master_server_address"])
        cfg = load_config(extra.get("mooncake_config_path"), **overrides)
        parts = max(1, int(storage_config.tp_size) * int(storage_config.pp_size))
        seg = (
            parse_size(extra["global_segment_size"], "global_segment_size")
            if "global_segment_size" in extra
            else int(cfg.global_segment_size) // parts
        )
        protocol = extra.get("protocol")
        self.client = StoreClient(
            cfg,
            segment_size=seg,
            transport=str(protocol) if protocol else None,
            failover_timeout_s=float(extra.get("failover_timeout_s", 3.0)),
        )
        self._own_client = True
        try:
            self.client.start()
        except MooncakeError as exc:
            raise MooncakeError(
                f"mooncake_core HiCache backend: cannot reach the store master at "
                f"{self.client.master_address}: {exc}; start `mooncake-core master` or set "
                "master_server_address in --hicache-storage-backend-extra-config"
            ) from exc
        logger.info(
            "mooncake_core HiCache backend: rank %d/%d (%s) on master %s, lending %d MiB",
            storage_config.tp_rank,
            storage_config.tp_size,
            "MLA" if storage_config.is_mla_model else "MHA",
            self.client.master_address,
            seg >> 20,
        )

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the pool's layout and register its buffers (*Called by* the controller, once)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        view = PoolView(mem_pool_host, mla=bool(cfg.is_mla_model))
        self._view = view
        self._scheme = KeyScheme(
            model=str(cfg.model_name or ""),
            token_major=view.token_major,
            num_layers=view.num_layers,
            heads=view.heads,
            head_dim=view.head_dim,
            dtype=view.dtype,
            page_size=view.page_size,
            mla=view.mla,
            tp_rank=int(cfg.tp_rank),
            tp_size=int(cfg.tp_size),
            pp_rank=int(cfg.pp_rank),
            pp_size=int(cfg.pp_size),
            cp_rank=int(cfg.attn_cp_rank),
            cp_size=int(cfg.attn_cp_size),
            namespace=self.namespace,
        )
        if view.contiguous:
            for i in range(len(view.parts)):
                addr, n = view.region(i)
                self.client.register_buffer(addr, n)
                self._registered.append(addr)
        logger.info(
            "mooncake_core HiCache backend: %s pool, %d layers x %d heads x %d, page %d, keys %s*",
            view.layout,
            view.num_layers,
            view.heads,
            view.head_dim,
            view.page_size,
            self._scheme.prefix,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise ConfigError(
            f"mooncake_core HiCache backend: extra host pool {str(host_pool_name)!r} "
            "(hybrid or sidecar pools: Mamba, SWA, DSA indexer) is not supported; use SGLang's "
            "built-in backends for hybrid models"
        )

    def _require(self) -> tuple[PoolView, KeyScheme]:
        if self._view is None or self._scheme is None:
            raise ConfigError(
                "mooncake_core HiCache backend: no host pool registered; SGLang calls "
                "register_mem_pool_host() right after building the backend"
            )
        return self._view, self._scheme

    # ------------------------------------------------------------------ helpers
    def _trouble(self, what: str, exc: BaseException) -> None:
        self.counters["store_errors"] += 1
        if self._healthy:
            self._healthy = False
            logger.warning(
                "mooncake_core HiCache backend: %s failed (%s); "
                "reporting misses until the store answers",
                what,
                exc,
            )
        else:
            logger.debug("%s failed: %s", what, exc)

    def _ok(self) -> None:
        if not self._healthy:
            self._healthy = True
            logger.info("mooncake_core HiCache backend: the store answers again")

    def _present(self, objkeys: list[str]) -> list[bool]:
        return [bool(x) for x in self.client.batch_exists(objkeys)]

    def _put(
        self, objkeys: list[str], bufs: list[Any], sizes: list[int] | None, what: str
    ) -> tuple[list[bool], list[bool]]:
        """Put objects not yet present; per-object success (already present counts) and
        per-object "bytes were written".

        No existence query first: the master's ``batch_put_start`` answers ``ObjectExists``
        (or ``ObjectBusy``: another writer is storing it) per key without moving any bytes,
        so a batch costs two round trips to the master instead of three.
        """
        res = self.client.batch_put_from(objkeys, bufs, sizes)
        ok = [True] * len(objkeys)
        written = [r is None for r in res]
        skipped = 0
        for i, r in enumerate(res):
            if r is None:
                continue
            if isinstance(r, _ALREADY):
                skipped += 1
                continue
            ok[i] = False
            logger.debug("%s: put %s failed: %s", what, objkeys[i], r)
        self.counters["set_skipped"] += skipped
        return ok, written

    @staticmethod
    def _pages_ok(obj_ok: Sequence[bool], nparts: int) -> list[bool]:
        return [all(obj_ok[i * nparts : (i + 1) * nparts]) for i in range(len(obj_ok) // nparts)]

    def _record(self, kind: str, pages: int, seconds: float, nbytes: int) -> None:
        """One batch for ``get_stats``: pages moved and their GB/s (as SGLang's own backends:
        pages already stored are not backed up again and count for nothing; a batch that
        moved no page is not recorded)."""
        if not self._keep_stats or pages <= 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # ------------------------------------------------------------------ zero-copy v1
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages ``keys[i]`` from host slots ``host_indices[i*P:(i+1)*P]``."""
        view, scheme = self._require()
        starts = view.page_starts(host_indices, len(keys))
        objkeys = scheme.batch_keys(keys)
        if not keys or not self.is_writer:
            return [True] * len(keys)
        nparts = len(view.parts)
        t0 = time.perf_counter()
        bufs: list[Any]
        if view.contiguous:
            bufs = [view.address(j, s) for s in starts for j in range(nparts)]
        else:
            staged = [view.gather(j, starts) for j in range(nparts)]
            bufs = [staged[j][i] for i in range(len(starts)) for j in range(nparts)]
        sizes = [view.object_nbytes] * len(objkeys)
        try:
            obj_ok, written = self._put(objkeys, bufs, sizes, "batch_set_v1")
        except _STORE_TROUBLE as exc:
            self._trouble("batch_set_v1", exc)
            return [False] * len(keys)
        seconds = time.perf_counter() - t0
        self._ok()
        ok = self._pages_ok(obj_ok, nparts)
        self.counters["set_pages"] += sum(ok)
        new_pages = sum(
            1 for i, good in enumerate(ok) if good and any(written[i * nparts : (i + 1) * nparts])
        )
        self._record("backup", new_pages, seconds, sum(written) * view.object_nbytes)
        return ok

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages ``keys[i]`` into host slots ``host_indices[i*P:(i+1)*P]``."""
        view, scheme = self._require()
        starts = view.page_starts(host_indices, len(keys))
        objkeys = scheme.batch_keys(keys)
        if not keys:
            return []
        nparts = len(view.parts)
        t0 = time.perf_counter()
        bufs: list[Any]
        staged: list[torch.Tensor] = []
        if view.contiguous:
            bufs = [view.address(j, s) for s in starts for j in range(nparts)]
        else:
            staged = [view.staging(len(starts)) for _ in range(nparts)]
            bufs = [staged[j][i] for i in range(len(starts)) for j in range(nparts)]
        try:
            res = self.client.batch_get_into(objkeys, bufs, [view.object_nbytes] * len(objkeys))
        except _STORE_TROUBLE as exc:
            self._trouble("batch_get_v1", exc)
            return [False] * len(keys)
        seconds = time.perf_counter() - t0
        self._ok()
        obj_ok = [
            isinstance(r, int) and not isinstance(r, bool) and r == view.object_nbytes for r in res
        ]
        odd = next((r for r in res if not isinstance(r, (int, ObjectNotFound))), None)
        if (
            odd is not None
        ):  # a miss is normal (evicted since exists); anything else is worth a line
            logger.warning(
                "batch_get_v1: %d of %d objects not read; first error: %s: %s",
                len(obj_ok) - sum(obj_ok),
                len(obj_ok),
                type(odd).__name__,
                odd,
            )
        ok = self._pages_ok(obj_ok, nparts)
        if staged:
            good = [i for i, g in enumerate(ok) if g]
            if good:
                sel = torch.tensor(good, dtype=torch.int64)
                for j in range(nparts):
                    view.scatter(j, [starts[i] for i in good], staged[j].index_select(0, sel))
        self.counters["get_pages"] += sum(ok)
        self.counters["get_failed"] += len(ok) - sum(ok)
        self._record("prefetch", sum(ok), seconds, sum(ok) * view.page_nbytes)
        return ok

    # ------------------------------------------------------------------ existence
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` are fully stored (0 when the store is unreachable)."""
        _, scheme = self._require()
        if not keys:
            return 0
        try:
            present = self._present(scheme.batch_keys(keys))
        except _STORE_TROUBLE as exc:
            self._trouble("batch_exists", exc)
            return 0
        self._ok()
        nparts = len(scheme.parts)
        for i in range(len(keys)):
            if not all(present[i * nparts : (i + 1) * nparts]):
                return i
        return len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ generic (flat pages)
    def _flat_target(self, target: Any) -> torch.Tensor:
        view, _ = self._require()
        if target is None:
            return torch.empty(view.page_nbytes // view.itemsize, dtype=view.parts[0].dtype)
        if not isinstance(target, torch.Tensor):
            raise ValueError(
                f"target_location must be a torch.Tensor (a flat page), got {type(target).__name__}"
            )
        if target.numel() * target.element_size() != view.page_nbytes or not target.is_contiguous():
            raise ValueError(
                f"target_location holds {target.numel() * target.element_size()} bytes; "
                f"a flat page of this pool is {view.page_nbytes} contiguous bytes"
            )
        return target

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (``host_pool.get_data_page(i)``); True if every page is stored."""
        view, scheme = self._require()
        if values is None or len(values) != len(keys):
            raise ValueError(
                f"batch_set needs one flat page tensor per key: {len(keys)} keys, "
                f"{'no' if values is None else len(values)} values"
            )
        nparts = len(view.parts)
        bufs: list[Any] = []
        for key, v in zip(keys, values, strict=True):
            if not isinstance(v, torch.Tensor):
                raise ValueError(
                    f"value for page {key!r} must be a torch.Tensor, got {type(v).__name__}"
                )
            flat = v.detach().contiguous().view(-1)
            if flat.numel() * flat.element_size() != view.page_nbytes:
                raise ValueError(
                    f"value for page {key!r} has {flat.numel() * flat.element_size()} bytes; "
                    f"a page of this pool is {view.page_nbytes} ({nparts} x {view.object_nbytes})"
                )
            raw = flat.view(torch.uint8)
            bufs.extend(
                raw[j * view.object_nbytes : (j + 1) * view.object_nbytes] for j in range(nparts)
            )
        objkeys = scheme.batch_keys(keys)
        if not keys or not self.is_writer:
            return True
        try:
            ok = all(self._put(objkeys, bufs, None, "batch_set")[0])
        except _STORE_TROUBLE as exc:
            self._trouble("batch_set", exc)
            return False
        self._ok()
        return ok

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read flat pages; ``None`` for each page that is missing or failed."""
        view, scheme = self._require()
        targets = [
            self._flat_target(None if target_locations is None else target_locations[i])
            for i in range(len(keys))
        ]
        nparts = len(view.parts)
        bufs = [
            t.view(-1).view(torch.uint8)[j * view.object_nbytes : (j + 1) * view.object_nbytes]
            for t in targets
            for j in range(nparts)
        ]
        objkeys = scheme.batch_keys(keys)
        if not keys:
            return []
        try:
            res = self.client.batch_get_into(objkeys, bufs)
        except _STORE_TROUBLE as exc:
            self._trouble("batch_get", exc)
            return [None] * len(keys)
        self._ok()
        obj_ok = [
            isinstance(r, int) and not isinstance(r, bool) and r == view.object_nbytes for r in res
        ]
        return [
            t if good else None
            for t, good in zip(targets, self._pages_ok(obj_ok, nparts), strict=True)
        ]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        """Remove this rank's objects (objects under a read lease survive it, as upstream)."""
        _, scheme = self._require()
        if not self.is_writer:
            return
        try:
            n = self.client.remove_by_regex("^" + re.escape(scheme.prefix))
        except _STORE_TROUBLE as exc:
            self._trouble("clear", exc)
            return
        logger.info("mooncake_core HiCache backend: cleared %d objects under %s", n, scheme.prefix)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None if SGLang's metrics module is
        missing)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        with self._lock:
            m = StorageMetrics(
                prefetch_pgs=[int(x) for x in self._metrics["prefetch_pgs"]],
                backup_pgs=[int(x) for x in self._metrics["backup_pgs"]],
                prefetch_bandwidth=list(self._metrics["prefetch_bandwidth"]),
                backup_bandwidth=list(self._metrics["backup_bandwidth"]),
            )
            for v in self._metrics.values():
                v.clear()
        return m

    def close(self) -> None:
        """Unregister the pool and close the store client (*Called by* the controller on detach)."""
        if self._closed:
            return
        self._closed = True
        for addr in self._registered:
            try:
                self.client.unregister_buffer(addr)
            except MooncakeError as exc:
                logger.debug("unregistering %#x: %s", addr, exc)
        self._registered.clear()
        if self._own_client:
            self.client.close()
