"""etcd metadata backend: keys under ``metadata.prefix`` written with a lease, so a dead
engine's keys disappear after ``metadata.ttl_s``."""

from __future__ import annotations

import json
import threading
from typing import Any

from mooncake_core.config import MooncakeConfig
from mooncake_core.etcd import EtcdClient
from mooncake_core.metadata.base import KVMetadataBackend
from mooncake_core.plugins import MetadataBackendInfo, hookimpl

__all__ = ["EtcdMetadata"]


class EtcdMetadata(KVMetadataBackend):
    scheme = "etcd"

    def __init__(self, url: str, prefix: str = "mooncake", ttl_s: float = 10.0) -> None:
        super().__init__(prefix)
        self.client = EtcdClient(url)
        self.ttl_s = ttl_s
        self._lease: int | None = None
        self._lock = threading.Lock()

    def _lease_id(self) -> int:
        with self._lock:
            if self._lease is None:
                self._lease = self.client.grant_lease(self.ttl_s)
            return self._lease

    def get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.client.put(key, value)

    def delete(self, key: str) -> None:
        self.client.delete(key)

    def publish(self, name: str, rpc: dict[str, Any], segment: dict[str, Any]) -> None:
        lease = self._lease_id()
        self.client.put(f"{self.prefix}/rpc_meta/{name}", json.dumps(rpc).encode(), lease=lease)
        self.client.put(f"{self.prefix}/ram/{name}", json.dumps(segment).encode(), lease=lease)

    def close(self) -> None:
        self.client.close()


def _factory(url: str, config: MooncakeConfig) -> KVMetadataBackend:
    return EtcdMetadata(url, prefix=config.metadata.prefix, ttl_s=config.metadata.ttl_s)


@hookimpl
def mooncake_metadata_backends() -> list[MetadataBackendInfo]:
    return [
        MetadataBackendInfo("etcd", ("etcd://",), _factory, "etcd (aetcd client; keys on a lease)")
    ]
