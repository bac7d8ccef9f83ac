"""Replica copy and move tasks: one object's replica copied to, or moved between, named segments.

Contract (master side, :class:`ReplicaTasks`, a part of ``MasterState``; the published
store's ``create_copy_task`` / ``create_move_task`` / ``query_task``):

- ``create_replica_task(client_id, "copy", key, targets)`` gives the object one more memory
  replica on each named segment that holds none yet; ``"move"`` with ``source`` and one
  target puts a replica on the target (unless it holds one) and then drops the one on the
  source. Refused at once: an unknown or incomplete key (:class:`ObjectNotFound`), no
  targets, an unknown segment, a move whose source holds no replica of the object or equals
  the target (:class:`InvalidArgument`), no space on a target (:class:`NoSpace`).
- The copy itself is done as hot-key copies are (store/hotkeys.py): the owner of the target
  segment gets a ``copy`` task (source slices, destination slices), reads the source through
  the transfer engine, writes its own segment and reports ``task_done``; only then is the
  replica listed, under a new version token. The object carries a read lease meanwhile, so
  the source is not evicted under the copy.
- A move drops its source replica once the copy is listed and no read lease granted before
  or during the task is left on the object (a reader that was told about the source may
  still be reading it); until then the task stays ``PROCESSING``. The last replica is never
  dropped.
- ``query_replica_task(task_id)``: ``{id, type, status, created_ms, updated_ms,
  assigned_client, message}`` or None for an unknown id. Status: ``PENDING`` (created, copies
  in flight), ``PROCESSING`` (copied, the move waits to drop its source), ``SUCCESS``,
  ``FAILED`` (a copy failed, was not reported within ``put_timeout_s``, or the object changed
  or went away meanwhile; ``message`` says which). Finished tasks are kept for an hour (at
  most :data:`MAX_TASKS` tasks in all).
- ``drop_replicas(client_id, key, segment)`` drops the replicas on one client's segments
  while another replica is left (refused while read-leased or pinned).
- HA: tasks are replicated. Every change of a task (created, a copy reported, a status
  change) is logged as an ``rtask`` entry (:class:`RTaskEntry`: the task and its copies in
  flight, with their destination ranges; a copy's entry comes before the ``obj`` entry that
  lists its replica) and snapshots carry one per task kept. A standby keeps each copy's
  destination range reserved; a new leader (:meth:`ReplicaTasks.rtask_takeover`) gives
  every copy still in flight a fresh ``put_timeout_s`` and queues it again for the
  destination's client, which may still report the one the old leader gave it: the first
  report lists the replica and takes the queued duplicate back. A task queued or running
  at a takeover thus finishes on the new leader (or fails with its reason), and
  ``query_task`` answers there with the same id. The read lease a task sets on its object
  is replicated like a read lease.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy
from mooncake_core.store.replication import wall_to_mono
from mooncake_core.store.state_core import Obj, Segment, SliceT, StateCore

__all__ = ["MAX_TASKS", "RTaskEntry", "ReplicaTasks", "TASK_STATUS", "TASK_TYPES"]

logger = logging.getLogger(__name__)

#: The published ``TaskType`` / ``TaskStatus`` numbers.
TASK_TYPES = {"copy": 0, "move": 1}
TASK_STATUS = {"PENDING": 0, "PROCESSING": 1, "FAILED": 2, "SUCCESS": 3}
MAX_TASKS = 4096
_KEEP_S = 3600.0
_DONE = "Task completed successfully"


@dataclass(slots=True)
class _Task:
    id: str
    kind: str
    key: str
    obj: Obj
    source: str
    assigned: str
    created_ms: int
    updated_ms: int = 0
    status: str = "PENDING"
    message: str = ""
    copies: set[int] = field(default_factory=set)
    finished_at: float = 0.0
    lease_before: float = 0.0  # the object's read lease before the task leased it
    lease_mine: float = 0.0  # the lease the task set (a read since then extends it)


@dataclass(slots=True)
class _TaskCopy:
    task: _Task
    src: list[SliceT]
    dst: list[SliceT]
    seg: Segment
    deadline: float


class RTaskEntry(NamedTuple):
    """(HA) a replica task as it is now; ``copies``: ``[token, src, dst]`` still in flight."""

    kind: str  # "rtask"
    id: str
    type: str  # "copy" or "move"
    key: str
    source: str
    assigned: str
    created_ms: int
    updated_ms: int
    status: str
    message: str
    copies: list[list[Any]]
    lease_before: float  # wall clock; 0: none
    lease_mine: float


def _now_ms() -> int:
    return int(time.time() * 1000)


def _on(rep: list[SliceT], segment: str) -> bool:
    return all(x[0] == segment for x in rep)


class ReplicaTasks(StateCore):
    """Copy and move tasks on named segments (see module doc)."""

    rtasks: dict[str, _Task]
    rtask_copies: dict[int, _TaskCopy]

    def _rtask_init(self) -> None:
        self.rtasks = {}
        self.rtask_copies = {}
        for k in ("replica_tasks_done", "replica_tasks_failed"):
            self.counters[k] = 0

    # ------------------------------------------------------------------ requests
    def create_replica_task(
        self, client_id: str, kind: str, key: str, targets: list[str], source: str, now: float
    ) -> str:
        """Start a copy or move of ``key``'s replica; returns the task id (hex)."""
        self._client(client_id, now)
        if kind not in TASK_TYPES:
            raise InvalidArgument(f"replica task: unknown kind {kind!r} (copy or move)")
        o = self.objects.get(key)
        if o is None or not o.complete or not o.replicas:
            raise ObjectNotFound(f"replica task: no object {key!r}")
        if not targets:
            raise InvalidArgument(f"replica task {key!r}: no target segment")
        for name in [*targets, *([source] if kind == "move" else [])]:
            if name not in self.segments:
                raise InvalidArgument(f"replica task {key!r}: unknown segment {name!r}")
        src_rep: list[SliceT] | None = None
        if kind == "move":
            if len(targets) != 1 or targets[0] == source:
                raise InvalidArgument(f"move of {key!r}: the target must differ from the source")
            src_rep = next((r for r in o.replicas if _on(r, source)), None)
            if src_rep is None:
                raise InvalidArgument(f"move of {key!r}: segment {source!r} holds no replica")
        wanted = [t for t in dict.fromkeys(targets) if not any(_on(r, t) for r in o.replicas)]
        allocs: list[tuple[Segment, int]] = []
        for name in wanted:
            seg = self.segments[name]
            off = seg.allocator.allocate(o.size) if seg.client_id in self.clients else None
            if off is None:
                for s, at in allocs:
                    s.allocator.release(at)
                raise NoSpace(f"replica task {key!r}: no room for {o.size} bytes on {name!r}")
            allocs.append((seg, off))
        self._rtask_trim(now)
        task = _Task(
            id=uuid.uuid4().hex,
            kind=kind,
            key=key,
            obj=o,
            source=source if kind == "move" else "",
            assigned=allocs[0][0].client_id if allocs else client_id,
            created_ms=_now_ms(),
        )
        task.updated_ms = task.created_ms
        task.lease_before = o.lease_until
        if allocs:  # the source must not be evicted under the copy
            self._hold(o, now + self.cfg.lease_ttl_s)
            task.lease_mine = o.lease_until
        self.rtasks[task.id] = task
        src = src_rep if src_rep is not None else o.replicas[0]
        for seg, off in allocs:
            tok = self._next_token()
            dst = [(seg.name, off, o.size)]
            cp = _TaskCopy(task, src, dst, seg, now + self.cfg.put_timeout_s)
            self.rtask_copies[tok] = cp
            task.copies.add(tok)
            self._rtask_push(tok, cp)
        self._rtask_emit(task)
        if not task.copies:
            self._rtask_advance(task, now)
        return task.id

    def _rtask_push(self, tok: int, cp: _TaskCopy) -> None:
        c = self.clients.get(cp.seg.client_id)
        if c is None:
            return  # not reported in time: the tick fails the task
        self._push(
            c,
            {
                "kind": "copy",
                "key": cp.task.key,
                "token": tok,
                "src": self._slices_out(cp.src),
                "dst": self._slices_out(cp.dst),
            },
        )

    def drop_replicas(self, client_id: str, key: str, segment: str, now: float) -> int:
        """Drop ``key``'s replicas that lie on ``segment`` (or the segments ``segment#N`` its
        client mounted later) while another replica is left; the number dropped (0 when none
        lies there or none would be left). :class:`ObjectBusy` while read-leased or pinned
        (the published ``batch_replica_clear`` with a segment name)."""
        self._client(client_id, now)
        o = self.objects.get(key)
        if o is None or not o.complete:
            raise ObjectNotFound(f"drop replicas: no object {key!r}")
        if o.lease_until > now or o.busy or o.hard_pin:
            raise ObjectBusy(f"drop replicas of {key!r}: the object is leased or pinned")
        here = [
            r for r in o.replicas if all(x[0] == segment or x[0].startswith(segment + "#")
                                         for x in r)
        ]  # fmt: skip
        if not here or len(here) == len(o.replicas):
            return 0
        for rep in here:
            o.replicas.remove(rep)
            self._free_replica(key, rep)
        o.token = self._next_token()
        self._emit(*self._obj_entry(o))
        return len(here)

    def query_replica_task(self, task_id: str) -> dict[str, Any] | None:
        t = self.rtasks.get(task_id)
        if t is None:
            return None
        return {
            "id": t.id,
            "type": TASK_TYPES[t.kind],
            "status": TASK_STATUS[t.status],
            "created_ms": t.created_ms,
            "updated_ms": t.updated_ms,
            "assigned_client": t.assigned,
            "message": t.message,
        }

    # ------------------------------------------------------------------ progress
    def replica_task_done(self, token: int, ok: bool, detail: str, now: float) -> bool:
        """A client finished a ``copy`` task; False when ``token`` is not one of ours."""
        cp = self.rtask_copies.pop(token, None)
        if cp is None:
            return False
        t = cp.task
        t.copies.discard(token)
        c = self.clients.get(cp.seg.client_id)
        if c is not None and c.tasks:  # a copy queued again by a new leader: not needed now
            c.tasks = deque(x for x in c.tasks if x["kind"] != "copy" or x["token"] != token)
        o = t.obj
        alive = self.objects.get(o.key) is o and cp.src in o.replicas
        if not ok or not alive or self.segments.get(cp.seg.name) is not cp.seg:
            self._rtask_free(cp)
            why = f"copy to {cp.seg.name} failed: {detail}" if not ok else "the object changed"
            self._rtask_fail(t, why)
            return True
        self._rtask_emit(t)  # before the obj entry: a standby frees the range, then lists it
        if t.status == "PENDING":
            o.replicas.append(cp.dst)
            self._index_replica(o.key, cp.dst)
            o.token = self._next_token()  # a new memory replica: a new version
            self._emit(*self._obj_entry(o))
        else:
            self._rtask_free(cp)
        if not t.copies:
            self._rtask_advance(t, now)
        return True

    def replica_task_tick(self, now: float) -> None:
        """Fail copies not reported in time; drop moved sources once unleased."""
        for tok, cp in list(self.rtask_copies.items()):
            if now >= cp.deadline:
                del self.rtask_copies[tok]
                cp.task.copies.discard(tok)
                self._rtask_free(cp)
                self._rtask_fail(cp.task, f"copy to {cp.seg.name} was not reported in time")
        for t in list(self.rtasks.values()):
            if t.status == "PROCESSING":
                self._rtask_advance(t, now)

    def _rtask_advance(self, t: _Task, now: float) -> None:
        """Copies done: finish a copy; a move drops its source when no lease is left."""
        o = t.obj
        if t.status not in ("PENDING", "PROCESSING"):
            return
        if self.objects.get(o.key) is not o:
            self._rtask_fail(t, "the object was removed")
            return
        own_lease = o.lease_until == t.lease_mine  # no read since the task leased it
        if t.kind == "move":
            rep = next((r for r in o.replicas if _on(r, t.source)), None)
            if rep is not None:
                leased = t.lease_before > now if own_lease else o.lease_until > now
                if leased or o.busy or len(o.replicas) < 2:
                    self._rtask_set(t, "PROCESSING", "")
                    return
                o.replicas.remove(rep)
                self._free_replica(o.key, rep)
                o.token = self._next_token()
                self._emit(*self._obj_entry(o))
        if own_lease and t.lease_mine:
            o.lease_until = t.lease_before
        self.counters["replica_tasks_done"] += 1
        self._rtask_set(t, "SUCCESS", _DONE, now)

    def _rtask_fail(self, t: _Task, why: str) -> None:
        """Fail ``t`` (its copies changed: logged even when it had failed already)."""
        if t.status in ("SUCCESS", "FAILED"):
            self._rtask_emit(t)
            return
        logger.warning("replica %s of %r failed: %s", t.kind, t.key, why)
        self.counters["replica_tasks_failed"] += 1
        self._rtask_set(t, "FAILED", why, time.monotonic())

    def _rtask_set(self, t: _Task, status: str, message: str, now: float = 0.0) -> None:
        changed = (t.status, t.message) != (status, message)
        t.status, t.message, t.updated_ms = status, message, _now_ms()
        if now:
            t.finished_at = now
        if changed:
            self._rtask_emit(t)

    # ------------------------------------------------------------------ HA
    def _rtask_entry(self, t: _Task, now: float, wall_now: float) -> RTaskEntry:
        copies = [
            [tok, cp.src, cp.dst] for tok in sorted(t.copies) if (cp := self.rtask_copies.get(tok))
        ]

        def wall(d: float) -> float:
            return wall_now + (d - now) if d else 0.0

        return RTaskEntry(
            "rtask", t.id, t.kind, t.key, t.source, t.assigned, t.created_ms, t.updated_ms,
            t.status, t.message, copies, wall(t.lease_before), wall(t.lease_mine),
        )  # fmt: skip

    def _rtask_emit(self, t: _Task) -> None:
        if self.on_change is not None:
            self._emit(*self._rtask_entry(t, time.monotonic(), time.time()))

    def rtask_export(self) -> list[RTaskEntry]:
        """``rtask`` entries for a snapshot (after the ``obj`` entries)."""
        now, wall_now = time.monotonic(), time.time()
        return [self._rtask_entry(t, now, wall_now) for t in self.rtasks.values()]

    def rtask_apply(self, entry: tuple[Any, ...] | list[Any], now: float) -> None:
        """(Standby) replay an ``rtask`` entry: the task as it is now, its copies' ranges
        reserved (those no longer in flight are freed: a listed one comes back with the
        ``obj`` entry that follows)."""
        e = RTaskEntry._make(entry)
        t = self.rtasks.get(e.id)
        held: dict[int, _TaskCopy] = {}
        if t is not None:
            for tok in t.copies:
                cp = self.rtask_copies.pop(tok, None)
                if cp is not None:
                    held[tok] = cp
        else:
            o = self.objects.get(e.key) or Obj(e.key, 0, [])  # gone: the task fails on takeover
            t = self.rtasks[e.id] = _Task(
                str(e.id), str(e.type), str(e.key), o, str(e.source), "", int(e.created_ms)
            )
        wall_now = time.time()
        t.assigned, t.updated_ms = str(e.assigned), int(e.updated_ms)
        t.status, t.message = str(e.status), str(e.message)
        t.lease_before = wall_to_mono(float(e.lease_before), now, wall_now)
        t.lease_mine = wall_to_mono(float(e.lease_mine), now, wall_now)
        t.finished_at = now if t.status in ("SUCCESS", "FAILED") else 0.0
        t.copies = set()
        for tok, src, dst in e.copies:
            tok = int(tok)
            cp = held.pop(tok, None)
            if cp is None:
                d = [(str(n), int(off), int(ln)) for n, off, ln in dst]
                seg = self.segments.get(d[0][0]) if len(d) == 1 else None
                if seg is None or not seg.allocator.reserve(d[0][1], d[0][2]):
                    t.status, t.message = "FAILED", f"copy to {d[0][0]} lost in replication"
                    continue
                s = [(str(n), int(off), int(ln)) for n, off, ln in src]
                cp = _TaskCopy(t, s, d, seg, now + self.cfg.put_timeout_s)
            self.rtask_copies[tok] = cp
            t.copies.add(tok)
        for cp in held.values():
            self._rtask_free(cp)
        if len(self.rtasks) > MAX_TASKS:
            done = [k for k, x in self.rtasks.items() if x.finished_at]
            for k in done[: len(self.rtasks) - MAX_TASKS]:
                del self.rtasks[k]

    def rtask_takeover(self, now: float) -> None:
        """(A new leader) queue every copy in flight again, with a fresh deadline."""
        for tok, cp in list(self.rtask_copies.items()):
            if self.segments.get(cp.seg.name) is not cp.seg or cp.seg.client_id not in self.clients:
                del self.rtask_copies[tok]
                cp.task.copies.discard(tok)
                self._rtask_fail(cp.task, f"copy to {cp.seg.name}: the segment went away")
                continue
            cp.deadline = now + self.cfg.put_timeout_s
            self._rtask_push(tok, cp)
        for t in list(self.rtasks.values()):
            if t.status == "PENDING" and not t.copies:
                self._rtask_advance(t, now)

    def _rtask_free(self, cp: _TaskCopy) -> None:
        if self.segments.get(cp.seg.name) is cp.seg:
            cp.seg.allocator.release(cp.dst[0][1])

    def _rtask_trim(self, now: float) -> None:
        for tid, t in list(self.rtasks.items()):
            if t.finished_at and now - t.finished_at > _KEEP_S:
                del self.rtasks[tid]
        while len(self.rtasks) >= MAX_TASKS:
            done = [k for k, t in self.rtasks.items() if t.finished_at]
            if not done:
                raise InvalidArgument(f"{MAX_TASKS} replica tasks are still running; retry later")
            del self.rtasks[done[0]]
