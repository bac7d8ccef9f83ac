"""One download: fetch every shard of a manifest from the swarm, verify, announce.

How a shard is chosen (each of ``concurrency`` worker threads, under one lock):

1. a shard some *other reader* holds (not the original copy): random among those, from a
   random such holder, preferring holders this download reads from least at the moment:
   readers' replicas spare the seeder;
2. else, while fewer than ``origin_streams`` fetches from the original copy run, and
   with a holder list at most ``refresh_s`` old: a random shard that no other reader has
   *claimed*. A reader claims a shard (a ``pending`` bit in its holder record) before it
   fetches it from the original copy, so readers starting together take different shards
   from the seeder and then trade them: the seeder sends each shard about once. Claims
   older than ``claim_wait_s`` without progress here are ignored (a slow claimant);
   a dead claimant's record vanishes with its lease;
3. else wait for the holder list to change.

The view of the holders comes from etcd watches (holder records, corruption reports and
the manifest), so a reader learns of a new holder or shard as soon as it is announced; a
full re-read every ``resync_s`` is a safety net. Without watches (the HTTP coordinator of
the two-process case) one thread re-reads the holder list every ``refresh_s`` instead.
Another thread publishes this reader's record whenever it changed (claims and verified
shards, coalesced), so a worker never waits for etcd.

Every shard is checked against its xxh3-64 checksum on arrival; a mismatch or a failed
read puts the shard back, so it is fetched again from another holder. A mismatch excludes
that holder for that shard and is *reported* (a key under the holder's lease): every
reader then skips that holder's copy of the shard, and the holder re-verifies it and stops
announcing it if it is corrupt. A failed read (a network hiccup, a timeout, a dead holder)
makes that holder skipped for every shard for a backoff (``retry_backoff_s``, doubled per
consecutive failure, at most ``retry_backoff_max_s``), after which it is tried again;
after ``holder_failures`` consecutive failures it is dropped for the rest of the download.
Reads begun before a holder's last failure that fail too count as that same failure (the
reads in flight when a connection breaks); an answer to a read begun after it clears the
count. A verified shard is announced at once (this reader's holder record gains the shard,
in a transaction guarded by the manifest's revision), so later readers can fetch it from
here while this download continues.

The manifest is watched (and re-read with every full re-read): when it is gone or is
another version, the download stops with :class:`~mooncake_core.p2p.errors.NameNotFound` /
:class:`~mooncake_core.p2p.errors.VersionChanged`, and nothing is returned.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from mooncake_core.errors import MetadataError, MooncakeError, TransportError
from mooncake_core.p2p.errors import NameNotFound, P2PError, ShardUnavailable, VersionChanged
from mooncake_core.p2p.meta import Coordinator, Holder, Keys, Manifest, Shard
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
    failed: int = 0  # reads that failed (the shard was fetched again)
    holders_dropped: int = 0  # holders not read from again after consecutive failures
    refreshes: int = 0
    seconds: float = 0.0
    peak_parallel: int = 0  # most shard fetches running at once
    sources: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "from_origin": self.from_origin,
            "from_peers": self.from_peers,
            "corrupt": self.corrupt,
            "failed": self.failed,
            "holders_dropped": self.holders_dropped,
            "refreshes": self.refreshes,
            "seconds": round(self.seconds, 4),
            "peak_parallel": self.peak_parallel,
            "sources": len(self.sources),
        }


class Download:
    """Fetch ``manifest`` into local memory at ``dest_addrs`` (one base address per buffer).

    ``announce(mask, pending)`` publishes this reader's holder record: the shards it has
    and those it is fetching from the original copy (returns False when the manifest
    changed under it).
    """

    def __init__(
        self,
        *,
        engine: TransferEngine,
        etcd: Coordinator,
        keys: Keys,
        manifest: Manifest,
        dest_addrs: list[int],
        me: str,
        announce: Callable[[int, int], bool],
        swarm: bool = True,
        concurrency: int = 4,
        origin_streams: int = 2,
        refresh_s: float = 0.05,
        claim_wait_s: float = 5.0,
        stall_timeout_s: float = 20.0,
        timeout_s: float | None = None,
        progress: Callable[[Progress], None] | None = None,
        report: Callable[[Holder, int], None] | None = None,
        watch: bool = True,
        resync_s: float = 1.0,
        retry_backoff_s: float = 0.5,
        retry_backoff_max_s: float = 4.0,
        holder_failures: int = 3,
    ) -> None:
        if concurrency < 1 or origin_streams < 1 or holder_failures < 1:
            raise P2PError("concurrency, origin_streams and holder_failures must be at least 1")
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
        self.claim_wait_s = claim_wait_s
        self.stall_timeout_s = stall_timeout_s
        self.timeout_s = timeout_s
        self.progress = progress
        self.report = report
        self.use_watch = watch
        self.resync_s = resync_s
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        self.holder_failures = holder_failures
        self.stats = DownloadStats()
        self._cond = threading.Condition()
        self._remaining = {s.index for s in manifest.shards if s.length > 0}
        self._inflight: dict[int, str] = {}
        self._load: dict[str, int] = {}  # fetches running per holder
        self._origin_busy = 0  # fetches running from the original copy
        self._holders: dict[str, Holder] = {}
        self._holder_rev: dict[str, int] = {}  # mod revision of each holder's record seen
        self._reported: set[tuple[str, int]] = set()  # (holder, shard) reported corrupt
        self._watching = False
        self._cancels: list[Callable[[], None]] = []
        self._strikes: dict[str, int] = {}  # consecutive failed reads (one per fault) per holder
        self._struck: dict[str, float] = {}  # when each holder's last counted failure happened
        self._retry_at: dict[str, float] = {}  # holders skipped until then (backoff)
        self._dead: set[str] = set()  # holders dropped for the rest of the download
        self._bad: set[tuple[str, int]] = set()  # (holder, shard) that failed the checksum
        self._mask = 0
        self._pending = 0  # shards this reader is fetching from the original copy
        self._announce_lock = threading.Lock()
        self._dirty = threading.Event()  # the record changed: the publisher sends it
        self._over = threading.Event()
        self._done_bytes = 0
        self._error: BaseException | None = None
        self._refreshed = 0.0
        self._stall_since = time.monotonic()
        self._start = time.monotonic()
        self._rng = random.Random()

    # ------------------------------------------------------------------ etcd view
    def _holder_event(self, key: str, raw: bytes | None, rev: int) -> None:
        """A change of one holder record (from the watch or a re-read)."""
        seg = self.keys.last_parts(key, 1)[0]
        h: Holder | None = None
        if raw is not None:
            try:
                h = Holder.from_json(raw)
            except (ValueError, KeyError, TypeError):
                return
            seg = h.segment
        if seg == self.me:
            return
        with self._cond:
            if rev < self._holder_rev.get(seg, 0):
                return  # older than what this view already has
            self._holder_rev[seg] = rev
            if h is not None and len(h.addrs) == len(self.m.sizes):
                self._holders[seg] = h
            else:
                self._holders.pop(seg, None)
            self._cond.notify_all()

    def _report_event(self, key: str, raw: bytes | None, rev: int) -> None:
        """A report that a holder's copy of a shard failed a reader's checksum."""
        try:
            seg, shard_text = self.keys.last_parts(key, 2)
            shard = int(shard_text)
        except ValueError:
            return
        with self._cond:
            if raw is None:
                self._reported.discard((seg, shard))  # the holder re-verified it
            else:
                self._reported.add((seg, shard))
            self._cond.notify_all()

    def _manifest_event(self, key: str, raw: bytes | None, rev: int) -> None:
        try:
            self._judge_manifest(None if raw is None else (raw, rev))
        except P2PError as exc:
            self._fail(exc)

    def _refresh(self, check_manifest: bool = True) -> int:
        """Re-read the holder list, the reports and (``check_manifest``) the manifest (lock
        not held); returns the store revision of the read."""
        if check_manifest:
            self._check_manifest()
        got, rev = self.etcd.get_prefix_at(self.keys.holders(self.m.name, self.m.version))
        reports, rev2 = self.etcd.get_prefix_at(self.keys.reports(self.m.name, self.m.version))
        with self._cond:
            listed = set()
            for raw_h, mod in got.values():
                try:
                    h = Holder.from_json(raw_h)
                except (ValueError, KeyError, TypeError):
                    continue
                listed.add(h.segment)
                if h.segment == self.me or mod < self._holder_rev.get(h.segment, 0):
                    continue
                self._holder_rev[h.segment] = mod
                if len(h.addrs) == len(self.m.sizes):
                    self._holders[h.segment] = h
            for seg in list(self._holders):  # gone, unless a newer event brought it back
                if seg not in listed and self._holder_rev.get(seg, 0) <= rev:
                    del self._holders[seg]
            fresh = set()
            for key in reports:
                with contextlib.suppress(ValueError):
                    seg, shard_text = self.keys.last_parts(key, 2)
                    fresh.add((seg, int(shard_text)))
            self._reported = fresh
            self._refreshed = time.monotonic()
            self.stats.refreshes += 1
            self._cond.notify_all()
        return min(rev, rev2)

    def _watch(self, rev: int) -> None:
        """Follow holders, reports and the manifest through etcd watches from ``rev`` on."""
        watch = getattr(self.etcd, "watch", None)
        if not self.use_watch or watch is None:
            return
        m = self.m
        try:
            for key, cb, prefix in (
                (self.keys.holders(m.name, m.version), self._holder_event, True),
                (self.keys.reports(m.name, m.version), self._report_event, True),
                (self.keys.obj(m.name), self._manifest_event, False),
            ):
                self._cancels.append(
                    watch(key, cb, prefix=prefix, start_revision=rev + 1, on_error=self._watch_lost)
                )
        except MetadataError as exc:
            logger.warning("p2p %s: no etcd watch (%s); polling instead", m.name, exc)
            self._unwatch(exc)
            return
        self._watching = True

    def _watch_lost(self, exc: BaseException) -> None:
        """A watch ended (etcd lost): poll from now on (called on the etcd client's thread,
        so the watches are cancelled later, by :meth:`run`)."""
        self._watching = False

    def _unwatch(self, exc: BaseException | None = None) -> None:
        """Stop the watches (the refresher polls from then on)."""
        self._watching = False
        cancels, self._cancels = self._cancels, []
        for c in cancels:
            with contextlib.suppress(Exception):
                c()

    def _check_manifest(self) -> None:
        self._judge_manifest(self.etcd.get_rev(self.keys.obj(self.m.name)))

    def _judge_manifest(self, got: tuple[bytes, int] | None) -> None:
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

    # ------------------------------------------------------------------ choice
    def _usable(self, h: Holder, shard: int, now: float) -> bool:
        return (
            h.has(shard)
            and h.segment not in self._dead
            and self._retry_at.get(h.segment, 0.0) <= now
            and (h.segment, shard) not in self._bad
            and (h.segment, shard) not in self._reported
        )

    def _pick(self, fresh: bool) -> tuple[tuple[Shard, Holder] | None, bool]:
        """``(next (shard, holder) or None, whether a fresher holder list could help)``
        (lock held)."""
        free = [i for i in self._remaining if i not in self._inflight]
        if not free:
            return None, False
        self._rng.shuffle(free)
        now = time.monotonic()
        if self.swarm:
            best: tuple[tuple[int, int], int, Holder] | None = None
            for i in free:
                peers = [
                    h for h in self._holders.values() if not h.origin and self._usable(h, i, now)
                ]
                if not peers:
                    continue
                self._rng.shuffle(peers)
                h = min(peers, key=lambda p: self._load.get(p.segment, 0))
                key = (self._load.get(h.segment, 0), len(peers))  # idle holder, rarest shard
                if best is None or key < best[0]:
                    best = (key, i, h)
            if best is not None:
                return (self.m.shards[best[1]], best[2]), False
        if self._origin_busy >= self.origin_streams:
            return None, False
        if self.swarm and not fresh:
            return None, True  # look again before taking anything from the original copy
        origins = [h for h in self._holders.values() if h.origin]
        claimed = 0
        if self.swarm and time.monotonic() - self._stall_since < self.claim_wait_s:
            for h in self._holders.values():
                if not h.origin:
                    claimed |= h.pending
        cands = [
            i
            for i in free
            if not claimed >> i & 1 and any(self._usable(h, i, now) for h in origins)
        ]
        if not cands:
            return None, False
        i = self._rng.choice(cands)
        return (
            self.m.shards[i],
            self._rng.choice([h for h in origins if self._usable(h, i, now)]),
        ), False

    def _stalled_message(self) -> str:
        left = sorted(self._remaining)
        shown = ", ".join(str(i) for i in left[:8]) + (" ..." if len(left) > 8 else "")
        tried = sorted(self._dead | set(self._strikes) | {h for h, _ in self._bad})
        return (
            f"{self.m.name!r}: no live holder can supply shard(s) {shown} "
            f"({len(self._holders)} holder(s) listed; failed: {', '.join(tried) or 'none'})"
        )

    # ------------------------------------------------------------------ workers
    def _next(self) -> tuple[Shard, Holder, float] | None:
        """Block until a fetch can start: ``(shard, holder, when it was chosen)``; None when
        the download is over."""
        with self._cond:
            while True:
                if self._error is not None or not self._remaining:
                    return None
                now = time.monotonic()
                job, _ = self._pick(self._watching or now - self._refreshed < 3 * self.refresh_s)
                if job is not None:
                    shard, h = job
                    self._inflight[shard.index] = h.segment
                    self._load[h.segment] = self._load.get(h.segment, 0) + 1
                    self._origin_busy += h.origin
                    self.stats.peak_parallel = max(self.stats.peak_parallel, len(self._inflight))
                    return shard, h, now
                if not self._inflight and now - self._stall_since > self.stall_timeout_s:
                    self._error = ShardUnavailable(self._stalled_message())
                    self._cond.notify_all()
                    return None
                self._cond.wait(self.refresh_s)  # the refresher notifies on every refresh

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _refresher(self) -> None:
        """Without a watch: re-read the holder list every ``refresh_s`` (the manifest every
        4th time). With one: re-read everything every ``resync_s`` only, as a safety net."""
        n = 0
        last = time.monotonic()
        while not self._over.wait(self.refresh_s):
            if self._watching and time.monotonic() - last < self.resync_s:
                continue
            n += 1
            last = time.monotonic()
            try:
                self._refresh(check_manifest=self._watching or n % 4 == 0)
            except MetadataError as exc:  # etcd hiccup: keep the last view, try again
                logger.warning("p2p %s: re-reading holders failed: %s", self.m.name, exc)
            except BaseException as exc:
                self._fail(exc)
                return

    def _publisher(self) -> None:
        """Publish this reader's record whenever it changed (coalescing changes)."""
        while not self._over.is_set():
            if not self._dirty.wait(0.1):
                continue
            self._dirty.clear()
            try:
                self._publish()
            except BaseException as exc:
                self._fail(exc)
                return

    def _publish(self) -> None:
        """Send this reader's current record (shards held, shards claimed from the origin)."""
        with self._announce_lock:
            with self._cond:
                mask, pending = self._mask, self._pending
            if not self.announce(mask, pending):
                self._refresh()  # raises the right error: unregistered or another version
                raise P2PError(f"{self.m.name!r}: could not announce this reader's shards")

    def _holder_failed(self, seg: str, began: float) -> None:
        """A read from ``seg`` chosen at ``began`` failed (lock held): back off from that
        holder, or drop it after ``holder_failures`` consecutive failures."""
        if seg in self._dead or began < self._struck.get(seg, began):
            return  # begun before its last counted failure: the same fault
        n = self._strikes.get(seg, 0) + 1
        now = time.monotonic()
        self._strikes[seg] = n
        self._struck[seg] = now
        if n >= self.holder_failures:
            self._dead.add(seg)
            self.stats.holders_dropped += 1
            logger.warning(
                "p2p %s: %d reads in a row from %s failed; not reading from it again in this "
                "download",
                self.m.name,
                n,
                seg,
            )
            return
        wait = min(self.retry_backoff_s * 2 ** (n - 1), self.retry_backoff_max_s)
        self._retry_at[seg] = now + wait
        logger.info(
            "p2p %s: skipping %s for %.2fs (failure %d of %d)",
            self.m.name,
            seg,
            wait,
            n,
            self.holder_failures,
        )

    def _fetch(self, shard: Shard, h: Holder, began: float) -> None:
        claim = self.swarm and h.origin
        if claim:  # tell the other readers, so they take other shards from the origin
            with self._cond:
                self._pending |= 1 << shard.index
            self._dirty.set()
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
            self._pending &= ~(1 << shard.index)
            if not read_failed and began >= self._struck.get(h.segment, began):
                self._strikes.pop(h.segment, None)  # it answered after its last failure
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
            elif read_failed:
                self.stats.failed += 1
                self._holder_failed(h.segment, began)
            else:
                self._bad.add((h.segment, shard.index))
                self.stats.corrupt += 1
                logger.warning(
                    "p2p %s: shard %d from %s failed its checksum; fetching it again elsewhere "
                    "(and reporting it)",
                    self.m.name,
                    shard.index,
                    h.segment,
                )
            self._cond.notify_all()
        if not ok and not read_failed and self.report is not None:
            try:  # so other readers skip it too, and the holder re-verifies its copy
                self.report(h, shard.index)
            except MooncakeError as exc:
                logger.warning("p2p %s: reporting a corrupt shard failed: %s", self.m.name, exc)
        if ok or claim:
            self._dirty.set()
        if ok:
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
            self._fail(exc)

    def run(self) -> DownloadStats:
        """Fetch everything; raise the first error (nothing is then complete)."""
        try:
            return self._run()
        finally:
            self._unwatch()

    def _run(self) -> DownloadStats:
        rev = self._refresh()
        if not self._holders and self._remaining:
            raise ShardUnavailable(f"{self.m.name!r}: no live holder is listed")
        self._watch(rev)
        threads = [
            threading.Thread(target=self._worker, name=f"mc-p2p-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        helpers = [
            threading.Thread(target=self._refresher, name="mc-p2p-refresh", daemon=True),
            threading.Thread(target=self._publisher, name="mc-p2p-publish", daemon=True),
        ]
        for t in [*threads, *helpers]:
            t.start()
        for t in threads:
            t.join()
        self._over.set()
        for t in helpers:
            t.join()
        if self._error is None:
            self._publish()  # the final record: every shard, no claims
        self.stats.seconds = time.monotonic() - self._start
        if self._error is not None:
            err = self._error
            if isinstance(err, MooncakeError):
                raise err
            raise P2PError(f"{self.m.name!r}: download failed: {err}") from err
        self._refresh()  # the version must still be the one fetched
        return self.stats
