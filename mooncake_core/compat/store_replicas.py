"""Replica descriptors of ``mooncake.store``: ``get_replica_desc`` / ``batch_get_replica_desc``.

The published store answers these with ``ReplicaDescriptor`` objects (a status, and a
memory or disk descriptor); ours builds the same objects from the master's answer to a
read (:meth:`StoreClient.replicas`): per memory replica, the holder's segment name as
``transport_endpoint``, the absolute address in the holder's memory and the size. As on the
published store, asking grants a read lease. Our replicas are always in memory (an object
whose only copy is on a client's SSD is brought back to memory first), so every descriptor
is a memory one. A replica split over several segments (large objects only) has one
``Descriptor`` per slice in ``buffer_descriptors`` (ours); ``buffer_descriptor`` is the first.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mooncake_core.errors import ObjectNotFound

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = [
    "COMPLETE",
    "INITIALIZED",
    "REMOVED",
    "UNDEFINED",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "ReplicaDescriptor",
    "ReplicaMethods",
    "ReplicaStatus",
]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")


class ReplicaStatus(enum.Enum):
    """A replica's state (not an ``int``: ``ReplicaStatus.COMPLETE == 3`` is False, as
    published; ``int(status)`` gives the number)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5

    def __int__(self) -> int:
        return int(self.value)


UNDEFINED = ReplicaStatus.UNDEFINED
INITIALIZED = ReplicaStatus.INITIALIZED
COMPLETE = ReplicaStatus.COMPLETE
REMOVED = ReplicaStatus.REMOVED


class Descriptor:
    """Descriptor for allocated buffers: ``size``, ``buffer_address`` (in the holder's memory)
    and ``transport_endpoint`` (the holder's segment name, ``host:port``)."""

    size: int = 0
    buffer_address: int = 0
    transport_endpoint: str = ""

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    """A memory replica: ``buffer_descriptor`` (and ours: every slice in
    ``buffer_descriptors``)."""

    def __init__(self, buffers: Sequence[Descriptor]) -> None:
        self.buffer_descriptors = list(buffers)
        self._first = self.buffer_descriptors[0] if buffers else Descriptor()

    @property
    def buffer_descriptor(self) -> Descriptor:
        return self._first


class DiskDescriptor:
    """A disk replica (never produced here: our replicas are in memory)."""

    file_path: str = ""
    object_size: int = 0


class ReplicaDescriptor:
    """One replica of an object: ``status`` and its memory (or disk) descriptor."""

    def __init__(
        self,
        status: ReplicaStatus,
        memory: MemoryDescriptor | None = None,
        disk: DiskDescriptor | None = None,
    ) -> None:
        self._status = status
        self._memory = memory
        self._disk = disk

    @property
    def status(self) -> ReplicaStatus:
        return self._status

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        return self._disk is not None

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise RuntimeError("Expected MemoryDescriptor")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("Expected DiskDescriptor")
        return self._disk


def _descriptor(segment: str, addr: int, length: int) -> Descriptor:
    d = Descriptor()
    d.size, d.buffer_address, d.transport_endpoint = int(length), int(addr), str(segment)
    return d


class ReplicaMethods:
    """``get_replica_desc`` and ``batch_get_replica_desc``, mixed into the store."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of ``key`` (empty when it is missing or the query failed)."""

        def run(c: StoreClient) -> list[ReplicaDescriptor]:
            try:
                _size, reps = c.replicas(key)
            except ObjectNotFound:
                return []
            return [
                ReplicaDescriptor(
                    ReplicaStatus.COMPLETE,
                    MemoryDescriptor([_descriptor(s.segment, s.addr, s.length) for s in rep]),
                )
                for rep in reps
            ]

        res = self._run(f"get_replica_desc {key!r}", run)
        return [] if isinstance(res, int) else res

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: replicas}`` for the keys that exist, in key order (as published)."""
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key in sorted(set(keys)):
            found = self.get_replica_desc(key)
            if found:
                out[key] = found
        return out
