"""P2P store: etcd-coordinated swarm distribution of large blobs (checkpoints).

Every reader of a name becomes a holder of each shard it has verified, so later readers
fetch from it instead of the original copy (the seeder's NIC stops being the limit).
See docs/p2p.md. Typical use::

    with P2PStore("etcd://10.0.0.1:2379") as p2p:       # seeder
        p2p.register("llama/step100", "/ckpt/step100")   # a file or a directory
        ...                                              # serve until done

    with P2PStore("etcd://10.0.0.1:2379") as p2p:       # each reader
        rep = p2p.get_replica("llama/step100")           # verified, then served to others

Modules: ``store`` (:class:`P2PStore`), ``fetch`` (one download: shard choice,
verification, retries), ``meta`` (etcd keys, manifests, holder records), ``buffers``
(what may be registered), ``errors``.
"""

from __future__ import annotations

from mooncake_core.p2p.errors import (
    BadName,
    NameExists,
    NameNotFound,
    P2PError,
    ShardUnavailable,
    VersionChanged,
)
from mooncake_core.p2p.fetch import Progress
from mooncake_core.p2p.store import ObjectInfo, P2PStore, Replica

__all__ = [
    "P2PStore",
    "Replica",
    "ObjectInfo",
    "Progress",
    "P2PError",
    "BadName",
    "NameExists",
    "NameNotFound",
    "VersionChanged",
    "ShardUnavailable",
]
