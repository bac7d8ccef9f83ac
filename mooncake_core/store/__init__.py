"""Mooncake Store: a distributed KV-cache object store (master, clients, replicas, eviction, HA).

``StoreClient`` is the Pythonic client; ``MasterServer`` the master (``mooncake-core
master``). See docs/store.md.
"""

from __future__ import annotations

from mooncake_core.store.client import StoreClient
from mooncake_core.store.master import MasterServer
from mooncake_core.store.protocol import (
    InvalidArgument,
    NotLeader,
    ObjectBusy,
    ReplicaCfg,
    RetryLater,
    UnknownClient,
)

__all__ = [
    "StoreClient",
    "MasterServer",
    "ReplicaCfg",
    "InvalidArgument",
    "NotLeader",
    "ObjectBusy",
    "RetryLater",
    "UnknownClient",
]
