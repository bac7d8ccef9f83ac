"""Peer-to-peer handshake metadata: no central service.

A peer's name is ``host:port`` of its transfer listener; its segment descriptor is
fetched from the peer itself during the (authenticated) handshake.
"""

from __future__ import annotations

from typing import Any

from mooncake_core.config import MooncakeConfig
from mooncake_core.metadata.base import MetadataBackend, split_hostport
from mooncake_core.plugins import MetadataBackendInfo, hookimpl

__all__ = ["P2PMetadata"]


class P2PMetadata(MetadataBackend):
    scheme = "P2PHANDSHAKE"

    def publish(self, name: str, rpc: dict[str, Any], segment: dict[str, Any]) -> None:
        return None

    def resolve(self, name: str) -> dict[str, Any]:
        host, port = split_hostport(name)
        return {"ip_or_host_name": host, "rpc_port": port}


def _factory(url: str, config: MooncakeConfig) -> MetadataBackend:
    return P2PMetadata()


@hookimpl
def mooncake_metadata_backends() -> list[MetadataBackendInfo]:
    return [
        MetadataBackendInfo(
            "p2p",
            ("P2PHANDSHAKE",),
            _factory,
            "peer-to-peer handshake, peer name = host:port (default)",
        )
    ]
