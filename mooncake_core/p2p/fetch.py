"""One download: fetch every shard of a manifest from the swarm, verify, announce.

How a shard is chosen (each of ``concurrency`` worker threads, under one lock):

1. a shard some *other reader* holds (not the original copy): random among those, from a
   random such holder, preferring holders this download reads from least at the moment:
   readers' replicas spare the seeder;
2. else, while fewer than ``origin_streams`` fetches from the original copy run: the
   rarest remaining shard (fewest holders, ties broken at random, so that readers starting
   together take different shards from the seeder and then trade them);
3. else wait for the holder list to change (it is re-read from etcd every
   ``refresh_s``, and at once when a choice runs out).

Every shard is checked against its xxh3-64 checksum on arrival; a mismatch or a failed
read puts the shard back and excludes that holder for it (a failed read: for every shard),
so it is fetched again from another holder. A verified shard is announced at once (this
reader's holder record gains the shard, in a transaction guarded by the manifest's
revision), so later readers can fetch it from here while this download continues.

The manifest is re-read with the holder list: when it is gone or is another version, the
download stops with :class:`~mooncake_core.p2p.errors.NameNotFound` /
:class:`~mooncake_core.p2p.errors.VersionChanged`, and nothing is returned.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from mooncake_core.errors import MooncakeError, TransportError
from mooncake_core.p2p.errors import NameNotFound, P2PError, ShardUnavailable, VersionChanged
from mooncake_core.p2p.meta import Holder, Keys, Manifest, P2PEtcd, Shard
from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_core.transfer.memory import host_view

__all__ = ["Download", "Progress", "checksum"]

logger = logging.getLogger(__name__)


def checksum(view: memoryview) -> str:
    """The shard checksum: xxh3-64 as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(view)


@dataclass
class Progress:
    """What a progress callback sees (called after every shard)."""

    name: str
    done: int  # bytes verified
    total: int
    shards_done: int
    shards: int
    peers: int  # live holders other than this process (at the last refresh)
    sources: int  # distinct holders this download read from so far
    elapsed_s: float
    retries: int


@dataclass
class DownloadStats:
    """Counters of one download (``Replica.stats``)."""

    from_origin: int = 0
    from_peers: int = 0
    corrupt: int = 0
    failed: int = 0
    refreshes: int = 0
    seconds: float = 0.0
    sources: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "from_origin": self.from_origin,
            "from_peers": self.from_peers,
            "corrupt": self.corrupt,
            "failed": self.failed,
            "refreshes": self.refreshes,
            "seconds": round(self.seconds, 4),
            "sources": len(self.sources),
        }


class Download:
    """Fetch ``manifest`` into local memory at ``dest_addrs`` (one base address per buffer).

    ``announce(mask)`` publishes this reader's holder record with shard bitmap ``mask``
    (and returns False when the manifest changed under it).
    """

    def __init__(
        self,
        *,
        engine: TransferEngine,
        etcd: P2PEtcd,
        keys: Keys,
        manifest: Manifest,
        dest_addrs: list[int],
        me: str,
        announce: Callable[[int], bool],
        swarm: bool = True,
        concurrency: int = 4,
        origin_streams: int = 2,
        refresh_s: float = 0.2,
        stall_timeout_s: float = 20.0,
        timeout_s: float | None = None,
        progress: Callable[[Progress], None] | None = None,
    ) -> None:
        if concurrency < 1 or origin_streams < 1:
            raise P2PError("concurrency and origin_streams must be at least 1")
        self.engine = engine
        self.etcd = etcd
        self.keys = keys
        self.m = manifest
        self.dest = dest_addrs
        self.me = me
        self.announce = announce
        self.swarm = swarm
        self.concurrency = concurrency
        self.origin_streams = origin_streams if swarm else concurrency
        self.refresh_s = refresh_s
        self.stall_timeout_s = stall_timeout_s
        self.timeout_s = timeout_s
        self.progress = progress
        self.stats = DownloadStats()
        self._cond = threading.Condition()
        self._remaining = {s.index for s in manifest.shards if s.length > 0}
        self._inflight: dict[int, str] = {}
        self._load: dict[str, int] = {}  # fetches running per holder
        self._origin_busy = 0  # fetches running from the original copy
        self._holders: dict[str, Holder] = {}
        self._dead: set[str] = set()  # holders whose reads failed
        self._bad: set[tuple[str, int]] = set()  # (holder, shard) that failed the checksum
        self._mask = 0
        self._done_bytes = 0
        self._error: BaseException | None = None
        self._refreshed = 0.0
        self._stall_since = time.monotonic()
        self._start = time.monotonic()
        self._rng = random.Random()

    # ------------------------------------------------------------------ etcd view
    def _refresh(self) -> None:
        """Re-read the manifest and the holder list (called without the lock)."""
        got = self.etcd.get_rev(self.keys.obj(self.m.name))
        if got is None:
            raise NameNotFound(
                f"{self.m.name!r} was unregistered during the download "
                f"({self._done_bytes} of {self.m.size} bytes fetched; nothing returned)"
            )
        raw, rev = got
        if rev != self.m.revision:
            other = Manifest.from_json(raw, rev)
            if other.version != self.m.version:
                raise VersionChanged(
                    f"{self.m.name!r} changed from version {self.m.version[:12]} to "
                    f"{other.version[:12]} during the download; nothing returned "
                    "(call get_replica again for the new version)"
                )
        holders: dict[str, Holder] = {}
        for raw_h, _ in self.etcd.get_prefix_rev(
            self.keys.holders(self.m.name, self.m.version)
        ).values():
            try:
                h = Holder.from_json(raw_h)
            except (ValueError, KeyError, TypeError):
                continue
            if h.segment != self.me and len(h.addrs) == len(self.m.sizes):
                holders[h.segment] = h
        with self._cond:
            self._holders = holders
            self._refreshed = time.monotonic()
            self.stats.refreshes += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ choice
    def _usable(self, h: Holder, shard: int) -> bool:
        return h.has(shard) and h.segment not in self._dead and (h.segment, shard) not in self._bad

    def _pick(self) -> tuple[Shard, Holder] | None:
        """Next (shard, holder), or None when nothing can start now (lock held)."""
        free = [i for i in self._remaining if i not in self._inflight]
        if not free:
            return None
        self._rng.shuffle(free)
        if self.swarm:
            best: tuple[int, int, Holder] | None = None
            for i in free:
                peers = [h for h in self._holders.values() if not h.origin and self._usable(h, i)]
                if not peers:
                    continue
                self._rng.shuffle(peers)
                h = min(peers, key=lambda p: self._load.get(p.segment, 0))
                load = self._load.get(h.segment, 0)
                if best is None or load < best[0]:
                    best = (load, i, h)
                    if load == 0:
                        break
            if best is not None:
                return self.m.shards[best[1]], best[2]
        if self._origin_busy >= self.origin_streams:
            return None
        origins = [h for h in self._holders.values() if h.origin]
        choice: tuple[int, int, Holder] | None = None
        for i in free:
            srcs = [h for h in origins if self._usable(h, i)]
            if not srcs:
                continue
            rarity = sum(1 for h in self._holders.values() if h.has(i))
            if choice is None or rarity < choice[0]:
                choice = (rarity, i, self._rng.choice(srcs))
        if choice is None:
            return None
        return self.m.shards[choice[1]], choice[2]

    def _stalled_message(self) -> str:
        left = sorted(self._remaining)
        shown = ", ".join(str(i) for i in left[:8]) + (" ..." if len(left) > 8 else "")
        tried = sorted(self._dead | {h for h, _ in self._bad})
        return (
            f"{self.m.name!r}: no live holder can supply shard(s) {shown} "
            f"({len(self._holders)} holder(s) listed; failed: {', '.join(tried) or 'none'})"
        )

    # ------------------------------------------------------------------ workers
    def _next(self) -> tuple[Shard, Holder] | None:
        """Block until a fetch can start; None when the download is over (lock not held)."""
        while True:
            refresh = False
            with self._cond:
                if self._error is not None or not self._remaining:
                    return None
                job = self._pick()
                if job is not None:
                    shard, h = job
                    self._inflight[shard.index] = h.segment
                    self._load[h.segment] = self._load.get(h.segment, 0) + 1
                    self._origin_busy += h.origin
                    return job
                now = time.monotonic()
                if not self._inflight and now - self._stall_since > self.stall_timeout_s:
                    self._error = ShardUnavailable(self._stalled_message())
                    self._cond.notify_all()
                    return None
                if now - self._refreshed >= self.refresh_s:
                    self._refreshed = now  # one refresher at a time
                    refresh = True
                else:
                    self._cond.wait(max(0.01, self.refresh_s - (now - self._refreshed)))
            if refresh:
                self._refresh()

    def _fetch(self, shard: Shard, h: Holder) -> None:
        local = self.dest[shard.buf] + shard.offset
        remote = h.addrs[shard.buf] + shard.offset
        ok = False
        try:
            self.engine.transfer(
                TransferRequest("read", h.segment, local, shard.length, remote),
                timeout=self.timeout_s,
            )
            ok = checksum(host_view(local, shard.length)) == shard.xxh
            read_failed = False
        except (TransportError, OSError) as exc:
            read_failed = True
            logger.info(
                "p2p %s: shard %d from %s failed: %s", self.m.name, shard.index, h.segment, exc
            )
        with self._cond:
            del self._inflight[shard.index]
            self._load[h.segment] -= 1
            self._origin_busy -= h.origin
            if ok:
                self._remaining.discard(shard.index)
                self._mask |= 1 << shard.index
                self._done_bytes += shard.length
                self._stall_since = time.monotonic()
                self.stats.sources.add(h.segment)
                if h.origin:
                    self.stats.from_origin += 1
                else:
                    self.stats.from_peers += 1
                mask = self._mask
            elif read_failed:
                self._dead.add(h.segment)
                self.stats.failed += 1
            else:
                self._bad.add((h.segment, shard.index))
                self.stats.corrupt += 1
                logger.warning(
                    "p2p %s: shard %d from %s failed its checksum; fetching it again elsewhere",
                    self.m.name,
                    shard.index,
                    h.segment,
                )
            self._cond.notify_all()
        if ok:
            if not self.announce(mask):
                self._refresh()  # raises the right error: unregistered or another version
                raise P2PError(f"{self.m.name!r}: could not announce shard {shard.index}")
            self._report()

    def _report(self) -> None:
        if self.progress is None:
            return
        with self._cond:
            p = Progress(
                name=self.m.name,
                done=self._done_bytes,
                total=self.m.size,
                shards_done=len(self.m.shards) - len(self._remaining),
                shards=len(self.m.shards),
                peers=len(self._holders),
                sources=len(self.stats.sources),
                elapsed_s=time.monotonic() - self._start,
                retries=self.stats.corrupt + self.stats.failed,
            )
        self.progress(p)

    def _worker(self) -> None:
        try:
            while True:
                job = self._next()
                if job is None:
                    return
                self._fetch(*job)
        except BaseException as exc:
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()

    def run(self) -> DownloadStats:
        """Fetch everything; raise the first error (nothing is then complete)."""
        self._refresh()
        if not self._holders and self._remaining:
            raise ShardUnavailable(f"{self.m.name!r}: no live holder is listed")
        threads = [
            threading.Thread(target=self._worker, name=f"mc-p2p-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.stats.seconds = time.monotonic() - self._start
        if self._error is not None:
            err = self._error
            if isinstance(err, MooncakeError):
                raise err
            raise P2PError(f"{self.m.name!r}: download failed: {err}") from err
        self._refresh()  # the version must still be the one fetched
        return self.stats
