"""Reservations: extents of a segment the master lends a client for one-RPC puts.

A client may hold a few extents (:meth:`Reservations.reserve`), allocate objects inside them
itself, write the bytes, and commit each object with one call (:meth:`Reservations.put_commit`),
which carves the object's range out of the extent. Grants, carves and releases are replicated,
so a new leader knows which ranges a client may still be writing; an extent unused for
``put_timeout_s`` is reclaimed. A commit into a reservation that is gone raises
:class:`~mooncake_core.store.protocol.ReservationGone` (the client then puts in two phases).
An early commit (sent while the write is in flight) stays invisible until ``put_confirm``.
"""

from __future__ import annotations

from typing import Any

from mooncake_core.errors import NoSpace, ObjectExists
from mooncake_core.store.allocator import align
from mooncake_core.store.protocol import Extent, InvalidArgument, ReplicaCfg, ReservationGone
from mooncake_core.store.state_core import Obj, Reservation, Segment, SliceT, StateCore, check_key

__all__ = ["RESERVE_MAX_OBJECT", "Reservations"]

RESERVE_MAX_OBJECT = 4 << 20  # objects up to this size may be put through a reservation
_RESERVE_MIN, _RESERVE_MAX = (
    4 << 20,
    32 << 20,
)  # extent size bounds (and at most 1/16 of the segment)
_RESERVE_PER_CLIENT = 8


class Reservations(StateCore):
    """Lending extents and committing objects into them (see module doc)."""

    def reserve(
        self,
        client_id: str,
        size: int,
        cfg: ReplicaCfg,
        release: list[int],
        now: float,
        count: int = 0,
    ) -> tuple[int, Extent | list[Any], float]:
        """Release the client's listed reservations, then lend it an extent for objects of about
        ``size``.

        Returns ``(rid, Extent, ttl_s)``, or
        ``(0, [], 0.0)`` when none is granted (the client then puts in two phases): no
        segment has a free extent that keeps it under the eviction watermark, the client
        holds the maximum, or ``size`` is 0 (release only). Reservations never evict.
        """
        self._client(client_id, now)
        for rid in release:
            r = self.reservations.get(rid)
            if r is not None and r.client_id == client_id:
                self._release_reservation(r)
        if size == 0:
            return 0, [], 0.0
        if size < 0 or size > RESERVE_MAX_OBJECT:
            raise InvalidArgument(f"reserve: size must be 0..{RESERVE_MAX_OBJECT}, got {size}")
        if cfg.replica_num != 1:
            raise InvalidArgument(
                f"reserve: reservations hold single-replica objects, "
                f"got replica_num={cfg.replica_num}"
            )
        strategy = self._strategy(cfg, "reserve")
        if cfg.preferred_segment and cfg.preferred_segment not in self.segments:
            raise InvalidArgument(
                f"reserve: preferred segment {cfg.preferred_segment!r} is not mounted"
            )
        if (
            sum(1 for r in self.reservations.values() if r.client_id == client_id)
            >= _RESERVE_PER_CLIENT
        ):
            return 0, [], 0.0
        if count < 0:
            raise InvalidArgument(f"reserve: count must not be negative, got {count}")
        want = min(max(max(16, min(count, 1 << 16)) * align(size), _RESERVE_MIN), _RESERVE_MAX)
        hw = self.cfg.eviction_high_watermark

        def extent(sg: Segment) -> int:
            return min(want, sg.size // 16)

        fits = [
            sg
            for sg in self.segments.values()
            if extent(sg) >= 2 * align(size)
            and sg.allocator.used + extent(sg) <= hw * sg.size
            and sg.allocator.largest_free() >= extent(sg)
            and not self._suspect(sg.client_id, now)  # a writer could not reach its holder
        ]
        # the segments a two-phase put would try first must be the ones lending: a preference
        # (preferred segment, the writer's own segments) is never traded for an extent elsewhere
        if cfg.preferred_segment:
            fits = [sg for sg in fits if sg.name == cfg.preferred_segment]
        elif strategy == "local-first" and any(
            sg.client_id == client_id for sg in self.segments.values()
        ):
            fits = [sg for sg in fits if sg.client_id == client_id]
        if strategy == "free-ratio-first":
            fits.sort(key=lambda sg: sg.allocator.free / sg.size, reverse=True)
        else:
            self.rng.shuffle(fits)
        for sg in fits:
            off = sg.allocator.allocate(extent(sg))
            if off is not None:
                n = align(extent(sg))  # what the allocator really took
                break
        else:
            return 0, [], 0.0
        self._rid += 1
        r = Reservation(self._rid, client_id, sg.name, {off: n}, now + self.cfg.put_timeout_s)
        self.reservations[r.rid] = r
        self.counters["reservations_granted"] += 1
        self._emit("res", r.rid, client_id, sg.name, [[off, n]], self.cfg.put_timeout_s)
        return r.rid, Extent(sg.name, sg.peer, sg.base, off, n, sg.host), self.cfg.put_timeout_s

    def put_commit(
        self,
        client_id: str,
        key: str,
        rid: int,
        offset: int,
        size: int,
        cfg: ReplicaCfg,
        now: float,
        *,
        early: bool = False,
    ) -> tuple[float, int]:
        """Commit ``key`` = the ``size`` bytes the client wrote at ``offset`` inside reservation
        ``rid``.

        Returns the reservation's renewed ttl and the object's version token. The range is
        carved out of the reservation and belongs to the object from now on.

        ``early``: the client sends the commit while its write is still in flight. The object
        then exists but is not complete (``self.early``) until :meth:`put_confirm`; an early
        commit never confirmed is dropped after ``put_timeout_s`` (the master also drops it
        when the committing connection closes). Early commits are not logged (no HA).
        """
        self._client(client_id, now)
        check_key(key)
        if size <= 0:
            raise InvalidArgument(f"put {key!r}: size must be positive, got {size}")
        if cfg.soft_pin_ttl_s < 0:
            raise InvalidArgument(f"put {key!r}: soft_pin_ttl_s must not be negative")
        r = self.reservations.get(rid)
        if r is None or r.client_id != client_id or now >= r.deadline:
            raise ReservationGone(
                f"put {key!r}: reservation {rid} is unknown or expired for client {client_id!r}; "
                f"put again"
            )
        old = self.objects.get(key)
        if (
            old is not None and old.complete
        ):  # before the range check: a retried commit that already landed
            raise ObjectExists(f"put {key!r}: the key already exists (remove it first)")
        need = align(size)
        block = r.block_holding(offset, need)
        if block is None:
            raise ReservationGone(
                f"put {key!r}: [{offset}, {offset + need}) is not a free part of reservation {rid}"
            )
        self._claim_key(key, now)
        self._admit(key, size, now)
        if (
            r.rid not in self.reservations
        ):  # making room reclaimed expired reservations: not this live one
            raise ReservationGone(f"put {key!r}: reservation {rid} was reclaimed; put again")
        self._carve(r, block, offset, need, release=False)
        rep: list[SliceT] = [(r.segment, offset, size)]
        o = Obj(
            key,
            size,
            [rep],
            complete=not early,
            token=self._next_token(),
            owner=client_id,
            hard_pin=cfg.hard_pin,
            soft_pin_until=(now + cfg.soft_pin_ttl_s) if cfg.soft_pin_ttl_s else 0.0,
            early=early,
            deadline=(now + self.cfg.put_timeout_s) if early else 0.0,
        )
        self.objects[key] = o
        self._index_replica(key, rep)
        r.deadline = now + self.cfg.put_timeout_s
        self.counters["reserved_puts"] += 1
        self._emit("carve", r.rid, offset, need)
        if early:
            self.early[key] = o.token
        else:
            self.lru[key] = None
            self._emit(*self._obj_entry(o))
        return self.cfg.put_timeout_s, o.token

    def put_confirm(self, client_id: str, key: str, token: int, ok: bool, now: float) -> None:
        """Complete (``ok``) or drop an early commit of ``key`` once its writer knows how the
        write went."""
        o = self.objects.get(key)
        if o is None or not o.early or o.token != token or o.owner != client_id:
            raise InvalidArgument(
                f"put_confirm {key!r}: no early commit with this token (it timed out after "
                f"{self.cfg.put_timeout_s:.0f}s or its connection closed); put again"
            )
        c = self.clients.get(client_id)
        if c is not None:
            c.last_seen = now
        if not ok:
            self._drop_object(o, emit=False)
            return
        if not o.replicas:
            self._drop_object(o, emit=False)
            raise NoSpace(f"put_confirm {key!r}: its segment went away during the write; put again")
        o.early = False
        o.complete = True
        o.deadline = 0.0
        del self.early[key]
        self.lru[key] = None
        self._emit(*self._obj_entry(o))

    def _carve(self, r: Reservation, block: int, offset: int, need: int, *, release: bool) -> None:
        """Take ``[offset, offset+need)`` out of ``r``'s block at ``block`` (an allocated range
        of its own after)."""
        alloc = self.segments[r.segment].allocator
        bsize = r.blocks.pop(block)
        if offset > block:
            alloc.split(block, offset)
            r.blocks[block] = offset - block
        if offset + need < block + bsize:
            alloc.split(offset, offset + need)
            r.blocks[offset + need] = block + bsize - offset - need
        if release:  # replaying a carve: the object entry that follows allocates the range again
            alloc.release(offset)
        if not r.blocks:
            del self.reservations[r.rid]

    def _release_reservation(self, r: Reservation, *, emit: bool = True) -> None:
        self.reservations.pop(r.rid, None)
        s = self.segments.get(r.segment)
        if s is not None:
            for b in r.blocks:
                s.allocator.release(b)
        r.blocks = {}
        if emit:
            self._emit("unres", r.rid)
