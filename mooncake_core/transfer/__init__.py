"""The transfer engine: move bytes between registered memory of processes and hosts.

See :class:`TransferEngine`. Transports: shared memory (same host), RDMA (pyverbs, when
a device exists), TCP (default across hosts). Metadata: peer-to-peer handshake, HTTP,
etcd.

Where things live (lower modules never import higher ones; ``.importlinter`` checks it):

- ``engine``: :class:`TransferEngine`, batches and requests (the top of this package);
- ``server``: the engine's TCP listener;
- ``transports/``: the transport contract (``base``) and the tcp, shm, rdma transports;
- ``types``: shared value types (``PeerInfo``, ``WorkItem``) and the narrow interfaces
  transports and the listener see of the engine;
- ``control``: control messages and the inbox that receives them; ``tensors``: tensor
  messages; ``protocol``: the wire format; ``memory``: registered memory; ``net``,
  ``topology``: sockets, interfaces, host identity.
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

__all__ = [
    "TransferEngine",
    "TransferRequest",
    "Batch",
    "RequestStatus",
    "PeerInfo",
    "ManagedBuffer",
    "Region",
]
