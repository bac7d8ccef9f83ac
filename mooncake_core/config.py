"""One typed configuration object for every component.

Sources, highest precedence first:

1. keyword arguments to :func:`load_config` (``overrides``),
2. ``MOONCAKE_*`` environment variables: ``MOONCAKE_<KEY>`` for top-level keys
   (``MOONCAKE_PROTOCOL=tcp``) and ``MOONCAKE_<SECTION>_<FIELD>`` for section fields
   (``MOONCAKE_TRANSFER_SLICE_SIZE=1MiB``),
3. a Mooncake-style JSON file named by ``MOONCAKE_CONFIG_PATH`` (or ``path=``),
4. defaults.

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
]

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
    **overrides: Any,
) -> MooncakeConfig:
    """Build the configuration from file, environment and ``overrides``.

    Args:
        path: JSON file; defaults to ``$MOONCAKE_CONFIG_PATH`` when set.
        environ: environment to read (defaults to ``os.environ``).
        **overrides: highest-precedence values; sections may be given as dicts.

    Raises:
        ConfigError: a value is invalid; the message names the key.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
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
        data = _merge(data, loaded)
    from_env = _from_env(env)
    gid = env.get("MC_GID_INDEX", "").strip()  # Mooncake's name for the RDMA GID index
    if gid and "gid_index" not in from_env.get("transfer", {}):
        from_env.setdefault("transfer", {})["gid_index"] = gid
    data = _merge(data, from_env)
    data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
    cfg: MooncakeConfig = _build(MooncakeConfig, data, "")
    return cfg
