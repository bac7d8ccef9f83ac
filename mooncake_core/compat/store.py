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

import ctypes
import enum
import logging
import numbers
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from mooncake_core.compat import engine as _compat_engine
from mooncake_core.config import environment, load_config, parse_size
from mooncake_core.errors import (
    LeaseExpired,
    MasterUnavailable,
    MooncakeError,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    SegmentError,
    TransportError,
)
from mooncake_core.store import StoreClient
from mooncake_core.store import values as _values
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy
from mooncake_core.transfer.engine import TransferEngine as _Engine
from mooncake_core.transfer.memory import host_view

__all__ = [
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
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Published ErrorCode values for the failures we can tell apart.
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no space for the object
INVALID_PARAMS = -600  # bad key/size/buffer, buffer too small, double registration
INVALID_READ = -701  # the read outlived its lease
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # remove of a leased / pinned / busy object without force
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable

#: Our exception class -> published code (first match wins; order matters).
ERROR_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (ObjectNotFound, OBJECT_NOT_FOUND),
    (ObjectExists, OBJECT_ALREADY_EXISTS),
    (ObjectBusy, OBJECT_HAS_LEASE),
    (NoSpace, NO_AVAILABLE_HANDLE),
    (LeaseExpired, INVALID_READ),
    (MasterUnavailable, RPC_FAIL),
    (InvalidArgument, INVALID_PARAMS),
    (SegmentError, INVALID_PARAMS),
    (ValueError, INVALID_PARAMS),
    (TransportError, TRANSFER_FAIL),
    (OSError, RPC_FAIL),
)

_DEFAULT_SOFT_PIN_TTL_MS = 30 * 60 * 1000


def _code(exc: BaseException) -> int:
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


# The published module exports the ObjectDataType members at module level too.
UNKNOWN = ObjectDataType.UNKNOWN
KVCACHE = ObjectDataType.KVCACHE
TENSOR = ObjectDataType.TENSOR
WEIGHT = ObjectDataType.WEIGHT
SAMPLE = ObjectDataType.SAMPLE
ACTIVATION = ObjectDataType.ACTIVATION
GRADIENT = ObjectDataType.GRADIENT
OPTIMIZER_STATE = ObjectDataType.OPTIMIZER_STATE
METADATA = ObjectDataType.METADATA
GENERAL = ObjectDataType.GENERAL


def _size_t(name: str, value: Any) -> int:
    """An unsigned 64-bit integer as pybind11 accepts it (ints, bools, enums; not floats)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if not 0 <= n < 1 << 64:
        raise TypeError(
            f"ReplicateConfig.{name}: expected a non-negative int, got {type(value).__name__}"
            f" {value!r}"
        )
    return n


def _opt_size_t(name: str, value: Any) -> int | None:
    return None if value is None else _size_t(name, value)


def _flag(name: str, value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, numbers.Number) and not isinstance(value, enum.Enum):
        return bool(value)
    raise TypeError(f"ReplicateConfig.{name}: expected a bool, got {type(value).__name__}")


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"ReplicateConfig.{name}: expected a str, got {type(value).__name__}")


def _texts(name: str, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"ReplicateConfig.{name}: expected a list of str, got {type(value).__name__}"
        )
    return [_text(name, v) for v in value]


def _opt_texts(name: str, value: Any) -> list[str] | None:
    return None if value is None else _texts(name, value)


def _member_of(kind: type[enum.Enum]) -> Callable[[str, Any], Any]:
    def convert(name: str, value: Any) -> Any:
        if not isinstance(value, kind):
            raise TypeError(
                f"ReplicateConfig.{name}: expected a {kind.__name__}, got {type(value).__name__}"
            )
        return value

    return convert


class _Typed:
    """A ``ReplicateConfig`` attribute that converts (or refuses, with ``TypeError``) what
    is assigned, as the published pybind11 class does."""

    def __init__(self, convert: Callable[[str, Any], Any], default: Callable[[], Any]) -> None:
        self.convert = convert
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, "_v_" + self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        object.__setattr__(obj, "_v_" + self.name, self.convert(self.name, value))


_FIELDS = (
    "replica_num",
    "nof_replica_num",
    "dfs_replica_num",
    "soft_pin_action",
    "soft_pin_ttl_ms",
    "with_hard_pin",
    "preferred_segment",
    "preferred_segments",
    "preferred_nof_segments",
    "prefer_alloc_in_same_node",
    "data_type",
    "group_ids",
)


class ReplicateConfig:
    """Per-put placement options (attribute names, types and defaults of the published class).

    Assigning a value of the wrong type raises ``TypeError`` as the published class does;
    unknown attributes raise ``AttributeError``.

    Used here: ``replica_num``, ``with_hard_pin``, ``soft_pin_action`` (ENABLE pins softly
    for ``soft_pin_ttl_ms``, default 30 min), ``preferred_segment`` (else the first of
    ``preferred_segments``), ``prefer_alloc_in_same_node`` (local-first placement).
    Kept but without effect: ``nof_replica_num``, ``dfs_replica_num``,
    ``preferred_nof_segments``, ``data_type``, ``group_ids``.
    """

    __slots__ = tuple("_v_" + f for f in _FIELDS)

    replica_num = _Typed(_size_t, lambda: 1)
    nof_replica_num = _Typed(_size_t, lambda: 0)
    dfs_replica_num = _Typed(_size_t, lambda: 0)
    soft_pin_action = _Typed(_member_of(SoftPinAction), lambda: SoftPinAction.PRESERVE)
    soft_pin_ttl_ms = _Typed(_opt_size_t, lambda: None)
    with_hard_pin = _Typed(_flag, lambda: False)
    preferred_segment = _Typed(_text, lambda: "")
    preferred_segments = _Typed(_texts, list)
    preferred_nof_segments = _Typed(_texts, list)
    prefer_alloc_in_same_node = _Typed(_flag, lambda: False)
    data_type = _Typed(_member_of(ObjectDataType), lambda: ObjectDataType.UNKNOWN)
    group_ids = _Typed(_opt_texts, lambda: None)

    def __init__(self) -> None:
        for name in _FIELDS:
            field: _Typed = type(self).__dict__[name]
            object.__setattr__(self, "_v_" + name, field.default())

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"soft_pin_action={self.soft_pin_action.name}, "
            f"preferred_segment={self.preferred_segment!r})"
        )

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
            f"nof_replica_num: {self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
            f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
            f"with_hard_pin: {int(self.with_hard_pin)}, "
            f"preferred_segments: [{', '.join(self.preferred_segments)}], "
            f"preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}, "
            f"data_type: {self.data_type.name} }}"
        )

    def problem(self) -> str | None:
        """Why a put with this config is refused (-600 in the published store), or None."""
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            return (
                f"soft_pin_ttl_ms={self.soft_pin_ttl_ms} needs soft_pin_action ENABLE"
                f" (it is {self.soft_pin_action.name})"
            )
        return None

    def kwargs(self) -> dict[str, Any]:
        """The matching :class:`StoreClient` put keywords."""
        soft = 0.0
        if self.soft_pin_action == SoftPinAction.ENABLE:
            ms = self.soft_pin_ttl_ms if self.soft_pin_ttl_ms else _DEFAULT_SOFT_PIN_TTL_MS
            soft = ms / 1000.0
        seg = self.preferred_segment or (
            self.preferred_segments[0] if self.preferred_segments else ""
        )
        return {
            "replica_num": int(self.replica_num),
            "preferred_segment": seg,
            "hard_pin": bool(self.with_hard_pin),
            "soft_pin_ttl_s": soft,
            "strategy": "local-first" if self.prefer_alloc_in_same_node else "",
        }


class BufferHandle(bytearray):
    """An object's bytes held in local memory: buffer protocol, ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


#: The published client picks its port in this range (12300-14300), as observed on the wheel.
CLIENT_PORT_RANGE = (12300, 14300)


def _free_port(host: str, lo: int = CLIENT_PORT_RANGE[0], hi: int = CLIENT_PORT_RANGE[1]) -> int:
    return _compat_engine.free_port(host, lo, hi)


class MooncakeDistributedStore:
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
        if tenant_id != "default" or enable_client_http_server:
            logger.info("setup: tenant_id and the client HTTP server are not supported; ignored")
        env = dict(environment())
        env.pop("MOONCAKE_CONFIG_PATH", None)
        meta = metadata_server.strip() or "P2PHANDSHAKE"
        host = local_hostname.strip() or "127.0.0.1"
        bare, sep, port = host.rpartition(":")
        if not (sep and port.isdigit()) and engine is None:
            # The segment name is host:port; give each client its own port from the range
            # the published client uses (with P2P handshake our listener binds it).
            host = f"{host}:{_free_port(host)}"
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
        why = config.problem() if config is not None else None
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

    # ------------------------------------------------------------------ tensors
    # Torch tensors are stored as typed values (mooncake_core.store.values: a small header
    # with dtype and shape, then the bytes): readable by these methods, not by the
    # published store, and the other way round. CPU tensors only (CUDA ones are moved).
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor; 0 or a negative code."""
        return self._put(f"put_tensor {key!r}", lambda c: c.put_tensor(key, tensor))

    def get_tensor(self, key: str) -> Any:
        """The tensor stored with :meth:`put_tensor`, or None."""
        res = self._run(f"get_tensor {key!r}", lambda c: c.get_tensor(key))
        return None if isinstance(res, int) else res

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Insert or replace a tensor (remove, then put: not atomic)."""
        return self._upsert(key, lambda: self.put_tensor(key, tensor))

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key: 0 (stored, or already there) or a negative code."""
        if len(keys) != len(tensors_list):
            logger.error("batch_put_tensor: %d keys but %d tensors", len(keys), len(tensors_list))
            return [INVALID_PARAMS] * len(keys)
        try:
            packed = [_values.pack_tensor(t) for t in tensors_list]
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            logger.error("batch_put_tensor: not a tensor: %s", exc)
            return [INVALID_PARAMS] * len(keys)
        res = self._run("batch_put_tensor", lambda c: c.put_batch(keys, packed))
        if isinstance(res, int):
            return [res] * len(keys)
        return [0 if e is None or isinstance(e, ObjectExists) else _code(e) for e in res]

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key: 0 or a negative code (remove, then put: not atomic)."""
        if len(keys) != len(tensors_list):
            logger.error(
                "batch_upsert_tensor: %d keys but %d tensors", len(keys), len(tensors_list)
            )
            return [INVALID_PARAMS] * len(keys)
        return [self.upsert_tensor(k, t) for k, t in zip(keys, tensors_list, strict=True)]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """Per key: the tensor, or None (missing, or not stored as a tensor)."""
        res = self._run("batch_get_tensor", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [None] * len(keys)
        return [self._tensor_or_none(k, raw) for k, raw in zip(keys, res, strict=True)]

    @staticmethod
    def _tensor_or_none(key: str, raw: bytes | None) -> Any:
        if raw is None:
            return None
        try:
            return _values.unpack_tensor(key, raw)
        except (MooncakeError, ValueError, TypeError, AttributeError) as exc:
            logger.error("get tensor %r: %s", key, exc)
            return None

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes of registered memory that hold a tensor as
        :meth:`get_tensor_into` left it (header, then data)."""
        return self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """:meth:`put_tensor_from`, replacing an existing object."""
        return self.upsert_from(key, buffer_ptr, size)

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`put_tensor_from` for many keys."""
        return self.batch_put_from(keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`upsert_tensor_from` for many keys."""
        return self.batch_upsert_from(keys, buffer_ptrs, sizes)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a tensor object into registered memory; returns a tensor that shares that
        memory (after the header), or None."""
        n = self.get_into(key, buffer_ptr, size)
        return None if n < 0 else self._tensor_at(key, int(buffer_ptr), n)

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[Any]:
        """:meth:`get_tensor_into` for many keys: per key a tensor or None."""
        res = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [
            None if n < 0 else self._tensor_at(k, int(p), n)
            for k, p, n in zip(keys, buffer_ptrs, res, strict=False)
        ]

    def _tensor_at(self, key: str, addr: int, n: int) -> Any:
        try:
            view = self._host(addr, n)
            meta, _ = _values.unpack(key, bytes(view[: min(n, 4096)]))
            import torch

            head = _values.HEADER.size + _values.HEADER.unpack_from(view)[1]
            dtype = getattr(torch, str(meta["dtype"]))
            if head == n:
                return torch.empty(meta["shape"], dtype=dtype)
            return torch.frombuffer(view[head:], dtype=dtype).reshape(meta["shape"])
        except (MooncakeError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
            logger.error("get_tensor_into %r: %s", key, exc)
            return None

    # Tensor parallelism: put_tensor_with_tp splits along split_dim into tp_size shards
    # stored as "<key>_tp_<rank>"; with tp_size <= 1 the whole tensor is stored under key.
    @staticmethod
    def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Store the ``tp_size`` shards of ``tensor`` (split along ``split_dim``)."""
        return self.batch_put_tensor_with_tp([key], [tensor], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """:meth:`put_tensor_with_tp` for many tensors; per key 0 or the first failure."""
        if len(base_keys) != len(tensors_list) or tp_size < 1:
            logger.error("batch_put_tensor_with_tp: bad arguments (tp_size %d)", tp_size)
            return [INVALID_PARAMS] * len(base_keys)
        keys: list[str] = []
        shards: list[Any] = []
        for key, tensor in zip(base_keys, tensors_list, strict=True):
            try:
                parts = [tensor] if tp_size == 1 else list(tensor.chunk(tp_size, split_dim))
            except (AttributeError, IndexError, RuntimeError, TypeError) as exc:
                logger.error("put_tensor_with_tp %r: %s", key, exc)
                parts = []
            if len(parts) != tp_size:
                return [INVALID_PARAMS] * len(base_keys)
            keys += [self._tp_key(key, r, tp_size) for r in range(tp_size)]
            shards += parts
        res = self.batch_put_tensor(keys, shards)
        return [
            next((rc for rc in res[i * tp_size : (i + 1) * tp_size] if rc), 0)
            for i in range(len(base_keys))
        ]

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """This rank's shard (or the whole tensor when ``tp_size`` <= 1), or None."""
        return self.get_tensor(self._tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        """:meth:`get_tensor_with_tp` for many keys."""
        return self.batch_get_tensor([self._tp_key(k, tp_rank, tp_size) for k in base_keys])

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

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Copy byte ranges of objects into registered buffers: for buffer ``i``, key
        ``all_keys[i][j]`` and range ``k``, ``all_sizes[i][j][k]`` bytes from offset
        ``all_src_offsets[i][j][k]`` of the object to ``buffer_ptrs[i] +
        all_dst_offsets[i][j][k]``. Per range: the bytes copied, -704 (missing key) or -600
        (range outside the object or the registered buffer; lists of unequal length)."""
        if not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets)) or not (
            len(all_keys) == len(all_src_offsets) == len(all_sizes)
        ):
            logger.error("get_into_ranges: the five lists differ in length")
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        wanted = sorted({k for keys in all_keys for k in keys})
        got = self._run("get_into_ranges", lambda c: c.get_batch(wanted)) if wanted else []
        if isinstance(got, int):
            return [[[got] * len(r) for r in dst] for dst in all_dst_offsets]
        objects = dict(zip(wanted, got, strict=True))
        out: list[list[list[int]]] = []
        for i, base in enumerate(buffer_ptrs):
            keys, dst, src, sizes = (
                all_keys[i],
                all_dst_offsets[i],
                all_src_offsets[i],
                all_sizes[i],
            )
            if not len(keys) == len(dst) == len(src) == len(sizes):
                logger.error("get_into_ranges: buffer %d: keys and ranges differ in length", i)
                out.append(
                    [
                        [INVALID_PARAMS] * (len(d) if j < len(dst) else 1)
                        for j, d in enumerate(dst[: len(keys)] or [[0]] * len(keys))
                    ]
                )
                continue
            row: list[list[int]] = []
            for key, d, s_, n in zip(keys, dst, src, sizes, strict=True):
                row.append(self._copy_ranges(key, objects.get(key), int(base), d, s_, n))
            out.append(row)
        return out

    def _copy_ranges(
        self,
        key: str,
        data: bytes | None,
        base: int,
        dst: list[int],
        src: list[int],
        sizes: list[int],
    ) -> list[int]:
        if not len(dst) == len(src) == len(sizes):
            logger.error("get_into_ranges %r: offsets and sizes differ in length", key)
            return [INVALID_PARAMS] * len(dst)
        if data is None:
            return [OBJECT_NOT_FOUND] * len(dst)
        res: list[int] = []
        for d, s_, n in zip(dst, src, sizes, strict=True):
            d, s_, n = int(d), int(s_), int(n)
            if n == 0:
                res.append(0)
                continue
            if d < 0 or s_ < 0 or n < 0 or s_ + n > len(data):
                logger.error("get_into_ranges %r: range %d+%d is outside the object", key, s_, n)
                res.append(INVALID_PARAMS)
                continue
            try:
                self._host(base + d, n)[:] = data[s_ : s_ + n]
            except (MooncakeError, ValueError) as exc:
                logger.error("get_into_ranges %r: %s", key, exc)
                res.append(_code(exc))
                continue
            res.append(n)
        return res

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
