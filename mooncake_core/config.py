"""One typed configuration object for every component.

Sources, highest precedence first:

1. keyword arguments to :func:`load_config` (``overrides``),
2. ``MOONCAKE_*`` environment variables: ``MOONCAKE_<KEY>`` for top-level keys
   (``MOONCAKE_PROTOCOL=tcp``) and ``MOONCAKE_<SECTION>_<FIELD>`` for section fields
   (``MOONCAKE_TRANSFER_SLICE_SIZE=1MiB``),
3. a Mooncake-style JSON file named by ``MOONCAKE_CONFIG_PATH`` (or ``path=``),
4. defaults.

The published package's environment names work too (:data:`PUBLISHED_ENV`):
``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_DEVICE``, the offload
pair, and the ``MC_*`` variables its docs list. Each is either honoured (mapped onto a
key, below our own ``MOONCAKE_<KEY>`` name) or refused with one warning line naming it;
none is silently ignored. Published protocol names we have no transport for (``efa``,
``nvlink``, ...) are mapped, with a warning, onto one we have.

Top-level keys mirror the published ``mooncake.json``: ``local_hostname``,
``metadata_server``, ``protocol``, ``device_name``, ``master_server_address``,
``global_segment_size``, ``local_buffer_size``. Sizes may be ints or strings such as
``"4GB"``, ``"512 MiB"``, ``"3.125GiB"`` (K/M/G/T are powers of 1024 either way, as in
Mooncake). A bad value raises :class:`~mooncake_core.errors.ConfigError` whose one-line
message names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_core.errors import ConfigError

__all__ = [
    "MooncakeConfig",
    "TransferConfig",
    "MetadataConfig",
    "StoreConfig",
    "LogConfig",
    "load_config",
    "parse_size",
    "format_size",
    "parse_bool",
    "env_flag",
    "env_str",
    "env_list",
    "environment",
    "PUBLISHED_ENV",
    "published_env",
    "normalize_protocol",
    "published_file_keys",
]

logger = logging.getLogger(__name__)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(value: object, key: str = "size") -> int:
    """Parse ``4GB`` / ``"512 MiB"`` / ``1048576`` into bytes; ``key`` names it in errors."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size such as 4GB or 1048576, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"{key}: cannot parse size {value!r} (use e.g. 4GB, 512MiB, 1048576)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{key}: expected a size such as 4GB or 1048576, got {value!r}")
    if n < 0:
        raise ConfigError(f"{key}: size must not be negative, got {value!r}")
    return n


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_bool(value: object, key: str) -> bool:
    """The one boolean parser: ``True``/``False``, 1/true/yes/on or 0/false/no/off (any case).

    Raises:
        ConfigError: anything else; the message names ``key``.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        word = str(value).strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE and word:
            return False
    raise ConfigError(f"{key}: expected true/false (1/yes/on or 0/no/off), got {value!r}")


def environment(environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """The environment to read: ``environ`` when given, else the process's.

    This module is the only place that reads ``os.environ``; every other module asks
    through :func:`env_flag`, :func:`env_str`, :func:`env_list` or :func:`load_config`.
    """
    return os.environ if environ is None else environ


def env_str(name: str, default: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The value of environment variable ``name``, stripped (``default`` when unset or blank)."""
    value = environment(environ).get(name, "").strip()
    return value or default


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean environment flag: 1/true/yes/on or 0/false/no/off (any case).

    Raises:
        ConfigError: the value is none of those; the message names the variable.
    """
    raw = environment(environ).get(name)
    if raw is None or not raw.strip():
        return default
    return parse_bool(raw, name)


def env_list(name: str, sep: str = ",", environ: Mapping[str, str] | None = None) -> list[str]:
    """A ``sep``-separated list from environment variable ``name`` (blank items dropped)."""
    return [item.strip() for item in env_str(name, "", environ).split(sep) if item.strip()]


def format_size(n: float) -> str:
    """Human-readable binary size: ``format_size(3 << 20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Size(int):
    """Marker type: an int field parsed with :func:`parse_size`."""


@dataclass(frozen=True)
class TransferConfig:
    """Transfer-engine knobs (section ``transfer``)."""

    listen_host: str = "127.0.0.1"
    port: int = 0
    slice_size: Size = Size(4 << 20)
    connections_per_peer: int = 2
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    retry_count: int = 3
    retry_backoff_s: float = 0.02
    secret: str = ""
    shm: bool = True
    spin_us: float = (
        100.0  # TCP: poll this long for a peer's answer before sleeping (0 = never spin)
    )
    shm_dir: str = (
        ""  # "" = memfd; else a tmpfs directory for shared segments (huge=always: 2 MiB pages)
    )
    shm_copy_threads: int = (
        0  # shared-memory copies of >= 2 MiB are split over this many threads (0: min(4, CPUs))
    )
    interfaces: str = ""
    stripe_interfaces: bool = False
    gid_index: int = 0  # RDMA: GID index of the port (also MC_GID_INDEX, as in Mooncake)
    metrics_port: int = -1  # >= 0: serve this process's /metrics there (0 = any port)
    metrics_host: str = "127.0.0.1"  # where that /metrics listens


@dataclass(frozen=True)
class MetadataConfig:
    """Metadata-backend knobs (section ``metadata``)."""

    prefix: str = "mooncake"
    ttl_s: float = 10.0
    http_host: str = "127.0.0.1"
    http_port: int = 8080


@dataclass(frozen=True)
class StoreConfig:
    """Store knobs (section ``store``)."""

    replica_num: int = 1
    lease_ttl_s: float = 10.0
    eviction_high_watermark: float = 0.9
    eviction_ratio: float = 0.05
    heartbeat_interval_s: float = 1.0
    client_ttl_s: float = 5.0
    put_timeout_s: float = 30.0
    ssd_path: str = ""
    placement: str = "free-ratio-first"
    max_objects: int = (
        2_000_000  # metadata cap: puts beyond it evict LRU objects (bounds the master's memory)
    )
    rpc_spin_us: float = 100.0  # clients spin this long for a master answer before sleeping
    client_reservations: bool = (
        True  # puts up to 4 MiB allocate from a lent extent: one master RPC per put
    )
    location_cache: int = (
        4096  # keys whose last replica a client remembers: their gets read while asking (0: off)
    )
    early_commit: bool = True  # one-RPC puts send the commit with the write (masters without HA)
    suspect_on_disconnect: bool = (
        True  # master: a holder whose heartbeat connection closed gets no new objects until heard
    )
    # hot keys and tier moves (mooncake_core.store.hotkeys, docs/store.md)
    hot_key_replicas: int = 0  # most memory replicas of a hot key, the first included (0/1: off)
    hot_key_reads: int = 64  # reads within the window that make a key hot (cools below half)
    hot_key_window_s: float = 2.0
    hot_key_max_bytes: int = 256 << 20  # all extra hot-key replicas together
    ssd_promote_after: int = 2  # reads within the window before an SSD object stays in memory
    ssd_promote_window_s: float = 30.0
    ssd_offload_queue: int = 256 << 20  # bytes of SSD offloads in flight; beyond, eviction drops


@dataclass(frozen=True)
class LogConfig:
    """Logging knobs (section ``log``)."""

    level: str = "INFO"


@dataclass(frozen=True)
class MooncakeConfig:
    """The whole configuration; top-level fields are the published mooncake.json keys."""

    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    master_server_address: str = "127.0.0.1:50051"
    global_segment_size: Size = Size(512 << 20)
    local_buffer_size: Size = Size(128 << 20)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def replace(self, **changes: Any) -> MooncakeConfig:
        """Return a copy with ``changes`` applied (section values may be dicts)."""
        cfg: MooncakeConfig = _build(MooncakeConfig, _merge(dataclasses.asdict(self), changes), "")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PROTOCOLS = {"tcp", "shm", "rdma", "auto"}
_SECTIONS = {"transfer", "metadata", "store", "log"}


def _merge(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in changes.items():
        if k in _SECTIONS and isinstance(v, Mapping):
            sub = dict(out.get(k) or {})
            sub.update(v)
            out[k] = sub
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[k] = dataclasses.asdict(v)
        else:
            out[k] = v
    return out


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"{where}{key}: unknown config key{hint}")


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if typ is Size:
        return Size(parse_size(value, key))
    if typ is bool:
        if isinstance(value, bool):
            return value
        return parse_bool(value, key)
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown(key, names, where)
        typ = hints[key]
        if isinstance(typ, types.UnionType):  # pragma: no cover - not used yet
            typ = typing.get_args(typ)[0]
        if cls is MooncakeConfig and key == "protocol" and isinstance(value, str):
            value = normalize_protocol(value)
        if dataclasses.is_dataclass(typ):
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{where}{key}: expected an object with section keys, got {value!r}"
                )
            kwargs[key] = _build(typ, value, f"{where}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{where}{key}")
    cfg = cls(**kwargs)
    _validate(cfg, where)
    return cfg


def _validate(cfg: Any, where: str) -> None:
    if isinstance(cfg, MooncakeConfig):
        proto = cfg.protocol.lower()
        if proto not in _PROTOCOLS:
            raise ConfigError(
                f"protocol: unknown protocol {cfg.protocol!r} (use one of {sorted(_PROTOCOLS)})"
            )
        if not cfg.local_hostname:
            raise ConfigError("local_hostname: must not be empty")
    elif isinstance(cfg, TransferConfig):
        if not 0 <= cfg.shm_copy_threads <= 64:
            raise ConfigError(
                f"{where}shm_copy_threads: must be 0..64 (0 = automatic), "
                f"got {cfg.shm_copy_threads}"
            )
        if cfg.slice_size < 4096:
            raise ConfigError(
                f"{where}slice_size: must be at least 4096 bytes, got {cfg.slice_size}"
            )
        if not 1 <= cfg.connections_per_peer <= 64:
            raise ConfigError(
                f"{where}connections_per_peer: must be 1..64, got {cfg.connections_per_peer}"
            )
        if cfg.timeout_s <= 0:
            raise ConfigError(f"{where}timeout_s: must be positive, got {cfg.timeout_s}")
        if cfg.retry_count < 0:
            raise ConfigError(f"{where}retry_count: must be >= 0, got {cfg.retry_count}")
        if not 0 <= cfg.port <= 65535:
            raise ConfigError(f"{where}port: must be 0..65535, got {cfg.port}")
        if not 0 <= cfg.spin_us <= 100_000:
            raise ConfigError(f"{where}spin_us: must be 0..100000, got {cfg.spin_us}")
    elif isinstance(cfg, StoreConfig):
        if cfg.replica_num < 1:
            raise ConfigError(f"{where}replica_num: must be >= 1, got {cfg.replica_num}")
        if not 0 < cfg.eviction_high_watermark <= 1:
            raise ConfigError(
                f"{where}eviction_high_watermark: must be in (0, 1], "
                f"got {cfg.eviction_high_watermark}"
            )
        if not 0 < cfg.eviction_ratio <= 1:
            raise ConfigError(f"{where}eviction_ratio: must be in (0, 1], got {cfg.eviction_ratio}")
        if cfg.max_objects < 1:
            raise ConfigError(f"{where}max_objects: must be at least 1, got {cfg.max_objects}")
        if cfg.location_cache < 0:
            raise ConfigError(
                f"{where}location_cache: must not be negative, got {cfg.location_cache}"
            )
        if not 0 <= cfg.rpc_spin_us <= 100_000:
            raise ConfigError(f"{where}rpc_spin_us: must be 0..100000, got {cfg.rpc_spin_us}")
    elif isinstance(cfg, LogConfig):
        if cfg.level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ConfigError(f"{where}level: unknown log level {cfg.level!r}")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


# Published protocol names without a transport of the same name here -> ours.
_PROTOCOL_ALIASES = {
    "efa": "rdma",
    "barex": "rdma",
    "erdma": "rdma",
    "nvlink": "auto",
    "nvlink_intra": "auto",
    "mnnvl": "auto",
    "hip": "auto",
    "musa": "auto",
    "ascend": "auto",
    "ubshmem": "auto",
    "cxl": "auto",
    "nvmeof": "auto",
}


def normalize_protocol(value: str) -> str:
    """A protocol name, published spellings mapped onto ours (one warning line each).

    ``efa``/``barex``/``erdma`` run on our RDMA transport; GPU-interconnect and device
    protocols (``nvlink``, ``hip``, ``ascend``, ...) on ``auto`` (shared memory, RDMA or
    TCP, whichever reaches the peer). Unknown names are left for validation to refuse.
    """
    word = value.strip().lower()
    ours = _PROTOCOL_ALIASES.get(word)
    if ours is None:
        return word if word in _PROTOCOLS else value
    _warn_once(f"protocol {value!r}: mooncake-core has no such transport; using {ours!r} instead")
    return ours


_RDMA_TUNING = "our RDMA transport sizes its queues itself"
_NOT_HERE = "not supported by mooncake-core"

#: Published environment variable -> (our config key, or "" when refused; meaning/reason).
#: Honoured ones sit below our own ``MOONCAKE_<KEY>`` names.
PUBLISHED_ENV: Mapping[str, tuple[str, str]] = {
    "MOONCAKE_MASTER": ("master_server_address", "master address (host:port or etcd://...)"),
    "MOONCAKE_TE_META_DATA_SERVER": ("metadata_server", "metadata server URL or P2PHANDSHAKE"),
    "MOONCAKE_DEVICE": ("device_name", "RDMA device names"),
    "MOONCAKE_OFFLOAD_ENABLED": ("store.ssd_path", "with the path below: the client SSD tier"),
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": ("store.ssd_path", "directory of the client SSD tier"),
    "MC_METADATA_SERVER": ("metadata_server", "metadata server (below the two names above)"),
    "MC_TRANSFER_TIMEOUT": ("transfer.timeout_s", "transfer timeout in seconds"),
    "MC_TCP_BIND_ADDRESS": ("transfer.listen_host", "address the transfer listener binds"),
    "MC_GID_INDEX": ("transfer.gid_index", "RDMA GID index"),
    "MC_SLICE_SIZE": ("transfer.slice_size", "bytes per transfer slice"),
    "MC_RETRY_CNT": ("transfer.retry_count", "retries of a failed slice"),
    "MC_LOG_LEVEL": ("log.level", "log level (TRACE means DEBUG)"),
    "MC_FORCE_TCP": ("protocol", "true: use the TCP transport"),
    "MOONCAKE_TENANT_ID": ("", "tenants are not supported"),
    "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": ("", "there is no client HTTP server"),
    "MOONCAKE_CLIENT_HTTP_PORT": ("", "there is no client HTTP server"),
    "MOONCAKE_SNAPSHOT_LOCAL_PATH": ("", "published master snapshots are not supported"),
    "MOONCAKE_STORE_CHECKSUM": ("", "store checksums are not supported"),
    "MOONCAKE_DFS_FS_ADAPTER": ("", "DFS/3FS segments are not supported"),
    "MOONCAKE_DFS_ROOT_DIR": ("", "DFS/3FS segments are not supported"),
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": ("", "offload tuning is not supported"),
    "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": ("", "offload tuning is not supported"),
    "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": ("", "offload tuning is not supported"),
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": ("", "offload tuning is not supported"),
    "MC_LEGACY_RPC_PORT_BINDING": ("", "handshake ports are always the engine's own"),
    "MC_RDMA_BIND_ADDRESS": ("", "the RDMA address is the handshake address"),
    "MC_CUSTOM_TOPO_JSON": ("", "set transfer.interfaces instead"),
    "MC_TE_FILTERS": ("", "set transfer.interfaces instead"),
    "MC_TE_FILTERS_EXCLUDE": ("", "set transfer.interfaces instead"),
    "MC_TE_METRIC": ("", "transfer metrics are not reported periodically"),
    "MC_TE_METRIC_INTERVAL_SECONDS": ("", "transfer metrics are not reported periodically"),
    "MC_FORCE_HCA": ("", _NOT_HERE),
    "MC_FORCE_MNNVL": ("", "there is no MNNVL transport"),
    "MC_FORCE_MUSA": ("", "there is no MUSA transport"),
    "MC_INTRA_NVLINK": ("", "there is no NVLink transport"),
    "MC_TCP_SLICE_SIZE": ("", "TCP moves whole slices (MC_SLICE_SIZE)"),
    "MC_TCP_ENABLE_CONNECTION_POOL": ("", "set transfer.connections_per_peer instead"),
    "MC_TCP_PROTO": ("", "there is one TCP protocol, acknowledged writes"),
    "MC_REDIS_PASSWORD": ("", "there is no Redis metadata backend"),
    "MC_REDIS_DB_INDEX": ("", "there is no Redis metadata backend"),
    "MC_MIN_RPC_PORT": ("transfer.port", "low end of the compat engine's handshake ports"),
    "MC_MAX_RPC_PORT": ("transfer.port", "high end of the compat engine's handshake ports"),
    "MC_METADATA_CLUSTER_ID": ("", "set metadata.prefix instead"),
    "MC_DISABLE_METACACHE": ("", _NOT_HERE),
    "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS": ("", _NOT_HERE),
    "MC_PATH_ROUNDROBIN": ("", _NOT_HERE),
    "MC_ENABLE_DEST_DEVICE_AFFINITY": ("", _NOT_HERE),
    "MC_FRAGMENT_RATIO": ("", _NOT_HERE),
    "MC_WORKERS_PER_CTX": ("", _RDMA_TUNING),
    "MC_NUM_QP_PER_EP": ("", _RDMA_TUNING),
    "MC_MAX_WR": ("", _RDMA_TUNING),
    "MC_MAX_SGE": ("", _RDMA_TUNING),
    "MC_MAX_CQE_PER_CTX": ("", _RDMA_TUNING),
    "MC_MTU": ("", _RDMA_TUNING),
    "MC_IB_PORT": ("", _RDMA_TUNING),
    "MC_IB_TC": ("", _RDMA_TUNING),
    "MC_IB_SL": ("", _RDMA_TUNING),
    "MC_MAX_EP_PER_CTX": ("", _RDMA_TUNING),
    "MC_ENDPOINT_STORE_TYPE": ("", _RDMA_TUNING),
    "MC_AUTO_GID_MAX_RETRIES": ("", _RDMA_TUNING),
    "MC_PKEY_INDEX": ("", _RDMA_TUNING),
    "MC_NUM_CQ_PER_CTX": ("", _RDMA_TUNING),
    "MC_NUM_COMP_CHANNELS_PER_CTX": ("", _RDMA_TUNING),
    "MC_MAX_INLINE": ("", _RDMA_TUNING),
    "MC_TRACK_RDMA_POSTED_SLICES": ("", _RDMA_TUNING),
    "MC_ENABLE_PARALLEL_REG_MR": ("", _RDMA_TUNING),
    "MC_MAX_CONCURRENT_REG_MR": ("", _RDMA_TUNING),
    "MC_HANDSHAKE_CONNECT_TIMEOUT": ("", "set transfer.connect_timeout_s instead"),
    "MC_HANDSHAKE_LISTEN_BACKLOG": ("", _NOT_HERE),
    "MC_HANDSHAKE_MAX_LENGTH": ("", _NOT_HERE),
    "MC_USE_TENT": ("", "there is one engine here (no TENT runtime)"),
    "MC_USE_TEV1": ("", "there is one engine here (no TENT runtime)"),
    "MC_TENT_CONF": ("", "there is one engine here (no TENT runtime)"),
    "MC_LOG_DIR": ("", "logs go to stderr"),
    "MC_YLT_LOG_LEVEL": ("", "use MC_LOG_LEVEL or MOONCAKE_LOG_LEVEL"),
    "MC_EFA_NIC_SELECTION": ("", "there is no EFA transport (efa runs on RDMA)"),
    "MC_EFA_CQ_THREADS": ("", "there is no EFA transport (efa runs on RDMA)"),
    "MC_RPC_PROTOCOL": ("", "store RPC runs over TCP"),
    "MC_RPC_TIMEOUT_MS": ("", "set transfer.timeout_s instead"),
    "MC_RPC_CONNECT_TIMEOUT_MS": ("", "set transfer.connect_timeout_s instead"),
    "MC_MS_AUTO_DISC": ("", _NOT_HERE),
    "MC_MS_FILTERS": ("", _NOT_HERE),
    "MC_STORE_MEMCPY": ("", "local replicas are always copied in memory"),
    "MC_STORE_CLIENT_SETUP_RETRIES": ("", _NOT_HERE),
    "MC_STORE_CLUSTER_ID": ("", "give the cluster in master_server_address"),
    "MC_STORE_CLIENT_MIN_PORT": ("transfer.port", "low end of the compat store's client ports"),
    "MC_STORE_CLIENT_MAX_PORT": ("transfer.port", "high end of the compat store's client ports"),
    "MC_CXL_DEV_SIZE": ("", "CXL memory is not supported"),
    "MC_MMAP_ARENA_POOL_SIZE": ("", "there is no mmap arena allocator"),
    "MC_STORE_USE_HUGEPAGE": ("", "set transfer.shm_dir to a hugetlbfs directory instead"),
    "MC_STORE_HUGEPAGE_SIZE": ("", "set transfer.shm_dir to a hugetlbfs directory instead"),
    "MC_STORE_PIN_MEMORY_MAX_BYTES": ("", _NOT_HERE),
    "MC_STORE_LOCAL_HOT_CACHE_SIZE": ("", _NOT_HERE),
    "MC_STORE_REPLICA_SCORING": ("", _NOT_HERE),
    "MC_STORE_CLIENT_METRIC": ("", "client metrics are not reported periodically"),
    "MC_STORE_CLIENT_METRIC_INTERVAL": ("", "client metrics are not reported periodically"),
}
_LOG_ALIASES = {"TRACE": "DEBUG", "WARN": "WARNING", "FATAL": "CRITICAL"}


def published_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The published package's variables in ``environ``: config values, and refusal lines.

    Returns ``(values, notes)``: ``values`` in :func:`load_config`'s shape (top-level keys
    and section dicts), ``notes`` one line per variable that is set and not honoured
    (listed in :data:`PUBLISHED_ENV` as refused, or any other ``MC_*`` name).

    Raises:
        ConfigError: an honoured variable has a bad value; the message names it.
    """
    out: dict[str, Any] = {}
    notes: list[str] = []

    def get(name: str) -> str:
        return environ.get(name, "").strip()

    def put(key: str, value: Any) -> None:
        section, dot, name = key.partition(".")
        if dot:
            out.setdefault(section, {})[name] = value
        else:
            out[key] = value

    for name in ("MC_METADATA_SERVER", "MOONCAKE_TE_META_DATA_SERVER"):  # later wins
        if get(name):
            put("metadata_server", get(name))
    if get("MOONCAKE_MASTER"):
        put("master_server_address", get("MOONCAKE_MASTER"))
    if get("MOONCAKE_DEVICE"):
        put("device_name", get("MOONCAKE_DEVICE"))
    if get("MOONCAKE_OFFLOAD_ENABLED"):
        path = get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")
        if parse_bool(get("MOONCAKE_OFFLOAD_ENABLED"), "MOONCAKE_OFFLOAD_ENABLED"):
            if not path:
                raise ConfigError(
                    "MOONCAKE_OFFLOAD_ENABLED: needs MOONCAKE_OFFLOAD_FILE_STORAGE_PATH "
                    "(the SSD tier's directory)"
                )
            put("store.ssd_path", path)
    elif get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"):
        notes.append(
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH is set but MOONCAKE_OFFLOAD_ENABLED is not; "
            "the SSD tier stays off"
        )
    for name, key in (
        ("MC_TRANSFER_TIMEOUT", "transfer.timeout_s"),
        ("MC_TCP_BIND_ADDRESS", "transfer.listen_host"),
        ("MC_GID_INDEX", "transfer.gid_index"),
        ("MC_SLICE_SIZE", "transfer.slice_size"),
        ("MC_RETRY_CNT", "transfer.retry_count"),
    ):
        if get(name):
            put(key, get(name))
    if get("MC_LOG_LEVEL"):
        level = get("MC_LOG_LEVEL").upper()
        put("log.level", _LOG_ALIASES.get(level, level))
    if get("MC_FORCE_TCP") and parse_bool(get("MC_FORCE_TCP"), "MC_FORCE_TCP"):
        put("protocol", "tcp")
    for name in sorted(environ):
        if not get(name):
            continue
        key, reason = PUBLISHED_ENV.get(name, ("?", ""))
        if key == "":
            notes.append(f"{name} is set but not supported by mooncake-core ({reason}); ignored")
        elif key == "?" and name.startswith("MC_"):
            notes.append(f"{name} is set but mooncake-core does not know it; ignored")
    return out, notes


#: Published mooncake.json keys that are not ours: refused ones, with the reason.
_PUBLISHED_FILE_REFUSED = {
    "tenant_id": "tenants are not supported",
    "enable_client_http_server": "there is no client HTTP server",
    "client_http_port": "there is no client HTTP server",
    "storage_root_dir": "DFS/3FS segments are not supported",
    "prefer_local_alloc": "set store.placement to local-first instead",
    "save_chunk_meta": "an LMCache option, not a store one",
    "prefill_url": "a legacy PD-pipe key",
    "decode_url": "a legacy PD-pipe key",
    "metadata_backend": "a legacy PD-pipe key (set metadata_server)",
}


def published_file_keys(loaded: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """A published ``mooncake.json`` in our terms: its extra keys honoured or refused.

    ``enable_ssd_offload`` + ``ssd_offload_path`` -> ``store.ssd_path``;
    ``transfer_timeout`` (seconds) -> ``transfer.timeout_s``; the keys in
    ``_PUBLISHED_FILE_REFUSED`` are dropped with one line each (``notes``).
    Everything else is left for validation (unknown keys stay errors).
    """
    out = dict(loaded)
    notes: list[str] = []
    enabled = out.pop("enable_ssd_offload", None)
    path = out.pop("ssd_offload_path", None)
    if enabled is not None and parse_bool(enabled, f"{where}: enable_ssd_offload"):
        if not path:
            raise ConfigError(f"{where}: enable_ssd_offload needs ssd_offload_path")
        out["store"] = {**dict(out.get("store") or {}), "ssd_path": path}
    elif path:
        notes.append(f"{where}: ssd_offload_path without enable_ssd_offload; SSD tier off")
    if "transfer_timeout" in out:
        out["transfer"] = {
            **dict(out.get("transfer") or {}),
            "timeout_s": out.pop("transfer_timeout"),
        }
    for key, reason in _PUBLISHED_FILE_REFUSED.items():
        if key in out:
            value = out.pop(key)
            if key == "tenant_id" and value in ("", "default"):
                continue
            notes.append(f"{where}: {key} is not supported by mooncake-core ({reason}); ignored")
    return out, notes


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    top = {f.name for f in dataclasses.fields(MooncakeConfig)} - _SECTIONS
    for f in dataclasses.fields(MooncakeConfig):
        if f.name in _SECTIONS:
            sect_cls = typing.get_type_hints(MooncakeConfig)[f.name]
            for sf in dataclasses.fields(sect_cls):
                env = f"MOONCAKE_{f.name.upper()}_{sf.name.upper()}"
                if env in environ:
                    out.setdefault(f.name, {})[sf.name] = environ[env]
    for name in top:
        env = f"MOONCAKE_{name.upper()}"
        if env in environ:
            out[name] = environ[env]
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> MooncakeConfig:
    """Build the configuration from file, environment and ``overrides``.

    Args:
        path: JSON file; defaults to ``$MOONCAKE_CONFIG_PATH`` when set.
        environ: environment to read (defaults to ``os.environ``).
        defaults: lowest-precedence values, below the file (e.g. the published master's
            defaults under its command line); sections may be given as dicts.
        **overrides: highest-precedence values; sections may be given as dicts.

    Raises:
        ConfigError: a value is invalid; the message names the key.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = _merge({}, defaults) if defaults else {}
    file = path if path is not None else env.get("MOONCAKE_CONFIG_PATH")
    if file:
        p = Path(file)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(
                f"MOONCAKE_CONFIG_PATH: cannot read {str(p)!r}: {exc.strerror}"
            ) from None
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a JSON object at the top level")
        loaded, notes = published_file_keys(loaded, str(p))
        for note in notes:
            _warn_once(note)
        data = _merge(data, loaded)
    published, notes = published_env(env)  # the published package's names, below ours
    for note in notes:
        _warn_once(note)
    data = _merge(data, published)
    data = _merge(data, _from_env(env))
    data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
    cfg: MooncakeConfig = _build(MooncakeConfig, data, "")
    return cfg
