"""The published ``mooncake_master`` command line (gflags spellings) on an argparse parser.

The published master is a C++ program using gflags; an operator's command line for it
must run ``mooncake-core master`` unchanged. This module holds the published flag set
(names, types and defaults of Mooncake 0.3.13's ``mooncake_master --help``), and adds
each flag to an argparse parser with gflags syntax:

- ``--flag=v``, ``--flag v``, ``-flag=v``, ``-flag v``;
- booleans: ``--flag`` (true), ``--noflag`` (false), ``--flag=true|false|1|0|yes|no``;
- ``--flagfile=FILE``: one flag per line (``#`` comments), read where it appears;
- ``--fromenv=a,b`` / ``--tryfromenv=a,b``: values from ``FLAGS_a`` ... in the environment.

What a flag becomes is decided by :mod:`mooncake_core.cli.master`; here every flag has a
*kind*: ``map`` (we implement it), ``noop`` (accepted; a value other than the published
default logs one warning line saying it has no effect here) or ``off`` (a feature we do
not have: accepted at its published default, otherwise refused with one line naming it).

Given flags are collected, in command-line order, in the namespace attribute
``gflags_given`` (flag name -> raw string value).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_core.config import env_str, parse_bool
from mooncake_core.errors import ConfigError

__all__ = [
    "Flag",
    "MASTER_FLAGS",
    "GIVEN",
    "add_gflags",
    "given_flags",
    "parse_value",
    "parse_duration_ms",
    "read_flagfile",
    "read_config_file",
    "from_env",
]

GIVEN = "gflags_given"

_INT_RANGES = {
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint32": (0, (1 << 32) - 1),
    "uint64": (0, (1 << 64) - 1),
}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


@dataclass(frozen=True)
class Flag:
    """One published flag: gflags type, published default, kind and a note for users."""

    name: str
    type: str  # bool | int32 | int64 | uint32 | uint64 | double | string | duration
    default: str
    kind: str  # map | noop | off
    note: str = ""


def parse_duration_ms(raw: object, name: str) -> float:
    """``10000`` / ``"5s"`` / ``"250ms"`` / ``"2m"`` / ``"1h"`` -> milliseconds (as published).

    Raises:
        ConfigError: not such a duration; the message names ``--name``.
    """
    if isinstance(raw, bool):
        raise ConfigError(f"--{name}: expected milliseconds or a duration such as 5s, got {raw!r}")
    if isinstance(raw, (int, float)):
        if raw < 0:
            raise ConfigError(f"--{name}: must not be negative, got {raw!r}")
        return float(raw)
    m = _DURATION.match(str(raw))
    if not m:
        raise ConfigError(
            f"--{name}: expected milliseconds or a duration with ms, s, m or h "
            f"(e.g. 5000 or 5s), got {raw!r}"
        )
    return float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "").lower()]


def parse_value(flag: Flag, raw: object) -> Any:
    """Convert ``raw`` (a command-line string or a JSON value) to the flag's type.

    Raises:
        ConfigError: the value does not fit the type; the message names ``--flag``.
    """
    name = f"--{flag.name}"
    if flag.type == "bool":
        return parse_bool(raw if not isinstance(raw, str) else _gflags_bool(raw), name)
    if flag.type == "duration":
        return parse_duration_ms(raw, flag.name)
    if flag.type in _INT_RANGES:
        lo, hi = _INT_RANGES[flag.type]
        try:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            if isinstance(raw, str):
                text = raw.strip().lower()
                n = int(text, 16 if text.startswith(("0x", "-0x")) else 10)
            elif isinstance(raw, (int, float)):
                n = int(raw)
            else:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer ({flag.type}), got {raw!r}") from None
        if not lo <= n <= hi:
            raise ConfigError(f"{name}: {n} is out of range for {flag.type}")
        return n
    if flag.type == "double":
        try:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
    if isinstance(raw, (dict, list)) or isinstance(raw, bool):
        raise ConfigError(f"{name}: expected a string, got {raw!r}")
    return str(raw)


def _gflags_bool(raw: str) -> str:
    """gflags also spells booleans t/f/y/n."""
    return {"t": "true", "f": "false", "y": "yes", "n": "no"}.get(raw.strip().lower(), raw)


def _record(namespace: argparse.Namespace, name: str, value: str) -> None:
    given = dict(getattr(namespace, GIVEN, None) or {})
    given.pop(name, None)  # keep command-line order: the last occurrence counts
    given[name] = value
    setattr(namespace, GIVEN, given)


class _SetFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        _record(namespace, str(self.metavar or ""), str(values))


class _NoFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        _record(namespace, str(self.const), "false")


class _FlagFile(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        try:
            for name, value in read_flagfile(str(values)):
                _record(namespace, name, value)
        except ConfigError as exc:
            # Collected, raised by the command as one line (argparse would print its usage).
            namespace.gflags_error = str(exc)


def _flags_by_name(flags: Sequence[Flag]) -> dict[str, Flag]:
    return {f.name: f for f in flags}


def read_flagfile(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """The flags of a gflags flagfile: ``--name=value`` (or ``--name`` / ``--noname``) lines.

    Nested ``--flagfile=`` lines are read in place. Blank lines and ``#`` comments are
    skipped.

    Raises:
        ConfigError: unreadable file, a line that is not a flag, or an unknown flag name.
    """
    if depth > 8:
        raise ConfigError(f"--flagfile: {path!r}: flagfiles nested more than 8 deep")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--flagfile: cannot read {path!r}: {exc.strerror}") from None
    known = _flags_by_name(MASTER_FLAGS)
    out: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--flagfile {path}:{lineno}"
        if not line.startswith("-"):
            raise ConfigError(f"{where}: expected --flag=value, got {line!r}")
        body = line.lstrip("-")
        name, eq, value = body.partition("=")
        if name == "flagfile":
            out.extend(read_flagfile(value, depth + 1))
            continue
        if name not in known and name.startswith("no") and name[2:] in known and not eq:
            if known[name[2:]].type != "bool":
                raise ConfigError(f"{where}: --{name}: only boolean flags take the no prefix")
            out.append((name[2:], "false"))
            continue
        if name not in known:
            raise ConfigError(f"{where}: unknown flag --{name}")
        if not eq:
            if known[name].type != "bool":
                raise ConfigError(f"{where}: --{name} needs a value (--{name}=VALUE)")
            value = "true"
        out.append((name, value))
    return out


def read_config_file(path: str, aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The published master's ``--config_path`` file (JSON; YAML when PyYAML is installed).

    Keys are flag names (``aliases`` maps other published spellings onto them).

    Raises:
        ConfigError: unreadable or invalid file, or a key that is no published flag.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config_path: cannot read {path!r}: {exc.strerror}") from None
    data: Any
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError(
                f"--config_path: {path!r} is YAML and PyYAML is not installed; "
                "use a JSON file (master.json)"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config_path: {path!r} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--config_path: {path!r}: invalid JSON at line {exc.lineno}: {exc.msg}"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config_path: {path!r}: expected an object of flag names")
    known = _flags_by_name(MASTER_FLAGS)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = (aliases or {}).get(key, key)
        if name not in known:
            raise ConfigError(f"--config_path {path}: {key}: no such master flag")
        out[name] = value
    return out


def from_env(names: str, required: bool) -> list[tuple[str, str]]:
    """gflags' ``--fromenv`` / ``--tryfromenv``: values of ``FLAGS_<name>`` variables.

    Raises:
        ConfigError: an unknown flag name, or (``required``) an unset variable.
    """
    known = _flags_by_name(MASTER_FLAGS)
    option = "--fromenv" if required else "--tryfromenv"
    out: list[tuple[str, str]] = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        if name not in known:
            raise ConfigError(f"{option}: unknown flag {name!r}")
        value = env_str(f"FLAGS_{name}")
        if not value:
            if required:
                raise ConfigError(f"{option}: FLAGS_{name} is not set in the environment")
            continue
        out.append((name, value))
    return out


def given_flags(namespace: argparse.Namespace) -> dict[str, str]:
    """The gflags-spelled flags given on the command line, in order (name -> raw value).

    Raises:
        ConfigError: a ``--flagfile`` could not be read.
    """
    err = getattr(namespace, "gflags_error", None)
    if err:
        raise ConfigError(str(err))
    return dict(getattr(namespace, GIVEN, None) or {})


def add_gflags(
    parser: argparse.ArgumentParser,
    flags: Sequence[Flag],
    version: str,
    program: str = "mooncake_master",
) -> None:
    """Add ``flags`` to ``parser`` with gflags syntax (spellings it already has are skipped)."""
    group = parser.add_argument_group(
        f"published {program} flags",
        "gflags spellings (--flag=v, -flag v, --noflag); see docs/compat.md",
    )
    taken = set(parser._option_string_actions)

    def spellings(name: str) -> list[str]:
        return [s for s in (f"--{name}", f"-{name}") if s not in taken]

    for name in ("help", "helpfull", "helpshort", "helppackage"):  # gflags' help flags
        if spellings(name):
            group.add_argument(*spellings(name), action="help", help=argparse.SUPPRESS)
    for flag in flags:
        opts = spellings(flag.name)
        if not opts:
            continue
        if flag.name == "version":
            group.add_argument(*opts, action="version", version=version, help=argparse.SUPPRESS)
            continue
        if flag.name == "flagfile":
            group.add_argument(*opts, action=_FlagFile, metavar="FILE", help="gflags flagfile")
            continue
        shown = flag.kind == "map"
        help_ = f"{flag.type}, published default {flag.default!r}" if shown else argparse.SUPPRESS
        dest = f"gflag_{flag.name}"
        if flag.type == "bool":
            group.add_argument(
                *opts,
                action=_SetFlag,
                nargs="?",
                const="true",
                metavar=flag.name,
                dest=dest,
                default=argparse.SUPPRESS,
                help=help_,
            )
            no_opts = spellings(f"no{flag.name}")
            if no_opts:
                group.add_argument(
                    *no_opts,
                    action=_NoFlag,
                    nargs=0,
                    const=flag.name,
                    dest=dest,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )
        else:
            group.add_argument(
                *opts,
                action=_SetFlag,
                metavar=flag.name,
                dest=dest,
                default=argparse.SUPPRESS,
                help=help_,
            )


def _f(name: str, type_: str, default: str, kind: str, note: str = "") -> Flag:
    return Flag(name, type_, default, kind, note)


_NO_EFFECT_RPC = "the master serves RPC on one event loop"
_SNAPSHOT = "snapshots go to --snapshot_backup_dir only (local files; HA compacts its oplog)"
_KV_EVENTS = "not emitted on our events either"
_KV_COMPAT = "our events always carry both the vLLM fields and object_key"
_NOF = "NVMe-oF segments are not supported"
_OFFLOAD = "master-driven offload is not supported (clients have an SSD tier, store.ssd_path)"
_DYN = "dynamic replication is not supported"
_LOG = "logs go to stderr; use --log-level"
_TASKS = "the master runs no background task queue"

#: The published ``mooncake_master`` flags (Mooncake 0.3.13), with what each becomes here.
MASTER_FLAGS: tuple[Flag, ...] = (
    # --- RPC, HTTP, metadata
    _f("rpc_port", "int32", "0", "map"),
    _f("port", "int32", "50051", "map"),
    _f("rpc_address", "string", "0.0.0.0", "map"),
    _f("rpc_interface", "string", "", "map"),
    _f("rpc_thread_num", "int32", "0", "noop", _NO_EFFECT_RPC),
    _f("max_threads", "int32", "16", "noop", _NO_EFFECT_RPC),
    _f("rpc_conn_timeout_seconds", "int32", "0", "noop", "idle RPC connections are kept"),
    _f("rpc_enable_tcp_no_delay", "bool", "true", "noop", "TCP_NODELAY is always on"),
    _f("metrics_port", "int32", "9003", "map"),
    _f("metrics_host", "string", "0.0.0.0", "map"),
    _f("enable_metric_reporting", "bool", "true", "noop", "metrics are served on /metrics"),
    _f("enable_http_metadata_server", "bool", "false", "map"),
    _f("http_metadata_server_host", "string", "0.0.0.0", "map"),
    _f("http_metadata_server_port", "int32", "8080", "map"),
    _f(
        "enable_metadata_cleanup_on_timeout",
        "bool",
        "false",
        "off",
        "the master does not delete a timed-out client's metadata",
    ),
    _f("config_path", "string", "", "map"),
    # --- leases, eviction, allocation
    _f("default_kv_lease_ttl", "duration", "10000", "map"),
    _f("default_kv_soft_pin_ttl", "duration", "1800000", "noop", "clients set soft-pin TTLs"),
    _f("max_kv_soft_pin_ttl", "duration", "86400000", "noop", "soft-pin TTLs are not capped"),
    _f(
        "allow_evict_soft_pinned_objects",
        "bool",
        "true",
        "off",
        "soft-pinned objects may be evicted",
    ),
    _f("eviction_high_watermark_ratio", "double", "0.9", "map"),
    _f("eviction_ratio", "double", "0.05", "map"),
    _f("client_ttl", "int64", "10", "map"),
    _f("put_start_discard_timeout_sec", "uint64", "30", "map"),
    _f(
        "put_start_release_timeout_sec",
        "uint64",
        "600",
        "noop",
        "space of an unfinished put is freed at --put_start_discard_timeout_sec",
    ),
    _f("allocation_strategy", "string", "random", "map"),
    _f("memory_allocator", "string", "offset", "noop", "segments use our own offset allocator"),
    _f("quota_bytes", "uint64", "0", "noop", "there is no storage-backend quota"),
    # --- HA
    _f("enable_ha", "bool", "false", "map"),
    _f("etcd_endpoints", "string", "", "map"),
    _f("ha_backend_type", "string", "etcd", "map"),
    _f("ha_backend_connstring", "string", "", "map"),
    _f("cluster_id", "string", "mooncake_cluster", "map"),
    _f("enable_oplog", "bool", "false", "noop", "HA always replicates through its oplog"),
    _f("oplog_batch_max_entries", "uint32", "1024", "noop", "see --ha-snapshot-every"),
    _f("oplog_poll_interval_ms", "int32", "1000", "noop", "standbys watch the oplog"),
    _f("batch_oplog_retry_timeout_sec", "uint32", "180", "noop", "standbys watch the oplog"),
    _f("pod_name", "string", "", "noop", "there is no Kubernetes HA backend"),
    _f("pod_namespace", "string", "", "noop", "there is no Kubernetes HA backend"),
    # --- features we do not have
    _f("enable_cxl", "bool", "false", "off", "CXL memory is not supported"),
    _f("cxl_path", "string", "/dev/dax0.0", "noop", "CXL memory is not supported"),
    _f("cxl_size", "uint64", "8589934592", "noop", "CXL memory is not supported"),
    _f("enable_offload", "bool", "false", "off", _OFFLOAD),
    _f("offload_on_evict", "bool", "false", "off", _OFFLOAD),
    _f("offload_force_evict", "bool", "false", "noop", _OFFLOAD),
    _f("offload_cap_ratio", "double", "0.5", "noop", _OFFLOAD),
    _f("offloading_queue_limit", "uint64", "50000", "noop", _OFFLOAD),
    _f("promotion_on_hit", "bool", "false", "off", _OFFLOAD),
    _f("promotion_admission_threshold", "uint32", "2", "noop", _OFFLOAD),
    _f("promotion_max_per_heartbeat", "uint32", "1", "noop", _OFFLOAD),
    _f("promotion_queue_limit", "uint32", "50000", "noop", _OFFLOAD),
    _f("enable_disk_eviction", "bool", "true", "noop", _OFFLOAD),
    _f("root_fs_dir", "string", "", "off", "shared-filesystem DISK replicas are not supported"),
    _f("global_file_segment_size", "int64", "9223372036854775807", "noop", "no file segments"),
    _f("enable_snapshot", "bool", "false", "map"),
    _f("enable_snapshot_restore", "bool", "false", "map"),
    _f("snapshot_backup_dir", "string", "", "map"),
    _f("snapshot_catalog_backend_connstring", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_catalog_backend_type", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_catalog_store_connstring", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_catalog_store_type", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_child_timeout_seconds", "uint64", "300", "noop", _SNAPSHOT),
    _f("snapshot_interval_seconds", "uint64", "600", "map"),
    _f("snapshot_object_store_type", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_payload_backend_type", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_payload_store_type", "string", "", "noop", _SNAPSHOT),
    _f("snapshot_retention_count", "uint32", "2", "map"),
    _f("enable_kv_events", "bool", "false", "map"),
    _f("kv_events_additional_salt", "string", "", "noop", _KV_EVENTS),
    _f("kv_events_backend_id", "string", "", "map"),
    _f("kv_events_bind_endpoint", "string", "", "map"),
    _f("kv_events_block_size", "uint32", "0", "noop", _KV_EVENTS),
    _f("kv_events_dp_rank", "uint32", "0", "noop", _KV_EVENTS),
    _f("kv_events_emit_legacy_compat", "bool", "true", "noop", _KV_COMPAT),
    _f("kv_events_emit_object_key", "bool", "true", "noop", _KV_COMPAT),
    _f("kv_events_lora_name", "string", "", "noop", _KV_EVENTS),
    _f("kv_events_model_name", "string", "", "noop", _KV_EVENTS),
    _f("kv_events_queue_capacity", "uint32", "65536", "map"),
    _f("kv_events_tenant_id", "string", "default", "noop", _KV_EVENTS),
    _f("enable_multi_tenants", "bool", "false", "map"),
    _f("tenant_quota_connector_type", "string", "file", "map"),
    _f("tenant_quota_connector_uri", "string", "", "map"),
    _f("dynamic_replication_mode", "string", "off", "off", _DYN),
    _f("dynamic_replication_admission_qps_threshold", "double", "0.8", "noop", _DYN),
    _f("dynamic_replication_heat_window_seconds", "uint32", "10", "noop", _DYN),
    _f("dynamic_replication_max_memory_replicas", "uint64", "2", "noop", _DYN),
    _f("nof_eviction_high_watermark_ratio", "double", "0.9", "noop", _NOF),
    _f("nof_eviction_ratio", "double", "0.05", "noop", _NOF),
    _f("nof_heartbeat_failures_threshold", "uint32", "3", "noop", _NOF),
    _f("nof_heartbeat_interval_sec", "int64", "10", "noop", _NOF),
    _f("nof_heartbeat_probe_timeout_ms", "uint32", "1000", "noop", _NOF),
    _f("max_retry_attempts", "uint32", "10", "noop", _TASKS),
    _f("max_total_finished_tasks", "uint32", "10000", "noop", _TASKS),
    _f("max_total_pending_tasks", "uint32", "10000", "noop", _TASKS),
    _f("max_total_processing_tasks", "uint32", "10000", "noop", _TASKS),
    _f("pending_task_timeout_sec", "uint64", "300", "noop", _TASKS),
    _f("processing_task_timeout_sec", "uint64", "300", "noop", _TASKS),
    _f("mmap_arena_pool_size", "uint64", "8589934592", "noop", "no mmap arena allocator"),
    _f("use_mmap_arena_allocator", "bool", "false", "noop", "no mmap arena allocator"),
    # --- gflags' own
    _f("flagfile", "string", "", "map"),
    _f("fromenv", "string", "", "map"),
    _f("tryfromenv", "string", "", "map"),
    _f("undefok", "string", "", "off", "every published flag is known here"),
    _f("version", "bool", "false", "map"),
    _f("tab_completion_columns", "int32", "80", "noop", "no tab completion"),
    _f("tab_completion_word", "string", "", "noop", "no tab completion"),
    # --- glog
    _f("minloglevel", "int32", "0", "map"),
    _f("v", "int32", "0", "map"),
    _f("vmodule", "string", "", "noop", _LOG),
    _f("logtostderr", "bool", "false", "noop", _LOG),
    _f("alsologtostderr", "bool", "false", "noop", _LOG),
    _f("colorlogtostderr", "bool", "false", "noop", _LOG),
    _f("stderrthreshold", "int32", "2", "noop", _LOG),
    _f("log_dir", "string", "", "noop", _LOG),
    _f("log_link", "string", "", "noop", _LOG),
    _f("log_prefix", "bool", "true", "noop", _LOG),
    _f("logbuflevel", "int32", "0", "noop", _LOG),
    _f("logbufsecs", "int32", "30", "noop", _LOG),
    _f("logfile_mode", "int32", "436", "noop", _LOG),
    _f("max_log_size", "int32", "1800", "noop", _LOG),
    _f("stop_logging_if_full_disk", "bool", "false", "noop", _LOG),
    _f("drop_log_memory", "bool", "true", "noop", _LOG),
    _f("log_backtrace_at", "string", "", "noop", _LOG),
    _f("symbolize_stacktrace", "bool", "true", "noop", _LOG),
    _f("alsologtoemail", "string", "", "noop", _LOG),
    _f("logemaillevel", "int32", "999", "noop", _LOG),
    _f("logmailer", "string", "/bin/mail", "noop", _LOG),
)
