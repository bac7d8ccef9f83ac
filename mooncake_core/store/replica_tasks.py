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
- Tasks live on the master that created them: they are not replicated to HA standbys (the
  replicas they add or drop are, as ordinary object changes).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy
from mooncake_core.store.state_core import Obj, Segment, SliceT, StateCore

__all__ = ["MAX_TASKS", "ReplicaTasks", "TASK_STATUS", "TASK_TYPES"]

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
            o.lease_until = task.lease_mine = max(o.lease_until, now + self.cfg.lease_ttl_s)
        self.rtasks[task.id] = task
        src = src_rep if src_rep is not None else o.replicas[0]
        for seg, off in allocs:
            tok = self._next_token()
            dst = [(seg.name, off, o.size)]
            cp = _TaskCopy(task, src, dst, seg, now + self.cfg.put_timeout_s)
            self.rtask_copies[tok] = cp
            task.copies.add(tok)
            self._push(
                self.clients[seg.client_id],
                {
                    "kind": "copy",
                    "key": key,
                    "token": tok,
                    "src": self._slices_out(src),
                    "dst": self._slices_out(dst),
                },
            )
        if not task.copies:
            self._rtask_advance(task, now)
        return task.id

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
        o = t.obj
        alive = self.objects.get(o.key) is o and cp.src in o.replicas
        if not ok or not alive or self.segments.get(cp.seg.name) is not cp.seg:
            self._rtask_free(cp)
            why = f"copy to {cp.seg.name} failed: {detail}" if not ok else "the object changed"
            self._rtask_fail(t, why)
            return True
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
        if t.status in ("SUCCESS", "FAILED"):
            return
        logger.warning("replica %s of %r failed: %s", t.kind, t.key, why)
        self.counters["replica_tasks_failed"] += 1
        self._rtask_set(t, "FAILED", why, time.monotonic())

    @staticmethod
    def _rtask_set(t: _Task, status: str, message: str, now: float = 0.0) -> None:
        t.status, t.message, t.updated_ms = status, message, _now_ms()
        if now:
            t.finished_at = now

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
