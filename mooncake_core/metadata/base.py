"""Metadata backends: where engines publish how to reach them and what they registered.

Key names follow Mooncake's: ``<prefix>/rpc_meta/<name>`` holds
``{"ip_or_host_name": ..., "rpc_port": ...}`` and ``<prefix>/ram/<name>`` the segment
descriptor (buffers with addresses and lengths). The prefix is ``metadata.prefix``
(default ``mooncake``).

The backend is chosen from ``metadata_server``: ``P2PHANDSHAKE`` (no central service:
the peer name *is* ``host:port``), ``http://host:port/metadata`` or ``etcd://host:port``
(a bare ``host:port`` means etcd, as in Mooncake).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from mooncake_core.config import MooncakeConfig
from mooncake_core.errors import ConfigError, MetadataError
from mooncake_core.plugins import metadata_backends

__all__ = ["MetadataBackend", "KVMetadataBackend", "open_backend", "split_hostport"]


def split_hostport(name: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``; ``[v6]:port`` supported."""
    host, sep, port = name.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise MetadataError(f"peer name {name!r} is not host:port")
    return host.strip("[]"), int(port)


class MetadataBackend(ABC):
    """Publishes this engine and resolves peers. *Thread-safety*: all methods."""

    scheme = "base"

    @abstractmethod
    def publish(self, name: str, rpc: dict[str, Any], segment: dict[str, Any]) -> None:
        """Announce this engine (called at start and when its registrations change)."""

    @abstractmethod
    def resolve(self, name: str) -> dict[str, Any]:
        """Return ``{"ip_or_host_name", "rpc_port"}`` of peer ``name`` or raise MetadataError."""

    def unpublish(self, name: str) -> None:  # noqa: B027 - optional
        """Withdraw this engine's keys."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""


class KVMetadataBackend(MetadataBackend):
    """A backend over a key-value store (HTTP server, etcd)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def publish(self, name: str, rpc: dict[str, Any], segment: dict[str, Any]) -> None:
        self.put(f"{self.prefix}/rpc_meta/{name}", json.dumps(rpc).encode())
        self.put(f"{self.prefix}/ram/{name}", json.dumps(segment).encode())

    def unpublish(self, name: str) -> None:
        self.delete(f"{self.prefix}/rpc_meta/{name}")
        self.delete(f"{self.prefix}/ram/{name}")

    def resolve(self, name: str) -> dict[str, Any]:
        raw = self.get(f"{self.prefix}/rpc_meta/{name}")
        if raw is None:
            raise MetadataError(
                f"unknown peer {name!r}: no {self.prefix}/rpc_meta/{name} "
                f"in the {self.scheme} metadata store"
            )
        try:
            out: dict[str, Any] = json.loads(raw)
            return out
        except ValueError as exc:
            raise MetadataError(f"metadata for peer {name!r} is not valid JSON") from exc

    def segment(self, name: str) -> dict[str, Any] | None:
        raw = self.get(f"{self.prefix}/ram/{name}")
        return None if raw is None else dict(json.loads(raw))


def open_backend(url: str, config: MooncakeConfig) -> MetadataBackend:
    """The backend serving connection string ``url`` (found through the plugin system)."""
    target = url.strip()
    if not target:
        raise ConfigError(
            "metadata_server: must not be empty (use P2PHANDSHAKE, http://h:p/metadata or etcd://h:p)"
        )
    backends = metadata_backends()
    backend: MetadataBackend
    for info in backends.values():
        for scheme in info.schemes:
            if target.upper() == scheme.upper() or (
                scheme.endswith("://") and target.lower().startswith(scheme)
            ):
                backend = info.factory(target, config)
                return backend
    if "://" not in target and ":" in target and "etcd" in backends:  # bare host:port means etcd
        backend = backends["etcd"].factory("etcd://" + target, config)
        return backend
    schemes = sorted(s for b in backends.values() for s in b.schemes)
    raise ConfigError(f"metadata_server: no backend serves {url!r} (known: {', '.join(schemes)})")
