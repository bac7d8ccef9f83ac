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

from mooncake_core.errors import ObjectNotFound, StoreError

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

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Remove the objects among ``keys`` that this client put and that nobody holds a read
        lease on; with ``segment_name``, only those whose every replica lies on that segment.
        Returns the keys cleared (each once, in the order given).

        As published: another client's objects, leased or missing keys are left alone (not
        listed). ``segment_name`` is a client's segment name (its ``get_hostname()``), which
        covers every segment that client mounted. An object with replicas elsewhere too
        keeps those: only the replicas on that segment are dropped (and the key listed)."""
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TypeError("batch_replica_clear(): keys must be a list of str")
        if not isinstance(segment_name, str):
            raise TypeError("batch_replica_clear(): segment_name must be a str")

        def on_segment(name: str) -> bool:
            return name == segment_name or name.startswith(segment_name + "#")

        def run(c: StoreClient) -> list[str]:
            out: list[str] = []
            for key in dict.fromkeys(keys):
                try:
                    q = c.query(key)
                except ObjectNotFound:
                    continue
                if q.get("owner") != c.client_id or not q.get("complete"):
                    continue
                if float(q.get("lease_s", 0.0)) > 0 or q.get("hard_pin"):
                    continue
                slices = [s for rep in q.get("replicas", []) for s in rep]
                if segment_name and not any(on_segment(s["segment"]) for s in slices):
                    continue
                if segment_name and (q.get("ssd") or not all(on_segment(s["segment"])
                                                             for s in slices)):  # fmt: skip
                    # replicas elsewhere too: drop only the ones on that segment
                    try:
                        dropped = c._call("drop_replicas", (c.client_id, key, segment_name))
                    except StoreError as exc:
                        logger.debug("batch_replica_clear %r: %s", key, exc)
                        continue
                    if dropped:
                        out.append(key)
                    continue
                try:
                    c.remove(key)
                except StoreError as exc:  # leased or removed meanwhile: not cleared
                    logger.debug("batch_replica_clear %r: %s", key, exc)
                    continue
                out.append(key)
            return out

        res = self._run("batch_replica_clear", run)
        return [] if isinstance(res, int) else res

    def get_offload_rpc_read_count(self) -> int:
        """How many reads this client served over the published store's offload RPC (reads of
        an object from another client's local-disk segment). Ours has no such read path: an
        object whose only copy is on a client's SSD is first promoted back to memory by that
        client and then read like any other, so this count is always 0 here."""
        return 0

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: replicas}`` for the keys that exist, in key order (as published)."""
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key in sorted(set(keys)):
            found = self.get_replica_desc(key)
            if found:
                out[key] = found
        return out
