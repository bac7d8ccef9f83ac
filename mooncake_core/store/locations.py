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
- :class:`RememberedReads`: the part of the client that reads remembered replicas, for one
  key (:meth:`RememberedReads._read_remembered`) and for a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from mooncake_core.errors import LeaseExpired, MooncakeError, StoreError
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.client_core import ClientCore
from mooncake_core.store.protocol import SliceW

__all__ = ["LocationCache", "Remembered", "ReplicaAnswer", "RememberedReads"]

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
            for k in [k for k, v in self._entries.items() if any(s.peer in peers for s in v.replica)]:
                del self._entries[k]

    def snapshot(self) -> dict[str, Remembered]:
        """A copy of the entries, least recently used first."""
        with self._lock:
            return dict(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class RememberedReads(ClientCore):
    """Reads that start at a remembered replica while the master answers (see module doc)."""

    def _readable(self, rep: list[SliceW]) -> bool:
        """Only holders we are connected to: a lookup or a connect must not stall a guess."""
        return all(self._own(s) is not None or self.engine.is_resolved(s.peer) for s in rep)

    def _read_remembered(self, key: str,
                         local_for: Callable[[int], LocalBuffer]) -> int | ReplicaAnswer | None:
        """A get of a remembered key: read the remembered replica while the master answers.

        Returns the size when the bytes read are the object's, the master's answer when they
        may not be (the caller reads again from it, without asking again), or None (nothing
        usable: the caller does a plain get).
        """
        hit = self._where.get(key)
        if hit is None:
            return None
        gen, token, size, rep = hit
        if gen != self.rpc.generation():  # a master connection failed since: versions may repeat
            self._where.forget([key])
            return None
        if not self._readable(rep):
            return None
        try:
            local = local_for(size)
        except StoreError:  # the buffer is too small for the remembered size: let the plain path say so
            return None
        pending = self.rpc.start("get_replica_list", (key,))
        if pending is None:
            return None
        try:
            self._move("read", [(local, rep)])
            moved = True
        except (MooncakeError, OSError) as exc:  # the holder may be gone: the answer tells where to read
            moved = False
            logger.debug("reading remembered %r failed (%s); forgetting what was remembered on its "
                         "holders", key, exc)
            self._where.forget_peers({s.peer for s in rep})
        except BaseException:
            self.rpc.abandon(pending)
            raise
        try:
            size2, reps, ttl, token2 = self._answer(self.rpc.finish(pending))
        except (StoreError, OSError):
            self._where.forget([key])
            return None
        # failovers, not generation(): idle connections were checked above; what matters now is
        # whether the answer came over a connection that failed over since
        if moved and token2 == token and size2 == size and rep in reps and gen == self.rpc.failovers:
            if time.monotonic() - pending.sent > ttl:
                raise LeaseExpired(f"get {key!r}: the read took longer than the {ttl:.1f}s lease; retry")
            self.location_hits += 1
            self._where.touch(key)
            return size
        self.location_misses += 1
        self._where.forget([key])
        return ReplicaAnswer(size2, reps, ttl, pending.sent, token2, gen)

    def _batch_read_remembered(self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None,
                               gen: int) -> tuple[list[Any], dict[int, int]] | None:
        """A batch get with remembered keys: read their remembered replicas while the master
        answers ``batch_get_replica_list`` (as :meth:`_read_remembered` does for one key).

        Returns the master's answer and, per key whose bytes read are the object's, its size;
        None when no key is remembered (the caller asks first).
        """
        picks: list[tuple[int, Remembered, LocalBuffer]] = []  # (index in the batch, entry, buffer)
        for i, e in enumerate(self._where.get_many(keys)):
            if e is None or e.gen != gen or not self._readable(e.replica):
                continue
            try:
                local = LocalBuffer(bufs[i], None if sizes is None else sizes[i], writable=True)
            except StoreError:
                continue
            if e.size > local.length:
                continue
            picks.append((i, e, local.first(e.size, bufs[i])))
        if not picks:
            return None
        pending = self.rpc.start("batch_get_replica_list", (list(keys),))
        if pending is None:
            return None
        try:
            failed = self._batch_move("read", [(j, local, e.replica) for j, (_i, e, local) in enumerate(picks)],
                                      None)
        except BaseException:
            self.rpc.abandon(pending)
            raise
        if failed:  # their holders may be gone: forget what was remembered there
            self._where.forget_peers({s.peer for j in failed for s in picks[j][1].replica})
        res: list[Any] = self.rpc.finish(pending)
        hit: dict[int, int] = {}
        same_masters = gen == self.rpc.failovers
        for j, (i, e, _local) in enumerate(picks):
            row = res[i]  # (code, size, replicas, ttl, token): see MasterState.batch_get_replica_list
            if (same_masters and j not in failed and row[0] == 0 and len(row) > 4 and int(row[4]) == e.token
                    and int(row[1]) == e.size and e.replica in [[SliceW._make(s) for s in r] for r in row[2]]):
                hit[i] = e.size
            else:
                self._where.forget([keys[i]])
        self.location_hits += len(hit)
        self.location_misses += len(picks) - len(hit)
        return res, hit
