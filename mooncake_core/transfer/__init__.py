"""The transfer engine: move bytes between registered memory of processes and hosts.

See :class:`TransferEngine`. Transports: shared memory (same host), RDMA (pyverbs, when
a device exists), TCP (default across hosts). Metadata: peer-to-peer handshake, HTTP,
etcd.
"""

from __future__ import annotations

from mooncake_core.transfer.engine import (
    Batch,
    PeerInfo,
    RequestStatus,
    TransferEngine,
    TransferRequest,
)
from mooncake_core.transfer.memory import ManagedBuffer, Region

__all__ = ["TransferEngine", "TransferRequest", "Batch", "RequestStatus", "PeerInfo", "ManagedBuffer", "Region"]
