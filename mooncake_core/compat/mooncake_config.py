"""``mooncake.mooncake_config`` drop-in: the published ``MooncakeConfig`` loader.

Same fields, defaults and rules as the published module (0.3.13): ``from_file(path)``
reads a JSON file, ``load_from_env()`` reads ``MOONCAKE_CONFIG_PATH`` (a file) or, without
it, the ``MOONCAKE_MASTER`` / ``MOONCAKE_*`` variables. Sizes take ``kb``/``mb``/``gb``/``tb``
(or ``k``/``m``/``g``/``t``/``b``) suffixes in any case; booleans take true/false, yes/no,
on/off, enable/disable, 1/0. A bad value raises :class:`~mooncake_core.errors.ConfigError`
(a ``ValueError``, as the published module raises). The variables are read through
:func:`mooncake_core.config.environment`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from mooncake_core.config import environment
from mooncake_core.errors import ConfigError

__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig"]

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB, the published default
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30  # 1 GiB, the published default

#: suffix -> multiplier; two-letter suffixes are tried before one-letter ones.
_UNITS = (
    ("kb", 1 << 10),
    ("mb", 1 << 20),
    ("gb", 1 << 30),
    ("tb", 1 << 40),
    ("k", 1 << 10),
    ("m", 1 << 20),
    ("g", 1 << 30),
    ("t", 1 << 40),
    ("b", 1),
)
#: protocols the published engine or store knows; others are passed on with a warning.
KNOWN_PROTOCOLS = frozenset(
    "tcp rdma efa nvmeof nvlink musa nvlink_intra hip barex cxl ascend ub ubshmem maca"
    " sunrise_link rpc_only".split()
)
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")


def _size(value: Any) -> int:
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    text = value.strip().lower()
    if not text:
        raise ConfigError("Invalid segment size: empty string")
    for suffix, unit in _UNITS:
        if text.endswith(suffix):
            number = text[: -len(suffix)].strip()
            if not number:
                raise ConfigError(f"Invalid segment size: missing number before '{suffix}'")
            return int(_number(number, value) * unit)
    return int(_number(text, value))


def _number(text: str, original: Any) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"Invalid segment size: {original!r}") from None


def _flag(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return bool(value)
    if value is None:
        return False
    word = str(value).strip().lower()
    if word in ("", "false", "0", "no", "off", "disable"):
        return False
    if word in ("true", "1", "yes", "on", "enable"):
        return True
    raise ConfigError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """A Mooncake client configuration (the published dataclass's fields and defaults).

    ``protocol`` is lowercased; an unknown one is kept with a warning. Sizes must not be
    negative and ``local_hostname``, ``metadata_server``, ``master_server_address`` must be
    non-empty strings (:class:`ConfigError` otherwise).
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ConfigError(
                f"Invalid protocol: {self.protocol!r}. Protocol must be a non-empty string,"
                " e.g. 'tcp' or 'rdma'."
            )
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in KNOWN_PROTOCOLS:
            logger.warning(
                "unknown protocol %r, passed on unchanged (known: %s)",
                self.protocol,
                ", ".join(sorted(KNOWN_PROTOCOLS)),
            )
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"Invalid {name}: {getattr(self, name)}. Size must be non-negative."
                )
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(
                    f"Config field {name!r} must be a non-empty string, got {value!r}."
                )

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Load a JSON config file (``OSError`` if it cannot be read)."""
        with open(file_path) as fh:
            data = json.load(fh)
        for name in _REQUIRED:
            if name not in data:
                raise ConfigError(f"Missing required config field: {name}")
        ssd = data.get("ssd_offload_path")
        tenant = data.get("tenant_id")
        return MooncakeConfig(
            local_hostname=data.get("local_hostname"),
            metadata_server=data.get("metadata_server"),
            global_segment_size=_size(data.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(data.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=data.get("protocol", "tcp"),
            device_name=data.get("device_name", ""),
            master_server_address=data.get("master_server_address"),
            enable_ssd_offload=_flag(data.get("enable_ssd_offload", False)),
            ssd_offload_path="" if ssd is None else str(ssd),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_flag(data.get("enable_client_http_server", False)),
            client_http_port=int(data.get("client_http_port", 9300)),
        )

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """``MOONCAKE_CONFIG_PATH`` (a JSON file) or, without it, the variables
        ``MOONCAKE_MASTER`` (required), ``MOONCAKE_LOCAL_HOSTNAME`` (localhost),
        ``MOONCAKE_TE_META_DATA_SERVER`` (P2PHANDSHAKE), ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
        ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL`` (tcp), ``MOONCAKE_DEVICE``,
        ``MOONCAKE_OFFLOAD_ENABLED``, ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``,
        ``MOONCAKE_TENANT_ID``, ``MOONCAKE_ENABLE_CLIENT_HTTP_SERVER``,
        ``MOONCAKE_CLIENT_HTTP_PORT``."""
        env = environment()
        path = env.get("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = env.get("MOONCAKE_MASTER")
        if not master:
            raise ConfigError(
                "Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER'"
                " is set."
            )
        return MooncakeConfig(
            local_hostname=env.get("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_size(
                env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)
            ),
            local_buffer_size=_size(
                env.get("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)
            ),
            protocol=env.get("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env.get("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_flag(env.get("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env.get("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_flag(env.get("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env.get("MOONCAKE_CLIENT_HTTP_PORT", "9300")),
        )
