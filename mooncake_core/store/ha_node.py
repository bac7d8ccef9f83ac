"""The HA side of a master: group-committed oplog writes, the election loop, snapshots in etcd.

:class:`HANode` is a mixin of :class:`~mooncake_core.store.master.MasterServer` (the design
is in :mod:`mooncake_core.store.ha`):

- ``_flusher``: every change entry produced by RPCs is written to the oplog in one fenced
  etcd transaction per group, and the RPCs are answered once that write is durable.
- ``_ha_loop``: a standby loads the newest snapshot in etcd, tails the oplog after it and
  campaigns; on winning it reads the log to its end and takes over (every object gets
  ``takeover_lease_s`` of lease on top of the leases the log replicated). A leader checks
  that it still holds the leader key and steps down otherwise.
- Snapshots in etcd (:class:`~mooncake_core.store.ha.Snapshots`): every
  ``snapshot_every`` oplog batches, and every ``snapshot_interval_s`` seconds when the log
  grew, the leader writes its state and trims the log below the oldest snapshot kept
  (``snapshot_retention``).
- Leases are replicated coarsely (:meth:`Replication.take_leases`): once per tick, the
  keys whose lease outgrew what standbys know, each with a deadline half a lease period
  longer than needed, so a key read continuously is logged at most twice per lease period.

Thread-safety: everything runs on the master's event loop; etcd calls go to the default
executor with arguments taken on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mooncake_core.config import StoreConfig
from mooncake_core.errors import MetadataError
from mooncake_core.store.ha import Snapshots
from mooncake_core.store.master_conn import Conn
from mooncake_core.store.state import MasterState

__all__ = ["HANode"]

logger = logging.getLogger(__name__)


class HANode:
    """The HA methods of ``MasterServer`` (see module doc)."""

    cfg: StoreConfig
    state: MasterState
    tenant_quotas: dict[str, Any]
    id: str
    role: str
    leader_hint: str
    ha_lease_ttl_s: float
    snapshot_every: int
    snapshot_interval_s: float
    snapshot_retention: int
    takeover_lease_s: float | None
    _etcd: Any
    _me: Any
    _seq: int
    _snap_seq: int
    _snap_time: float
    _snapshotting: bool
    _log: list[Any]
    _flush_waiters: list[asyncio.Future[None]]
    _flush_wake: asyncio.Event | None
    _stopped: asyncio.Event | None
    _handlers: dict[str, Any]

    if TYPE_CHECKING:

        def _wake_poller(self, client_id: str) -> None: ...
        def _make_handlers(self) -> dict[str, Any]: ...
        def _change_sink(self) -> Callable[[tuple[Any, ...]], None]: ...

    def _ha_tick(self, now: float) -> None:
        """(Leader, HA; on the master's tick) log the leases standbys must learn, and start a
        snapshot when one is due."""
        if self.state.lease_dirty:
            self.state.take_leases(now, time.time())
        if self._snapshot_due():
            self._snapshotting = True
            asyncio.ensure_future(self._snapshot())

    def _snapshot_due(self) -> bool:
        """(Leader, HA) a snapshot is due: the log grew by ``snapshot_every`` batches, or it
        grew at all and ``snapshot_interval_s`` passed since the last one."""
        if self._snapshotting or self._seq <= self._snap_seq:
            return False
        if self._seq - self._snap_seq >= self.snapshot_every:
            return True
        return 0 < self.snapshot_interval_s <= time.monotonic() - self._snap_time

    async def _reply_when_durable(self, conn: Conn, out: bytes) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        assert self._flush_wake is not None
        self._flush_wake.set()
        try:
            await fut
        except MetadataError as exc:
            logger.error("oplog write failed, dropping the reply: %s", exc)
            conn.transport.close() if conn.transport is not None else None
            return
        conn.send(out)

    async def _flusher(self) -> None:
        """Group commit: write every pending entry in one fenced etcd transaction."""
        assert self._flush_wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            if not self._flush_waiters:
                continue
            entries = self._log[:]  # on_change is bound to this list: copy and clear in place
            self._log.clear()
            waiters, self._flush_waiters = self._flush_waiters, []
            try:
                if entries:
                    self._seq = await loop.run_in_executor(
                        None, self._etcd.append, self._me, self._seq, entries
                    )
                    if self._snapshot_due():
                        self._snapshotting = True
                        asyncio.ensure_future(self._snapshot())
                for w in waiters:
                    if not w.done():
                        w.set_result(None)
            except MetadataError as exc:
                for w in waiters:
                    if not w.done():
                        w.set_exception(exc)
                self._step_down(str(exc))

    async def _snapshot(self) -> None:
        """Write the state as of the current seq into etcd and trim the oplog."""
        seq, entries = self._seq, self.state.export()  # consistent: taken in one loop step
        self._snap_time = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, Snapshots(self._etcd, self.snapshot_retention).write, self._me, seq, entries
            )
            self._snap_seq = seq
            logger.info("snapshot in etcd at oplog seq %d (%d entries)", seq, len(entries))
        except Exception as exc:  # etcd hiccups: the next one is due soon
            logger.warning("snapshot at seq %d failed: %s", seq, exc)
        finally:
            self._snapshotting = False

    async def _load_snapshot(self) -> None:
        """(Standby) replace the state with the newest complete snapshot, if there is one."""
        snap = await asyncio.get_running_loop().run_in_executor(
            None, Snapshots(self._etcd, self.snapshot_retention).load
        )
        if snap is None:
            return
        seq, entries = snap
        self.state = MasterState(self.cfg)
        self.state.tenant_quotas = self.tenant_quotas
        self.state.on_task = self._wake_poller
        self.state.lease_dirty = {}
        self._handlers = self._make_handlers()
        self._apply([(seq - 1, entries)])
        self._snap_seq = seq
        logger.info("loaded snapshot at seq %d (%d entries)", seq, len(entries))

    def _step_down(self, why: str) -> None:
        if self.role == "leader":
            logger.error("stepping down: %s", why)
        self.role = "deposed"
        if self._stopped is not None:
            self._stopped.set()

    async def _ha_loop(self) -> None:
        """Standby: tail the oplog and campaign; leader: watch that we still lead."""
        loop = asyncio.get_running_loop()
        etcd = self._etcd
        lease = await loop.run_in_executor(None, etcd.grant_lease, self.ha_lease_ttl_s)
        loaded = False
        stale_lease = False
        while True:
            try:
                if stale_lease:  # campaigning with an expired lease fails forever: take a new one
                    await loop.run_in_executor(None, etcd.revoke_lease, lease)
                    lease = await loop.run_in_executor(None, etcd.grant_lease, self.ha_lease_ttl_s)
                    stale_lease = False
                    logger.warning(
                        "HA loop: our etcd lease had expired; campaigning with a new one"
                    )
                if not loaded:
                    await self._load_snapshot()
                    loaded = True
                if self.role == "leader":
                    await asyncio.sleep(max(0.2, self.ha_lease_ttl_s / 4))
                    if not await loop.run_in_executor(None, etcd.still_leader, self._me):
                        self._step_down("the leader key in etcd is no longer ours")
                        return
                    continue
                if await self._catch_up() >= 512:
                    continue  # more to read before campaigning
                won = await loop.run_in_executor(None, etcd.campaign, self._me, lease)
                if not won:  # we may already hold the key (a takeover interrupted by an error)
                    won = await loop.run_in_executor(None, etcd.still_leader, self._me)
                if won:
                    while await self._catch_up():  # read the log to its end before serving
                        pass
                    self.state.on_takeover(time.monotonic(), self.takeover_lease_s)
                    self.role = "leader"
                    self.leader_hint = self._me.rpc
                    logger.info(
                        "master %s is now the leader at %s (oplog seq %d, %d objects)",
                        self.id,
                        self._me.rpc,
                        self._seq,
                        len(self.state.objects),
                    )
                    continue
                cur = await loop.run_in_executor(None, etcd.leader)
                self.leader_hint = cur.rpc if cur is not None else ""
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd hiccups must not end the HA loop
                logger.warning("HA loop: %s: %s; retrying", type(exc).__name__, exc)
                # keep-alives missed (a loaded host): etcd dropped the lease we campaign with
                stale_lease = "lease not found" in str(exc)
                await asyncio.sleep(0.2)

    async def _catch_up(self) -> int:
        """Apply the next oplog batches (reloading the snapshot across a trim); returns how many."""
        batches = await asyncio.get_running_loop().run_in_executor(
            None, self._etcd.read_log, self._seq
        )
        if batches and batches[0][0] != self._seq:  # we fell behind a trim
            logger.warning(
                "oplog gap (have seq %d, log starts at %d): reloading the snapshot",
                self._seq,
                batches[0][0],
            )
            await self._load_snapshot()
            return 1
        self._apply(batches)
        return len(batches)

    def _apply(self, batches: list[tuple[int, list[Any]]]) -> None:
        now = time.monotonic()
        self.state.on_change = None  # replaying: nothing to re-log
        try:
            self._replay(batches, now)
        finally:
            self.state.on_change = self._change_sink()
            self._log.clear()

    def _replay(self, batches: list[tuple[int, list[Any]]], now: float) -> None:
        for seq, entries in batches:
            for e in entries:
                try:
                    self.state.apply(e, now)
                except Exception:
                    logger.exception(
                        "cannot apply oplog entry %r", e[:2] if isinstance(e, list) else e
                    )
            self._seq = seq + 1
