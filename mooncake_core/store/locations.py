"""The store client's location cache: which replica (and version) each key had last time.

A client remembers, per key it put or read, the replica and the object's version token
(``store.location_cache`` entries, least recently used dropped first). A get of such a key
sends the replica-list request, reads the remembered replica while the master answers, and
keeps the bytes only if the answer lists that replica under the same token (the object then
sat there unchanged since it was remembered, and is now leased); otherwise it reads again
from the answer. So a hit costs one transfer with the master round trip hidden behind it.
A miss or stale entry costs a wasted read, and a failed ``get_into`` may leave the
remembered object's old bytes in the buffer.

- :class:`LocationCache`: the entries (:class:`Remembered`), thread-safe.
- :class:`ReplicaAnswer`: the master's answer to a replica-list request, as a get uses it.
- The reads themselves are :class:`~mooncake_core.store.reads.RememberedReads`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from mooncake_core.store.protocol import SliceW

__all__ = ["LocationCache", "Remembered", "ReplicaAnswer"]

logger = logging.getLogger(__name__)


class Remembered(NamedTuple):
    """Where a key's object was: under which master connection generation and version."""

    gen: int  # the master connections' generation (MasterRPC.generation) when it was learnt
    token: int  # the object's version token
    size: int
    replica: list[SliceW]


@dataclass(slots=True)
class ReplicaAnswer:
    """The master's answer to ``get_replica_list`` and when (and under which rpc generation)
    it was asked."""

    size: int
    replicas: list[list[SliceW]]
    ttl: float
    sent: float
    token: int
    gen: int


class LocationCache:
    """Up to ``capacity`` remembered locations, least recently used dropped first (0: off)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Remembered] = OrderedDict()

    def remember(self, key: str, gen: int, token: int, size: int, rep: list[SliceW]) -> None:
        """Remember ``rep`` for ``key`` (nothing without a version token)."""
        if self.capacity <= 0 or not token:
            return
        with self._lock:
            self._entries[key] = Remembered(gen, token, size, rep)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, key: str) -> Remembered | None:
        with self._lock:
            return self._entries.get(key)

    def get_many(self, keys: Iterable[str]) -> list[Remembered | None]:
        with self._lock:
            return [self._entries.get(k) for k in keys]

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (if it is still remembered)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def forget(self, keys: Iterable[str] | None) -> None:
        """Drop remembered locations of ``keys`` (None: all)."""
        with self._lock:
            if keys is None:
                self._entries.clear()
            else:
                for k in keys:
                    self._entries.pop(k, None)

    def forget_peers(self, peers: set[str]) -> None:
        """Drop remembered locations on ``peers`` (a holder that failed a read may be gone)."""
        with self._lock:
            gone = [k for k, v in self._entries.items() if any(s.peer in peers for s in v.replica)]
            for k in gone:
                del self._entries[k]

    def snapshot(self) -> dict[str, Remembered]:
        """A copy of the entries, least recently used first."""
        with self._lock:
            return dict(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
