"""Reads that start at a remembered replica (see :mod:`~mooncake_core.store.locations`).

A get of a key in the client's location cache sends the replica-list request, reads the
remembered replica while the master answers, and keeps the bytes only if the answer lists
that replica under the same version token; otherwise the caller reads again from the answer.
:class:`RememberedReads` is that part of the client, for one key and for a batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_core.errors import LeaseExpired, MooncakeError, StoreError
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.client_core import ClientCore
from mooncake_core.store.locations import Remembered, ReplicaAnswer
from mooncake_core.store.protocol import SliceW

__all__ = ["RememberedReads"]

logger = logging.getLogger(__name__)


class RememberedReads(ClientCore):
    """Reads that start at a remembered replica while the master answers (see module doc)."""

    def _readable(self, rep: list[SliceW]) -> bool:
        """Only holders we are connected to: a lookup or a connect must not stall a guess."""
        return all(self._own(s) is not None or self.engine.is_resolved(s.peer) for s in rep)

    def _read_remembered(
        self, key: str, local_for: Callable[[int], LocalBuffer]
    ) -> int | ReplicaAnswer | None:
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
        except (
            StoreError
        ):  # the buffer is too small for the remembered size: let the plain path say so
            return None
        pending = self.rpc.start("get_replica_list", (key,))
        if pending is None:
            return None
        try:
            self._move("read", [(local, rep)])
            moved = True
        except (
            MooncakeError,
            OSError,
        ) as exc:  # the holder may be gone: the answer tells where to read
            moved = False
            logger.debug(
                "reading remembered %r failed (%s); forgetting what was remembered on its holders",
                key,
                exc,
            )
            self._where.forget_peers({s.peer for s in rep})
            now = time.monotonic()
            self._failed_peers.update((s.peer, now) for s in rep)
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
        if (
            moved
            and token2 == token
            and size2 == size
            and rep in reps
            and gen == self.rpc.failovers
        ):
            if time.monotonic() - pending.sent > ttl:
                raise LeaseExpired(
                    f"get {key!r}: the read took longer than the {ttl:.1f}s lease; retry"
                )
            self.location_hits += 1
            nxt = self._repick(reps) if len(reps) > 1 else None
            if nxt is not None:  # several replicas (a hot key): the next read picks one again
                self._where.remember(key, gen, token2, size, nxt)
            else:
                self._where.touch(key)
            return size
        self.location_misses += 1
        self._where.forget([key])
        return ReplicaAnswer(size2, reps, ttl, pending.sent, token2, gen)

    def _repick(self, reps: list[list[SliceW]]) -> list[SliceW] | None:
        """The replica the next read of a key with several replicas should try, never one on
        a holder a remembered read failed from lately (the master may still list it until
        the client TTL drops it); None: keep the replica just read."""
        if self._failed_peers:
            cutoff = time.monotonic() - 2 * self.lease_ttl_s - 30.0
            for peer in [p for p, t in self._failed_peers.items() if t < cutoff]:
                del self._failed_peers[peer]
        ok = [r for r in reps if not any(s.peer in self._failed_peers for s in r)]
        return self._rank(ok)[0] if ok else None

    def _batch_read_remembered(
        self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None, gen: int
    ) -> tuple[list[Any], dict[int, int]] | None:
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
            failed = self._batch_move(
                "read", [(j, local, e.replica) for j, (_i, e, local) in enumerate(picks)], None
            )
        except BaseException:
            self.rpc.abandon(pending)
            raise
        if failed:  # their holders may be gone: forget what was remembered there
            self._where.forget_peers({s.peer for j in failed for s in picks[j][1].replica})
        res: list[Any] = self.rpc.finish(pending)
        hit: dict[int, int] = {}
        same_masters = gen == self.rpc.failovers
        for j, (i, e, _local) in enumerate(picks):
            row = res[
                i
            ]  # (code, size, replicas, ttl, token): see MasterState.batch_get_replica_list
            reps = (
                [[SliceW._make(s) for s in r] for r in row[2]]
                if same_masters
                and j not in failed
                and row[0] == 0
                and len(row) > 4
                and int(row[4]) == e.token
                and int(row[1]) == e.size
                else []
            )
            if e.replica in reps:
                hit[i] = e.size
                # several replicas (a hot key): the next read picks one again, as a single get does
                nxt = self._repick(reps) if len(reps) > 1 else None
                if nxt is not None:
                    self._where.remember(keys[i], gen, e.token, e.size, nxt)
                else:
                    self._where.touch(keys[i])
            else:
                self._where.forget([keys[i]])
        self.location_hits += len(hit)
        self.location_misses += len(picks) - len(hit)
        return res, hit
