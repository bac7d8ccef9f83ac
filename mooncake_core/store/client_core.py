"""What every part of the store client shares: the master connection and moving bytes.

:class:`ClientCore` is the base of :class:`~mooncake_core.store.client.StoreClient` and of the
parts it is built from (:mod:`~mooncake_core.store.lending` for one-RPC puts through
reservations, :mod:`~mooncake_core.store.reads` for reads of remembered replicas). It
holds no state of its own: ``StoreClient.__init__`` sets the attributes declared here.

- Master calls: :meth:`ClientCore._call` registers again (and re-mounts) when the master
  forgot this client, :meth:`ClientCore._retrying` repeats a call the master asks to retry.
- Data movement: an object is a :class:`~mooncake_core.store.buffers.LocalBuffer` on this side
  and a list of :class:`~mooncake_core.store.protocol.SliceW` (one replica) on the holders;
  slices in this client's own segments are copied with ``memmove``, the others become
  transfer requests. :meth:`ClientCore._rank` orders replicas: own segments, then the same
  host (shared memory), then the rest.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from mooncake_core.config import MooncakeConfig
from mooncake_core.errors import StoreError, TransportError
from mooncake_core.store import protocol as P
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.locations import LocationCache
from mooncake_core.store.protocol import SliceW
from mooncake_core.store.rpc import MasterRPC
from mooncake_core.store.ssd import SsdTier
from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_core.transfer.memory import ManagedBuffer, memmove

__all__ = ["ClientCore", "HolderUnreachable", "Job"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Job = tuple[int, LocalBuffer, Sequence[SliceW]]
"""One object of a batch move: (its index in the batch, local side, the replica's slices)."""


class HolderUnreachable(TransportError):
    """A write into ``segments`` failed on the holders' side (a holder died, or cannot be reached
    from here): the put may be placed again on other segments
    (:mod:`~mooncake_core.store.placement_retry`)."""

    def __init__(self, message: str, segments: Collection[str]) -> None:
        super().__init__(message)
        self.segments = frozenset(segments)


class ClientCore:
    """The shared base of the store client's parts (see module doc)."""

    config: MooncakeConfig
    client_id: str
    engine: TransferEngine
    rpc: MasterRPC
    transport: str | None
    ssd: SsdTier | None
    lease_ttl_s: float
    heartbeat_s: float
    _early: bool  # the master takes early commits (set at registration)
    _closed: bool
    _mount_lock: threading.Lock
    _segments: dict[str, ManagedBuffer]
    _seg_names: list[str]
    _where: LocationCache
    _where_max: int
    location_hits: int
    location_misses: int
    reads_by_segment: dict[str, int]  # slices read, per segment read from (store/hotkeys.py)
    _failed_peers: dict[str, float]  # peer -> when a remembered read from it failed (reads.py)

    # ------------------------------------------------------------------ the master
    def _register(self) -> None:
        info = self.rpc.call(
            "register_client",
            (self.client_id, self.engine.host_id, self.engine.name, self.ssd is not None),
        )
        self.lease_ttl_s = float(info.get("lease_ttl_s", self.lease_ttl_s))
        self.heartbeat_s = float(info.get("heartbeat_s", self.heartbeat_s))
        self._early = self.config.store.early_commit and bool(info.get("early_commit", False))

    def _remount(self) -> None:
        """After the master forgot us (expiry): register again and re-mount our segments."""
        with self._mount_lock:
            self._register()
            for name in self._seg_names:
                buf = self._segments[name]
                try:
                    self.rpc.call(
                        "mount",
                        (
                            self.client_id,
                            name,
                            self.engine.name,
                            buf.addr,
                            buf.length,
                            self.engine.host_id,
                        ),
                    )
                except P.InvalidArgument as exc:
                    logger.warning("re-mounting %s failed: %s", name, exc)

    def _call(self, method: str, params: Any, typ: Any = Any) -> Any:
        try:
            return self.rpc.call(method, params, typ=typ)
        except P.UnknownClient:
            if self._closed:
                raise
            logger.warning("the master forgot client %s; registering again", self.client_id)
            self._remount()
            return self.rpc.call(method, params, typ=typ)

    def _retrying(self, fn: Callable[[], T], what: str, timeout: float = 10.0) -> T:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                return fn()
            except P.RetryLater:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"{what}: the master kept asking to retry for {timeout:.0f}s"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    @staticmethod
    def _answer(res: Any) -> tuple[int, list[list[SliceW]], float, int]:
        """(size, replicas, lease ttl, version token) from a ``get_replica_list`` answer."""
        size, reps, ttl = res[0], res[1], res[2]
        token = (
            int(res[3]) if len(res) > 3 else 0
        )  # masters before versions: no token, nothing remembered
        return int(size), [[SliceW._make(s) for s in rep] for rep in reps], float(ttl), token

    def _forget(self, keys: Sequence[str] | None) -> None:
        """Drop remembered locations of ``keys`` (None: all)."""
        self._where.forget(keys)

    # ------------------------------------------------------------------ data movement
    def _own(self, s: SliceW) -> ManagedBuffer | None:
        buf = self._segments.get(s.segment)
        if buf is not None and buf.addr <= s.addr and s.addr + s.length <= buf.addr + buf.length:
            return buf
        return None

    def _move(self, op: str, jobs: Sequence[tuple[LocalBuffer, Sequence[SliceW]]]) -> None:
        """Move each local object to/from its replica slices; raises on any failure."""
        reqs = self._requests(op, jobs)
        if reqs:
            self.engine.transfer(reqs)

    def _requests(
        self, op: str, jobs: Sequence[tuple[LocalBuffer, Sequence[SliceW]]]
    ) -> list[TransferRequest]:
        reqs: list[TransferRequest] = []
        rb = self.reads_by_segment if op == "read" else None
        for local, slices in jobs:
            off = 0
            for s in slices:
                n = s.length
                if rb is not None:
                    rb[s.segment] = rb.get(s.segment, 0) + 1
                if self._own(s) is not None:
                    la = local.address() + off
                    if op == "read":
                        memmove(la, s.addr, n)
                    else:
                        memmove(s.addr, la, n)
                else:
                    reqs.append(
                        TransferRequest(
                            op, s.peer, local.part(off, n), n, s.addr, transport=self.transport
                        )
                    )
                off += n
        return reqs

    def _write(self, jobs: Sequence[tuple[LocalBuffer, Sequence[SliceW]]]) -> None:
        """Write each local object to its replica slices, as ``_move("write", jobs)``; a failure
        on the holders' side raises :class:`HolderUnreachable` naming the segments of the holders
        that failed. Errors of the local side (an address this engine has not registered) and
        errors other than transfer errors raise as they are."""
        peers = {s.peer for _local, slices in jobs for s in slices if self._own(s) is None}
        if len(peers) > 1:  # which holder failed: the batch's per-request statuses say
            out: list[BaseException | None] = [None] * len(jobs)
            bad = self._batch_move(
                "write", [(i, local, slices) for i, (local, slices) in enumerate(jobs)], out
            )
            if not bad:
                return
            err = next(e for e in out if e is not None)
            segs = {g for i in bad for g in bad[i]}
            if any(not isinstance(out[i], TransportError) for i in bad):
                raise err
            raise HolderUnreachable(f"writing into {', '.join(sorted(segs))}: {err}", segs) from err
        try:
            self._move("write", jobs)
        except TransportError as exc:
            for local, _slices in jobs:
                if local.view is None:  # an address: is it ours? (raises InvalidRequest if not)
                    self.engine.segments.find(local.addr, local.length)
            segs = {s.segment for _local, slices in jobs for s in slices if s.peer in peers}
            raise HolderUnreachable(f"writing into {', '.join(sorted(segs))}: {exc}", segs) from exc

    def _batch_write(self, jobs: Sequence[Job], out: list[BaseException | None]) -> set[int]:
        """Write each job's object ``(i, local, slices)`` in one transfer batch; returns the
        ``i`` whose bytes did not all land (``out[i]`` gets the first error)."""
        return set(self._batch_move("write", jobs, out))

    def _batch_move(
        self, op: str, jobs: Sequence[Job], out: list[BaseException | None] | None
    ) -> dict[int, set[str]]:
        """Move each job's object ``(i, local, slices)`` in one transfer batch; returns, for each
        ``i`` whose bytes did not all move, the segments whose transfers failed (``out[i]``, if
        given, gets the first error)."""
        reqs: list[TransferRequest] = []
        owner: list[int] = []  # the job of each request
        starts: list[int] = []  # each job's first request
        for k, (_i, local, slices) in enumerate(jobs):
            starts.append(len(reqs))
            r = self._requests(op, [(local, slices)])
            reqs.extend(r)
            owner.extend([k] * len(r))
        failed: dict[int, set[str]] = {}
        if reqs:
            batch = self.engine.submit(reqs)
            try:
                batch.wait()
            except (TransportError, OSError):
                for q, st in enumerate(batch.statuses):
                    if st.state != "completed":
                        k = owner[q]
                        i, _local, slices = jobs[k]
                        # a job's requests are its slices not in our own segments, in order
                        remote = [s for s in slices if self._own(s) is None]
                        failed.setdefault(i, set()).add(remote[q - starts[k]].segment)
                        if out is not None:
                            out[i] = out[i] or st.error or TransportError("transfer failed")
        return failed

    def _rank(self, replicas: list[list[SliceW]]) -> list[list[SliceW]]:
        host = self.engine.host_id

        def score(rep: list[SliceW]) -> tuple[int, float]:
            if all(self._own(s) is not None for s in rep):
                return (0, 0.0)
            if all(s.host == host for s in rep):
                return (1, random.random())
            return (2, random.random())

        return sorted(replicas, key=score)
