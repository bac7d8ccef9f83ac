"""``mooncake.store`` drop-in: ``MooncakeDistributedStore`` and ``ReplicateConfig`` on our store.

Contract (names, argument order, defaults and return conventions follow the published
``mooncake-transfer-engine`` wheel, 0.3.13; see docs/compat.md):

- Setup: :meth:`MooncakeDistributedStore.setup` with the seven positional arguments
  (``local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
  rdma_devices, master_server_addr``) plus keywords, or with one config dict;
  ``close``, ``health_check``, ``get_hostname``.
- Bytes: ``put``, ``get`` (``b""`` when missing), ``put_batch``, ``get_batch``,
  ``put_parts``, ``get_buffer`` / ``batch_get_buffer`` (``BufferHandle`` or None),
  ``upsert*``, ``put_tensor`` / ``get_tensor``.
- Zero-copy: ``register_buffer`` / ``unregister_buffer``, ``put_from``, ``get_into``
  (bytes read), ``batch_put_from``, ``batch_get_into``.
- Metadata: ``is_exist`` (1 / 0 / negative), ``batch_is_exist``, ``get_size``,
  ``remove``, ``batch_remove``, ``remove_by_regex`` / ``remove_all`` (count removed).

Returns: 0 (or a count / size) on success, a negative published ``ErrorCode`` on
failure (table :data:`ERROR_CODES`); methods never raise for store errors. As in the
published store, putting a key that already exists succeeds without changing it.

Runs on :class:`mooncake_core.store.StoreClient` against our master
(``mooncake-core master``); it does not speak to a published ``mooncake_master``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from mooncake_core.compat import engine as _compat_engine
from mooncake_core.compat.buffer_pool import (  # the published names, re-exported
    BufferLease,
    BufferLeaseView,
    BufferPool,
    MooncakeHostMemAllocator,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
    get_alloc_func_addr,
    get_free_func_addr,
)
from mooncake_core.compat.store_dummy import DummyMethods
from mooncake_core.compat.store_engram import EngramStore, EngramStoreConfig  # published names
from mooncake_core.compat.store_numa import bind_to_numa_node
from mooncake_core.compat.store_parallel import (  # the published names, re-exported
    ParallelAxis,
    ParallelMethods,
    ReadTarget,
    TensorParallelism,
)
from mooncake_core.compat.store_ranges import RangeMethods
from mooncake_core.compat.store_replicas import (  # the published module's names, re-exported
    COMPLETE,
    INITIALIZED,
    REMOVED,
    UNDEFINED,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaMethods,
    ReplicaStatus,
)
from mooncake_core.compat.store_segments import SegmentMethods
from mooncake_core.compat.store_sessions import SessionMethods
from mooncake_core.compat.store_tasks import (  # the published module's names, re-exported
    FAILED,
    PENDING,
    PROCESSING,
    REPLICA_COPY,
    REPLICA_MOVE,
    SUCCESS,
    QueryTaskResponse,
    TaskMethods,
    TaskStatus,
    TaskType,
)
from mooncake_core.compat.store_tensors import TensorMethods
from mooncake_core.compat.store_types import (  # the published module's names, re-exported
    ACTIVATION,
    ERROR_CODES,
    GENERAL,
    GRADIENT,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_READ,
    KVCACHE,
    METADATA,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OPTIMIZER_STATE,
    RPC_FAIL,
    SAMPLE,
    TENSOR,
    TRANSFER_FAIL,
    UNKNOWN,
    WEIGHT,
    BufferHandle,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    _code,
)
from mooncake_core.config import environment, load_config, parse_size
from mooncake_core.errors import (
    MooncakeError,
    ObjectExists,
    SegmentError,
)
from mooncake_core.store import StoreClient
from mooncake_core.store.protocol import InvalidArgument
from mooncake_core.store.tenants import check_tenant
from mooncake_core.transfer.engine import TransferEngine as _Engine
from mooncake_core.transfer.memory import host_view

__all__ = [
    "bind_to_numa_node",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
    "BufferHandle",
    "ERROR_CODES",
    "INTERNAL_ERROR",
    "NO_AVAILABLE_HANDLE",
    "INVALID_PARAMS",
    "INVALID_READ",
    "OBJECT_NOT_FOUND",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "TRANSFER_FAIL",
    "RPC_FAIL",
    "UNKNOWN",
    "KVCACHE",
    "TENSOR",
    "WEIGHT",
    "SAMPLE",
    "ACTIVATION",
    "GRADIENT",
    "OPTIMIZER_STATE",
    "METADATA",
    "GENERAL",
    "ReplicaStatus",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "Descriptor",
    "UNDEFINED",
    "INITIALIZED",
    "COMPLETE",
    "REMOVED",
    "QueryTaskResponse",
    "TaskStatus",
    "TaskType",
    "PENDING",
    "PROCESSING",
    "SUCCESS",
    "FAILED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "ParallelAxis",
    "TensorParallelism",
    "ReadTarget",
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "BufferLeaseView",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "MooncakeHostMemAllocator",
    "get_alloc_func_addr",
    "get_free_func_addr",
    "EngramStore",
    "EngramStoreConfig",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The published client's port comes from this range (MC_STORE_CLIENT_MIN_PORT..
#: MC_STORE_CLIENT_MAX_PORT, default 12300..14300), as observed on the wheel.
CLIENT_PORT_RANGE = (12300, 14300)


def _free_port(host: str, environ: Mapping[str, str]) -> int:
    lo, hi = _compat_engine.port_range(
        environ, "MC_STORE_CLIENT_MIN_PORT", "MC_STORE_CLIENT_MAX_PORT", CLIENT_PORT_RANGE
    )
    return _compat_engine.free_port(host, lo, hi)


class MooncakeDistributedStore(
    TensorMethods,
    ParallelMethods,
    ReplicaMethods,
    SegmentMethods,
    SessionMethods,
    DummyMethods,
    RangeMethods,
    TaskMethods,
):
    """The published ``mooncake.store.MooncakeDistributedStore`` on :class:`StoreClient`."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._closed = False
        self._local_buffer_size = 0

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config_dict)``. Returns 0 or a negative code."""
        if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
            return self._setup_dict(args[0])
        try:
            return self._setup(*args, **kwargs)
        except TypeError as exc:
            logger.error("setup: %s", exc)
            return INVALID_PARAMS

    def _setup_dict(self, cfg: Mapping[str, Any]) -> int:
        missing = [k for k in ("local_hostname", "metadata_server") if not cfg.get(k)]
        if missing:
            logger.error("setup(config): missing required key(s) %s", ", ".join(missing))
            return INVALID_PARAMS
        try:
            return self._setup(
                str(cfg["local_hostname"]),
                str(cfg["metadata_server"]),
                parse_size(cfg.get("global_segment_size", 16 << 20), "global_segment_size"),
                parse_size(cfg.get("local_buffer_size", 16 << 20), "local_buffer_size"),
                str(cfg.get("protocol", "tcp")),
                str(cfg.get("rdma_devices", "")),
                str(
                    cfg.get(
                        "master_server_addr", cfg.get("master_server_address", "127.0.0.1:50051")
                    )
                ),
                enable_ssd_offload=bool(cfg.get("enable_ssd_offload", False)),
                ssd_offload_path=str(cfg.get("ssd_offload_path", "")),
                tenant_id=str(cfg.get("tenant_id", "default")),
            )
        except MooncakeError as exc:
            logger.error("setup(config): %s", exc)
            return INVALID_PARAMS

    def _setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        if self._client is not None:
            logger.error("setup: this store is already set up")
            return INVALID_PARAMS
        if global_segment_size < 0 or local_buffer_size < 0:
            logger.error(
                "setup: sizes must not be negative (%d, %d)", global_segment_size, local_buffer_size
            )
            return INVALID_PARAMS
        if enable_client_http_server:
            logger.info("setup: the client HTTP server is not supported; ignored")
        try:  # keys live in the tenant's namespace, under its quota (docs/store.md)
            tenant = check_tenant("" if tenant_id == "default" else tenant_id, "setup: tenant_id")
        except InvalidArgument as exc:
            logger.error("%s", exc)
            return INVALID_PARAMS
        env = dict(environment())
        env.pop("MOONCAKE_CONFIG_PATH", None)
        meta = metadata_server.strip() or "P2PHANDSHAKE"
        host = local_hostname.strip() or "127.0.0.1"
        bare, sep, port = host.rpartition(":")
        if not (sep and port.isdigit()) and engine is None:
            # The segment name is host:port; give each client its own port from the range
            # the published client uses (with P2P handshake our listener binds it).
            host = f"{host}:{_free_port(host, env)}"
        proto = {"rdma": "rdma", "efa": "rdma", "barex": "rdma", "shm": "shm"}.get(
            protocol.strip().lower(), "tcp"
        )
        transfer = _compat_engine.upstream_transfer_overrides(env)
        overrides: dict[str, Any] = {
            "local_hostname": host,
            "metadata_server": meta,
            "protocol": proto,
            "device_name": rdma_devices,
            "master_server_address": master_server_addr,
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
        }
        if transfer:
            overrides["transfer"] = transfer
        inner: _Engine | None = None
        if isinstance(engine, _compat_engine.TransferEngine):
            inner = engine.get_engine()
        elif isinstance(engine, _Engine):
            inner = engine
        elif engine is not None:
            logger.error(
                "setup: engine must come from TransferEngine.get_engine(), got %r",
                type(engine).__name__,
            )
            return INVALID_PARAMS
        try:
            cfg = load_config(environ=env, **overrides)
            client = StoreClient(
                cfg,
                master=master_server_addr,
                segment_size=global_segment_size,
                engine=inner,
                ssd_path=ssd_offload_path if enable_ssd_offload else "",
                tenant=tenant,
            )
            client.start()
        except (MooncakeError, OSError) as exc:
            logger.error("setup(%r, master %r) failed: %s", host, master_server_addr, exc)
            return _code(exc)
        self._client = client
        self._closed = False
        self._local_buffer_size = local_buffer_size
        return 0

    def close(self) -> int:
        """Unmount this client's memory and disconnect. Idempotent; returns 0."""
        if self._client is not None:
            try:
                self._client.close()
            except (MooncakeError, OSError) as exc:
                logger.warning("close: %s", exc)
            self._client = None
        self._closed = True
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable."""
        if self._client is None:
            return 1
        try:
            self._client.stats()
        except (MooncakeError, OSError):
            return 2
        return 0

    def get_hostname(self) -> str:
        """This client's segment name (``host:port``)."""
        return self._client.hostname if self._client is not None else ""

    # ------------------------------------------------------------------ helpers
    def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int:
        if self._client is None:
            logger.error("%s: the store is not set up (call setup() first)", what)
            return INVALID_PARAMS
        try:
            return fn(self._client)
        except (MooncakeError, OSError, ValueError) as exc:
            code = _code(exc)
            log = logger.debug if code == OBJECT_NOT_FOUND else logger.error
            log("%s failed: %s", what, exc)
            return code

    def _put(self, what: str, fn: Callable[[StoreClient], None]) -> int:
        def run(c: StoreClient) -> int:
            try:
                fn(c)
            except ObjectExists:
                return 0  # the published store reports success for an existing key
            return 0

        rc = self._run(what, run)
        return int(rc)

    @staticmethod
    def _kw(config: ReplicateConfig | None) -> dict[str, Any]:
        return (config or ReplicateConfig()).kwargs()

    def _refused(self, what: str, config: ReplicateConfig | None, staged: bool) -> bool:
        """True (after logging why) when the published store refuses this call with -600:
        a config it rejects, or a bytes call (``staged``) on a store set up with
        ``local_buffer_size=0`` (the published client stages such values in that buffer)."""
        tenant = self._client.tenant if self._client is not None else None
        why = config.problem(tenant) if config is not None else None
        if why is None and staged and self._client is not None and not self._local_buffer_size:
            why = "the store was set up with local_buffer_size=0 (use put_from / get_into)"
        if why is not None:
            logger.error("%s: %s", what, why)
        return why is not None

    # ------------------------------------------------------------------ bytes
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        if self._refused(f"put {key!r}", config, staged=True):
            return INVALID_PARAMS
        return self._put(f"put {key!r}", lambda c: c.put(key, value, **self._kw(config)))

    def put_parts(self, key: str, *args: Any, config: ReplicateConfig | None = None) -> int:
        def run(c: StoreClient) -> None:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in args)
            c.put(key, data, **self._kw(config))

        if not args:
            logger.error("put_parts %r: no parts", key)
            return INVALID_PARAMS
        if self._refused(f"put_parts {key!r}", config, staged=True):
            return INVALID_PARAMS
        return self._put(f"put_parts {key!r}", run)

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """0 if every key was stored (or already existed), else the first failure's code."""
        if len(keys) != len(values):
            logger.error("put_batch: %d keys but %d values", len(keys), len(values))
            return INVALID_PARAMS
        if self._refused("put_batch", config, staged=True):
            return INVALID_PARAMS
        res = self._run("put_batch", lambda c: c.put_batch(keys, values, **self._kw(config)))
        if isinstance(res, int):
            return res
        for exc in res:
            if exc is not None and not isinstance(exc, ObjectExists):
                return _code(exc)
        return 0

    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` if it is missing or the read failed."""
        if self._refused(f"get {key!r}", None, staged=True):
            return b""
        res = self._run(f"get {key!r}", lambda c: c.get(key))
        return res if isinstance(res, bytes) else b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Per key: the bytes, ``b""`` when missing. An empty ``keys`` gives ``[b""]``, as
        the published store answers."""
        if not keys:
            return [b""]
        if self._refused("get_batch", None, staged=True):
            return [b""] * len(keys)
        res = self._run("get_batch", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [b""] * len(keys)
        return [b if b is not None else b"" for b in res]

    def get_buffer(self, key: str) -> BufferHandle | None:
        if self._refused(f"get_buffer {key!r}", None, staged=True):
            return None
        data = self._run(f"get_buffer {key!r}", lambda c: c.get(key))
        return BufferHandle(data) if isinstance(data, bytes) else None

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        if self._refused("batch_get_buffer", None, staged=True):
            return [None] * len(keys)
        res = self._run("batch_get_buffer", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [None] * len(keys)
        return [BufferHandle(b) if b is not None else None for b in res]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace (remove, then put: not atomic)."""
        if self._refused(f"upsert {key!r}", config, staged=True):
            return INVALID_PARAMS
        return self._upsert(key, lambda: self.put(key, value, config))

    def upsert_parts(self, key: str, *args: Any, config: ReplicateConfig | None = None) -> int:
        if self._refused(f"upsert_parts {key!r}", config, staged=True):
            return INVALID_PARAMS
        return self._upsert(key, lambda: self.put_parts(key, *args, config=config))

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        if self._refused(f"upsert_from {key!r}", config, staged=False):
            return INVALID_PARAMS
        return self._upsert(key, lambda: self.put_from(key, buffer_ptr, size, config))

    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        if self._refused("upsert_batch", config, staged=True):
            return INVALID_PARAMS
        for k in keys:
            rc = self.remove(k, True)
            if rc not in (0, OBJECT_NOT_FOUND):
                return rc
        return self.put_batch(keys, values, config)

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        if self._refused("batch_upsert_from", config, staged=False):
            return [INVALID_PARAMS] * len(keys)
        return [
            self.upsert_from(k, p, n, config)
            for k, p, n in zip(keys, buffer_ptrs, sizes, strict=False)
        ]

    def _upsert(self, key: str, put: Callable[[], int]) -> int:
        rc = self.remove(key, True)
        if rc not in (0, OBJECT_NOT_FOUND):
            return rc
        return put()

    # ------------------------------------------------------------------ zero-copy
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``[buffer_ptr, buffer_ptr+size)`` for ``put_from`` / ``get_into``."""
        rc = self._run("register_buffer", lambda c: c.register_buffer(int(buffer_ptr), int(size)))
        return rc if isinstance(rc, int) else 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        rc = self._run("unregister_buffer", lambda c: c.unregister_buffer(int(buffer_ptr)))
        return rc if isinstance(rc, int) else 0

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        if self._refused(f"put_from {key!r}", config, staged=False):
            return INVALID_PARAMS
        return self._put(
            f"put_from {key!r}",
            lambda c: c.put_from(key, int(buffer_ptr), int(size), **self._kw(config)),
        )

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes
        at ``buffer_ptr`` as one object (the published layout: metadata first)."""
        what = f"put_from_with_metadata {key!r}"
        if self._refused(what, config, staged=False):
            return INVALID_PARAMS
        if min(int(size), int(metadata_size)) < 0 or not int(buffer_ptr) and int(size):
            logger.error("%s: bad buffer or sizes (%d, %d)", what, size, metadata_size)
            return INVALID_PARAMS

        def run(c: StoreClient) -> None:
            meta = host_view(int(metadata_buffer_ptr), int(metadata_size))
            data = host_view(int(buffer_ptr), int(size))
            c.put(key, bytes(meta) + bytes(data), **self._kw(config))

        return self._put(what, run)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into registered memory; returns the bytes read or a negative code."""
        return int(
            self._run(f"get_into {key!r}", lambda c: c.get_into(key, int(buffer_ptr), int(size)))
        )

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            logger.error("batch_put_from: keys, buffer_ptrs and sizes differ in length")
            return [INVALID_PARAMS] * len(keys)
        if self._refused("batch_put_from", config, staged=False):
            return [INVALID_PARAMS] * len(keys)
        res = self._run(
            "batch_put_from",
            lambda c: c.batch_put_from(
                keys, [int(p) for p in buffer_ptrs], [int(n) for n in sizes], **self._kw(config)
            ),
        )
        if isinstance(res, int):
            return [res] * len(keys)
        return [0 if e is None or isinstance(e, ObjectExists) else _code(e) for e in res]

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """Per key: bytes read, or a negative code."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            logger.error("batch_get_into: keys, buffer_ptrs and sizes differ in length")
            return [INVALID_PARAMS] * len(keys)
        res = self._run(
            "batch_get_into",
            lambda c: c.batch_get_into(
                keys, [int(p) for p in buffer_ptrs], [int(n) for n in sizes]
            ),
        )
        if isinstance(res, int):
            return [res] * len(keys)
        return [r if isinstance(r, int) else _code(r) for r in res]

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store each key as the concatenation of its parts ``(all_buffer_ptrs[i][j],
        all_sizes[i][j])`` in registered memory (vLLM's MooncakeStoreConnector saves a KV
        page of several layers this way). Per key: 0 or a negative code. Gathers by copy."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            logger.error(
                "batch_put_from_multi_buffers: keys, buffer_ptrs and sizes differ in length"
            )
            return [INVALID_PARAMS] * len(keys)
        if self._client is None:
            logger.error(
                "batch_put_from_multi_buffers: the store is not set up (call setup() first)"
            )
            return [INVALID_PARAMS] * len(keys)
        if self._refused("batch_put_from_multi_buffers", config, staged=False):
            return [INVALID_PARAMS] * len(keys)
        out: list[int] = [0] * len(keys)
        todo_keys: list[str] = []
        todo_vals: list[bytes] = []
        todo_idx: list[int] = []
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
            try:
                todo_vals.append(self._gather(ptrs, sizes))
            except (MooncakeError, ValueError) as exc:
                logger.error("batch_put_from_multi_buffers %r: %s", keys[i], exc)
                out[i] = _code(exc)
                continue
            todo_keys.append(keys[i])
            todo_idx.append(i)
        if todo_keys:
            res = self._run(
                "batch_put_from_multi_buffers",
                lambda c: c.put_batch(todo_keys, todo_vals, **self._kw(config)),
            )
            for n, i in enumerate(todo_idx):
                if isinstance(res, int):
                    out[i] = res
                else:
                    err = res[n]
                    out[i] = 0 if err is None or isinstance(err, ObjectExists) else _code(err)
        return out

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read each key and scatter its bytes over its parts in registered memory (the
        parts' sizes must add up to the object's size). Per key: bytes read or a negative
        code (-704 missing)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            logger.error(
                "batch_get_into_multi_buffers: keys, buffer_ptrs and sizes differ in length"
            )
            return [INVALID_PARAMS] * len(keys)
        res = self._run("batch_get_into_multi_buffers", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [res] * len(keys)
        out: list[int] = []
        for key, data, ptrs, sizes in zip(keys, res, all_buffer_ptrs, all_sizes, strict=True):
            if data is None:
                out.append(OBJECT_NOT_FOUND)
                continue
            try:
                out.append(self._scatter(data, ptrs, sizes))
            except (MooncakeError, ValueError) as exc:
                logger.error("batch_get_into_multi_buffers %r: %s", key, exc)
                out.append(_code(exc))
        return out

    def _host(self, addr: int, n: int) -> memoryview:
        assert self._client is not None
        region = self._client.engine.segments.find(
            int(addr), int(n)
        )  # SegmentError if not registered
        if region.kind != "host":
            raise SegmentError(
                f"0x{addr:x} is {region.kind} memory; only host memory is supported here"
            )
        return host_view(int(addr), int(n))

    def _gather(self, ptrs: list[int], sizes: list[int]) -> bytes:
        if len(ptrs) != len(sizes) or not ptrs or any(int(n) <= 0 for n in sizes):
            raise ValueError(f"bad parts: {len(ptrs)} pointers, sizes {list(sizes)[:4]}...")
        return b"".join(bytes(self._host(p, n)) for p, n in zip(ptrs, sizes, strict=True))

    def _scatter(self, data: bytes, ptrs: list[int], sizes: list[int]) -> int:
        if len(ptrs) != len(sizes) or sum(int(n) for n in sizes) != len(data):
            raise ValueError(
                f"object is {len(data)} bytes but the {len(ptrs)} buffers hold {sum(sizes)}"
            )
        views = [
            self._host(p, n) for p, n in zip(ptrs, sizes, strict=True)
        ]  # check all before writing
        off = 0
        for v in views:
            v[:] = data[off : off + len(v)]
            off += len(v)
        return len(data)

    # ------------------------------------------------------------------ existence and removal
    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not, negative on error."""
        res = self._run(f"is_exist {key!r}", lambda c: c.exists(key))
        return res if isinstance(res, int) and not isinstance(res, bool) else int(bool(res))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        res = self._run("batch_is_exist", lambda c: c.batch_exists(keys))
        if isinstance(res, int):
            return [res] * len(keys)
        return [1 if x else 0 for x in res]

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code (-704 when missing)."""
        return int(self._run(f"get_size {key!r}", lambda c: c.get_size(key)))

    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 (missing) / -706 (leased or pinned; pass ``force``)."""
        rc = self._run(f"remove {key!r}", lambda c: c.remove(key, force=force))
        return rc if isinstance(rc, int) else 0

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        res = self._run("batch_remove", lambda c: c.batch_remove(keys, force=force))
        if isinstance(res, int):
            return [res] * len(keys)
        return [0 if e is None else _code(e) for e in res]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects were removed (leased ones are skipped unless ``force``), or negative."""
        return int(
            self._run(
                f"remove_by_regex {regex_pattern!r}",
                lambda c: c.remove_by_regex(regex_pattern, force=force),
            )
        )

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed (leased ones are skipped unless ``force``), or negative."""
        return int(self._run("remove_all", lambda c: c.remove_all(force=force)))

    # ------------------------------------------------------------------ ours
    def get_client(self) -> StoreClient | None:
        """The inner :class:`StoreClient` (an extension of the published API)."""
        return self._client

    def __del__(self) -> None:
        # The garbage collector runs this in whatever thread it interrupts (an engine's hot
        # loop, a transfer waiting on its batch): never make that thread wait for the master.
        # The client closes on a thread of its own.
        client = self._client
        if client is None or self._closed:
            return
        try:
            threading.Thread(
                target=_close_quietly, args=(client,), name="mc-compat-close", daemon=True
            ).start()
        except Exception:  # interpreter shutdown: no new threads; nothing sensible left to do
            pass


def _close_quietly(client: StoreClient) -> None:
    """Close a client whose owner was garbage-collected (see
    ``MooncakeDistributedStore.__del__``)."""
    try:
        client.close()
    except Exception as exc:  # nobody is left to tell but the log
        logger.debug("closing an abandoned store client: %s", exc)
