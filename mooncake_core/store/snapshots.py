"""Snapshots of a master's metadata in a local directory, and restore at start (no HA).

``mooncake-core master --snapshot-dir DIR [--snapshot-interval 600] [--snapshot-retention 2]``
(published: ``--enable_snapshot --snapshot_backup_dir=DIR --snapshot_interval_seconds=N
--snapshot_retention_count=N``; restore: ``--enable_snapshot_restore``, on by default with
ours). Every interval, and once more at a clean stop, the master writes its replicated
state (clients, segments, objects with their replicas, pins, leases and SSD copies: the entries
of :meth:`~mooncake_core.store.replication.Replication.export`, the same an HA snapshot
holds) to ``DIR/snapshot-<unix ns>.msgpack`` (written to a temporary file, then renamed:
a crash never leaves a half snapshot under the final name), and deletes all but the newest
``retention``. At start the newest snapshot that reads back is applied, then every client
gets a fresh liveness period and every object a fresh lease (as on an HA takeover): clients
whose heartbeats reach the restarted master keep their segments, and every object whose
holder is still alive reads back; clients that do not come back expire as usual.

Not in a snapshot: puts in progress, and extents lent for one-RPC puts (a client notices the
master restarted and stops using its extents). With HA, snapshots go to etcd instead
(:class:`~mooncake_core.store.ha.Snapshots`).

Thread-safety: :meth:`LocalSnapshots.write` runs on an executor thread with entries taken
on the master's loop; nothing else is shared.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from mooncake_core.errors import ConfigError

__all__ = ["LocalSnapshots", "SnapshotService"]

logger = logging.getLogger(__name__)

_VERSION = 1
_PREFIX = "snapshot-"
_SUFFIX = ".msgpack"


class LocalSnapshots:
    """Snapshot files in ``directory`` (created if missing), the newest ``retention`` kept."""

    def __init__(self, directory: str, retention: int = 2) -> None:
        if retention < 1:
            raise ConfigError(f"--snapshot-retention must be at least 1, got {retention}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--snapshot-dir {directory}: cannot create it: {exc}") from None
        if not os.access(self.dir, os.W_OK):
            raise ConfigError(f"--snapshot-dir {directory}: not writable")
        self.retention = retention
        self.written = 0

    def files(self) -> list[Path]:
        """Snapshot files, oldest first."""
        return sorted(
            p for p in self.dir.glob(f"{_PREFIX}*{_SUFFIX}") if p.stem[len(_PREFIX) :].isdigit()
        )

    def write(self, entries: list[Any]) -> Path:
        """Write one snapshot; returns its path (older ones beyond the retention are deleted)."""
        stamp = time.time_ns()
        path = self.dir / f"{_PREFIX}{stamp:020d}{_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        data = msgspec.msgpack.encode([_VERSION, stamp, entries])
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.written += 1
        for old in self.files()[: -self.retention]:
            try:
                old.unlink()
            except OSError as exc:
                logger.warning("cannot delete old snapshot %s: %s", old, exc)
        return path

    def latest(self) -> tuple[Path, list[Any]] | None:
        """The newest snapshot that reads back (a damaged one is skipped with a warning)."""
        for path in reversed(self.files()):
            try:
                version, _stamp, entries = msgspec.msgpack.decode(path.read_bytes())
                if version != _VERSION or not isinstance(entries, list):
                    raise ValueError(f"unknown snapshot version {version!r}")
                return path, entries
            except (OSError, ValueError, TypeError, msgspec.DecodeError) as exc:
                logger.warning("skipping snapshot %s: %s", path, exc)
        return None


class SnapshotService:
    """A master's snapshot schedule: restore at start, a snapshot every ``interval_s`` and at
    a clean stop (``MasterServer.snapshots``; see the module doc)."""

    def __init__(
        self, directory: str, interval_s: float = 600.0, retention: int = 2, restore: bool = True
    ) -> None:
        if interval_s <= 0:
            raise ConfigError(f"--snapshot-interval must be positive, got {interval_s}")
        self.files = LocalSnapshots(directory, retention)
        self.interval_s = interval_s
        self.restore = restore
        self.restored = 0  # entries applied at start

    def attach(self, server: Any) -> list[Any]:
        """Restore into ``server.state`` (before it leads) and return the periodic task."""
        import asyncio

        if self.restore:
            found = self.files.latest()
            if found is not None:
                path, entries = found
                state, now = server.state, time.monotonic()
                sink, state.on_change = state.on_change, None  # replaying: nothing to re-log
                try:
                    for e in entries:
                        try:
                            state.apply(e, now)
                        except Exception:
                            logger.exception("cannot apply snapshot entry %r", e[:2])
                finally:
                    state.on_change = sink
                state.on_takeover(now)
                self.restored = len(entries)
                logger.info(
                    "restored %s: %d clients, %d objects",
                    path,
                    len(state.clients),
                    len(state.objects),
                )
        return [asyncio.ensure_future(self._loop(server))]

    async def _loop(self, server: Any) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                if server.role == "leader":
                    entries = server.state.export()  # consistent: taken in one loop step
                    path = await loop.run_in_executor(None, self.files.write, entries)
                    logger.info("snapshot %s (%d entries)", path, len(entries))
        except asyncio.CancelledError:
            if server.role == "leader":  # a clean stop: one last snapshot
                try:
                    self.files.write(server.state.export())
                except OSError as exc:
                    logger.warning("final snapshot failed: %s", exc)
            raise
        except OSError as exc:
            logger.error("snapshots stopped: %s", exc)
