"""Replication of the master's state: the change log a standby replays (see :mod:`.ha`).

Every change other masters must know is emitted through ``MasterState.on_change`` as an
entry (a tuple whose first item is its kind); :mod:`mooncake_core.store.ha` logs entries in
etcd and standbys replay them with :meth:`Replication.apply`. :meth:`Replication.export` is a
snapshot (entries that rebuild the state). Pending puts are not replicated: a new leader
treats unfinished puts as revoked (:meth:`Replication.on_takeover`).

Entries (the named tuples below name their fields; the log holds them as plain lists):
``client``, ``unclient``, ``seg``, ``unseg``, ``obj``, ``del``, ``res``, ``carve``, ``unres``,
``lease``, ``hot`` (a hot key's extra replicas, :mod:`~mooncake_core.store.hotkeys`) and
``rtask`` (a replica copy/move task, :mod:`~mooncake_core.store.replica_tasks`). An ``obj``
entry for a key a standby holds updates its object in place (hot-key marks and tasks refer
to it); a removed key's next ``obj`` entry is a new object.

Pins and leases: hard pins and soft-pin deadlines travel in ``obj`` entries, leases in
``lease`` entries; both as wall-clock (``time.time()``) deadlines, since each master's
monotonic clock is its own. Leases are replicated coarsely, off the read path: a read that
grants a lease beyond what standbys know (``Obj.lease_rep``) only marks the key
(``lease_dirty``, when HA is on); once per tick the leader logs the marked keys with a
deadline half a lease period beyond the lease (:meth:`Replication.take_leases`), so a key
read continuously is logged at most twice per lease period, and a new leader's deadline is
never earlier than the reader's (at most half a lease period later). A lease granted in the
last tick before a leader dies is not logged: a new leader covers it with a takeover lease on
every object.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from mooncake_core.store.allocator import OffsetAllocator
from mooncake_core.store.protocol import InvalidArgument
from mooncake_core.store.state_core import ClientInfo, Obj, Reservation, Segment, SliceT, StateCore

__all__ = [
    "ClientEntry",
    "LeaseEntry",
    "ObjEntry",
    "Replication",
    "ResEntry",
    "SegEntry",
    "lease_entries",
    "wall_to_mono",
]

_LEASE_ENTRY_BYTES = 256 << 10  # one ``lease`` entry stays far below etcd's request limit


def wall_to_mono(deadline: float, now: float, wall_now: float) -> float:
    """A replicated wall-clock deadline on this master's monotonic clock (0 stays 0).

    Values below 1e9 were written as monotonic times by masters before this change; they
    are taken as they are."""
    if not deadline or deadline < 1e9:
        return deadline
    return now + (deadline - wall_now)


class ClientEntry(NamedTuple):
    """A client registered (or changed its host, peer or SSD)."""

    kind: str  # "client"
    client_id: str
    host: str
    peer: str
    ssd: bool


class SegEntry(NamedTuple):
    """A segment was mounted."""

    kind: str  # "seg"
    client_id: str
    name: str
    peer: str
    base: int
    size: int
    host: str


class ObjEntry(NamedTuple):
    """An object is complete, or its replicas or SSD copy changed."""

    kind: str  # "obj"
    key: str
    size: int
    replicas: list[list[SliceT]]
    disk: str
    hard_pin: bool
    soft_pin_until: float  # wall clock; 0: none


class LeaseEntry(NamedTuple):
    """Read leases standbys must honour: ``[key, wall-clock deadline]`` pairs."""

    kind: str  # "lease"
    leases: list[list[Any]]


def lease_entries(pairs: list[list[Any]]) -> list[LeaseEntry]:
    """``[key, deadline]`` pairs as ``lease`` entries, each well under etcd's request limit."""
    out: list[LeaseEntry] = []
    cur: list[list[Any]] = []
    size = 0
    for p in pairs:
        cur.append(p)
        size += len(p[0]) + 16
        if size >= _LEASE_ENTRY_BYTES:
            out.append(LeaseEntry("lease", cur))
            cur, size = [], 0
    if cur:
        out.append(LeaseEntry("lease", cur))
    return out


class ResEntry(NamedTuple):
    """A reservation was granted: its uncommitted ``[offset, size]`` blocks."""

    kind: str  # "res"
    rid: int
    client_id: str
    segment: str
    blocks: list[list[int]]
    ttl: float


class Replication(StateCore):
    """Replaying and exporting the replicated state (see module doc)."""

    lease_dirty: dict[str, None] | None = None  # keys whose lease standbys must learn (HA)

    if TYPE_CHECKING:  # provided by HotKeys and ReplicaTasks

        def hot_apply(self, entry: tuple[Any, ...] | list[Any]) -> None: ...
        def hot_export(self) -> list[Any]: ...
        def _hot_forget(self, key: str) -> None: ...
        def rtask_apply(self, entry: tuple[Any, ...] | list[Any], now: float) -> None: ...
        def rtask_export(self) -> list[Any]: ...
        def rtask_takeover(self, now: float) -> None: ...

    def take_leases(self, now: float, wall_now: float) -> None:
        """Emit ``lease`` entries for the marked keys (the leader's tick; see module doc)."""
        dirty, self.lease_dirty = self.lease_dirty, {}
        pairs = []
        for key in dirty or ():
            o = self.objects.get(key)
            if o is not None and o.lease_rep > now:
                pairs.append([key, wall_now + (o.lease_rep - now)])
        for e in lease_entries(pairs):
            self._emit(*e)

    def _lease_mark(self, o: Obj) -> None:
        """A read leased ``o`` beyond what standbys know: log it on the next tick."""
        o.lease_rep = o.lease_until + self.cfg.lease_ttl_s / 2
        if self.lease_dirty is not None:
            self.lease_dirty[o.key] = None

    def apply(self, entry: tuple[Any, ...] | list[Any], now: float) -> None:
        """Replay one change emitted by a leader (standbys; rebuild after takeover)."""
        kind = entry[0]
        if kind == "client":
            ce = ClientEntry._make(entry)
            c = self.clients.get(ce.client_id)
            if c is None:
                self.clients[ce.client_id] = ClientInfo(
                    ce.client_id, ce.host, ce.peer, bool(ce.ssd), now
                )
            else:
                c.host, c.peer, c.ssd = ce.host, ce.peer, bool(ce.ssd)
        elif kind == "unclient":
            c = self.clients.pop(entry[1], None)
            if c is not None:
                for name in list(c.segments):
                    s = self.segments.get(name)
                    if s is not None:
                        self._unmount(s)
        elif kind == "seg":
            se = SegEntry._make(entry)
            if se.name not in self.segments:
                self.segments[se.name] = Segment(
                    se.name,
                    se.client_id,
                    se.peer,
                    se.host,
                    se.base,
                    se.size,
                    OffsetAllocator(se.size),
                )
            c = self.clients.get(se.client_id) or self.clients.setdefault(
                se.client_id, ClientInfo(se.client_id, se.host, se.peer, False, now)
            )
            c.segments.add(se.name)
        elif kind == "unseg":
            s = self.segments.get(entry[1])
            if s is not None:
                self._unmount(s)
                c = self.clients.get(s.client_id)
                if c is not None:
                    c.segments.discard(s.name)
        elif kind == "obj":
            oe = ObjEntry._make(entry)
            key, disk = oe.key, oe.disk
            old = self.objects.get(key)
            lease = (old.lease_until, old.lease_rep) if old is not None else (0.0, 0.0)
            if old is not None:
                for rep in old.replicas:
                    self._free_replica(key, rep)
            reps: list[list[SliceT]] = []
            for rep in oe.replicas:
                rr = [(str(n), int(off), int(ln)) for n, off, ln in rep]
                if all(
                    x[0] in self.segments and self.segments[x[0]].allocator.reserve(x[1], x[2])
                    for x in rr
                ):
                    reps.append(rr)
                    self._index_replica(key, rr)
            pin = wall_to_mono(float(oe.soft_pin_until), now, time.time())
            if old is not None and old.complete and old.size == oe.size:
                o = old  # in place: hot-key marks and replica tasks refer to it
                o.replicas, o.token, o.hard_pin = reps, self._next_token(), bool(oe.hard_pin)
                o.soft_pin_until, o.disk = pin, str(disk)
            else:
                o = Obj(
                    key,
                    oe.size,
                    reps,
                    complete=True,
                    token=self._next_token(),
                    hard_pin=bool(oe.hard_pin),
                    soft_pin_until=pin,
                    disk=str(disk),
                    lease_until=lease[0],
                    lease_rep=lease[1],
                )
            if disk and disk in self.clients:
                self.clients[disk].disk_keys.add(key)
            if reps or o.disk:
                self.objects[key] = o
                self.lru[key] = None
                self.lru.move_to_end(key)
            else:
                self.objects.pop(key, None)
                self.lru.pop(key, None)
        elif kind == "res":
            re_ = ResEntry._make(entry)
            rid = int(re_.rid)
            sg = self.segments.get(re_.segment)
            if sg is not None:
                kept = {
                    int(b): int(n) for b, n in re_.blocks if sg.allocator.reserve(int(b), int(n))
                }
                if kept:
                    self.reservations[rid] = Reservation(
                        rid, str(re_.client_id), str(re_.segment), kept, now + float(re_.ttl)
                    )
            self._rid = max(self._rid, rid)
        elif kind == "carve":
            _, rid, offset, need = entry
            r = self.reservations.get(int(rid))
            if r is not None:
                block = r.block_holding(int(offset), int(need))
                if block is not None:
                    self._carve(r, block, int(offset), int(need), release=True)
                r.deadline = max(r.deadline, now + self.cfg.put_timeout_s)
        elif kind == "unres":
            r = self.reservations.get(int(entry[1]))
            if r is not None:
                self._release_reservation(r, emit=False)
        elif kind == "lease":
            wall_now = time.time()
            for key, deadline in LeaseEntry._make(entry).leases:
                leased = self.objects.get(key)
                if leased is not None:
                    d = wall_to_mono(float(deadline), now, wall_now)
                    leased.lease_until = max(leased.lease_until, d)
                    leased.lease_rep = max(leased.lease_rep, d)
        elif kind == "hot":
            self.hot_apply(entry)
        elif kind == "rtask":
            self.rtask_apply(entry, now)
        elif kind == "del":
            gone = self.objects.get(entry[1])
            if gone is not None:
                for rep in gone.replicas:
                    self._free_replica(gone.key, rep)
                self.objects.pop(gone.key, None)
                self.lru.pop(gone.key, None)
            self._hot_forget(entry[1])
        else:
            raise InvalidArgument(f"unknown oplog entry kind {kind!r}")

    def export(self) -> list[tuple[Any, ...]]:
        """Entries that rebuild the replicated state with :meth:`apply` (a snapshot)."""
        out: list[tuple[Any, ...]] = [
            ClientEntry("client", c.client_id, c.host, c.peer, c.ssd) for c in self.clients.values()
        ]
        out += [
            SegEntry("seg", s.client_id, s.name, s.peer, s.base, s.size, s.host)
            for s in self.segments.values()
        ]
        out += [self._obj_entry(o) for o in self.objects.values() if o.complete]
        now, wall_now = time.monotonic(), time.time()
        leases = [
            [o.key, wall_now + (max(o.lease_until, o.lease_rep) - now)]
            for o in self.objects.values()
            if o.complete and max(o.lease_until, o.lease_rep) > now
        ]
        out += lease_entries(leases)
        out += [
            ResEntry(
                "res",
                r.rid,
                r.client_id,
                r.segment,
                [[b, n] for b, n in sorted(r.blocks.items())],
                self.cfg.put_timeout_s,
            )
            for r in self.reservations.values()
        ]
        return out + self.hot_export() + self.rtask_export()

    def on_takeover(self, now: float, lease_s: float | None = None) -> None:
        """A new leader: every client gets a fresh liveness period, every object a lease of
        ``lease_s`` (default: the read lease) on top of its replicated one."""
        for c in self.clients.values():
            c.last_seen = now
        grace = now + (self.cfg.lease_ttl_s if lease_s is None else lease_s)
        for o in self.objects.values():
            o.lease_until = max(o.lease_until, grace)
        for r in self.reservations.values():  # a client may still be writing into them
            r.deadline = max(r.deadline, now + self.cfg.put_timeout_s)
        self.rtask_takeover(now)  # replica copies in flight are queued again
