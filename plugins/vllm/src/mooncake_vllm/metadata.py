"""Per-step messages between the PD connector's scheduler side and its workers.

The scheduler builds one :class:`PDMetadata` per engine step; workers only read it.
Everything here is plain data (it crosses process boundaries by pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

__all__ = ["RecvSpec", "PDMetadata", "PDHandshake", "PARAMS_VERSION"]

PARAMS_VERSION = 1


@dataclass
class RecvSpec:
    """One request whose prompt KV a decode worker must fetch.

    Attributes:
        request_id: the local (decode) request id.
        remote_request_id: the prefill instance's request id (to release its blocks).
        remote_engine_id: the prefill instance's engine id (for messages).
        peers: per TP rank (as str) ``{"peer": "host:port", "layers": {name: addr},
            "block_bytes": n}`` from the prefill workers' handshake.
        local_block_ids: where the KV goes here.
        remote_block_ids: where it lies on the prefill instance, same length.
    """

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    peers: dict[str, dict[str, Any]]
    local_block_ids: list[int] = field(default_factory=list)
    remote_block_ids: list[int] = field(default_factory=list)


@dataclass
class PDMetadata(KVConnectorMetadata):
    """What the workers do this step.

    Attributes:
        recvs: fetches to start (decode side). A spec without blocks only releases
            the prefill instance's blocks (local prefix hit, or aborted request).
        sends: request id -> block ids kept for a decode instance (prefill side).
    """

    recvs: list[RecvSpec] = field(default_factory=list)
    sends: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """What one worker tells its scheduler at start-up: how peers reach its KV.

    Attributes:
        peer: transfer-engine name (``127.0.0.1:PORT``).
        layers: layer name -> base address of that layer's registered KV tensor.
        block_bytes: bytes of one block of one layer.
        num_blocks: blocks per layer.
    """

    peer: str
    layers: dict[str, int]
    block_bytes: int
    num_blocks: int
