""":class:`P2PStore`: register, fetch, serve, list and remove named blobs in a swarm.

Each process opens one store (one transfer engine, one etcd lease). Whatever it has
registered or fetched it serves to later readers through its engine until it deletes the
replica, unregisters the name, closes the store or dies (then its lease expires and its
holder records vanish from etcd).
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_core.config import MooncakeConfig, load_config
from mooncake_core.errors import MetadataError, MooncakeError, SegmentError, SegmentOverlap
from mooncake_core.p2p.buffers import Source, collect
from mooncake_core.p2p.errors import BadName, NameExists, NameNotFound, P2PError, VersionChanged
from mooncake_core.p2p.fetch import Download, Progress, checksum
from mooncake_core.p2p.meta import (
    Coordinator,
    Holder,
    Keys,
    Manifest,
    P2PEtcd,
    Shard,
    check_name,
    check_shard_size,
)
from mooncake_core.transfer import ManagedBuffer, Region, TransferEngine

if TYPE_CHECKING:  # the HTTP server (aiohttp) is imported only when used
    from mooncake_core.metadata.http import MetadataServer

__all__ = ["P2PStore", "Replica", "ObjectInfo"]

logger = logging.getLogger(__name__)


@dataclass
class ObjectInfo:
    """One entry of :meth:`P2PStore.list`."""

    name: str
    version: str
    size: int
    shard_size: int
    shards: int
    sizes: list[int]
    labels: list[str]
    origin: str
    holders: list[str]  # segments with at least one shard (live: under a lease)
    complete: int  # holders with every shard
    created: float
    meta: dict[str, str]


@dataclass
class Replica:
    """A name this process holds (registered or fetched) and serves.

    ``buffers[i]`` is buffer ``i`` of the name (``labels[i]`` names it, e.g. a file);
    the memory stays valid until :meth:`P2PStore.delete_replica` / :meth:`P2PStore.close`.
    """

    name: str
    version: str
    size: int
    shard_size: int
    labels: list[str]
    buffers: list[memoryview]
    origin: bool
    stats: dict[str, float | int] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)

    def tobytes(self) -> bytes:
        """Every buffer, concatenated (a copy)."""
        return b"".join(bytes(b) for b in self.buffers)


@dataclass
class _Held:
    manifest: Manifest
    holder: Holder
    replica: Replica
    sources: list[Source] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    managed: ManagedBuffer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    bad: int = 0  # shards found corrupt here on re-verification: never announced again
    unwatch: Callable[[], None] | None = None  # stops following reports about this copy


def _place(m: Manifest, into: Any) -> tuple[list[Source], list[int], list[memoryview]]:
    """The caller's ``into`` as ``(sources, address of each buffer of m, view of each)``."""
    srcs = collect(into)
    if len(srcs) == 1 and srcs[0].size >= m.size:
        addrs = [srcs[0].addr + sum(m.sizes[:i]) for i in range(len(m.sizes))]
        views, off = [], 0
        for n in m.sizes:
            views.append(srcs[0].view[off : off + n])
            off += n
        return srcs, addrs, views
    if [s.size for s in srcs] == m.sizes:
        return srcs, [s.addr for s in srcs], [s.view for s in srcs]
    raise BadName(
        f"into: {sum(s.size for s in srcs)} bytes in {len(srcs)} buffer(s), but "
        f"{m.name!r} needs {m.size} bytes in one buffer or buffers of sizes {m.sizes}"
    )


def _shards(sizes: list[int], shard_size: int) -> list[tuple[int, int, int]]:
    out = []
    for b, size in enumerate(sizes):
        for off in range(0, size, shard_size):
            out.append((b, off, min(shard_size, size - off)))
    return out


class P2PStore:
    """The P2P store of this process.

    Args:
        etcd: where manifests and holder records live: ``etcd://host:port[,host:port]``
            (a swarm); or, without etcd (two processes, see :mod:`~mooncake_core.p2p.direct`):
            ``P2PHANDSHAKE`` on the seeder (it serves them itself at :attr:`address`) and
            that ``p2p://host:port`` (or an ``http://host:port/metadata`` server) on the
            reader.
        listen: ``host:port`` of the seeder's own server with ``P2PHANDSHAKE`` (default
            ``127.0.0.1:0``, a free loopback port).
        engine: a started or unstarted transfer engine to serve and fetch with; by default
            one is made from ``config`` (its ``local_hostname`` is the address peers use).
        config: configuration for that engine (default :func:`load_config`).
        lease_ttl: seconds after which a dead process's holder records vanish.
        prefix: etcd key prefix (default ``<metadata.prefix>/p2p``).
    """

    def __init__(
        self,
        etcd: str,
        *,
        engine: TransferEngine | None = None,
        config: MooncakeConfig | None = None,
        lease_ttl: float = 10.0,
        prefix: str | None = None,
        timeout: float = 5.0,
        listen: str = "127.0.0.1:0",
    ) -> None:
        if not lease_ttl >= 1:
            raise BadName(f"lease_ttl must be at least 1 second, got {lease_ttl!r}")
        cfg = config if config is not None else (engine.config if engine else load_config())
        self._own_engine = engine is None
        self.engine = engine if engine is not None else TransferEngine(cfg)
        self.engine.start()
        self.keys = Keys((prefix or f"{cfg.metadata.prefix.rstrip('/')}/p2p").rstrip("/"))
        self._server: MetadataServer | None = None
        self.etcd: Coordinator
        try:
            target = etcd.strip() if isinstance(etcd, str) else etcd
            if isinstance(target, str) and target.upper().startswith(("P2P", "HTTP")):
                from mooncake_core.p2p.direct import HTTPCoordinator, serve_coordination
            if isinstance(target, str) and target.upper() == "P2PHANDSHAKE":
                self._server = serve_coordination(listen)
                self.etcd = HTTPCoordinator(self._server.url, timeout=timeout)
                host = self._server.host
                self.address = f"p2p://{f'[{host}]' if ':' in host else host}:{self._server.port}"
            elif isinstance(target, str) and target.startswith(("p2p://", "http://", "https://")):
                self.etcd = HTTPCoordinator(target, timeout=timeout)
                self.address = target
            else:
                self.etcd = P2PEtcd(etcd, timeout=timeout)
                self.address = etcd
            self.lease = self.etcd.grant_lease(lease_ttl)
        except BaseException:
            if self._server is not None:
                self._server.stop()
            if self._own_engine:
                self.engine.close()
            raise
        self.segment = self.engine.name
        self._held: dict[str, _Held] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._ids = itertools.count()

    def __enter__(self) -> P2PStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _manifest(self, name: str) -> Manifest:
        got = self.etcd.get_rev(self.keys.obj(name))
        if got is None:
            raise NameNotFound(f"no P2P object named {name!r} is registered")
        return Manifest.from_json(got[0], got[1])

    def _holder_record(self, addrs: list[int], origin: bool) -> Holder:
        return Holder(
            self.segment,
            addrs,
            origin,
            pid=os.getpid(),
            host=socket.gethostname(),
            lease=self.lease,
        )

    def _announce(self, held: _Held, mask: int, pending: int = 0) -> bool:
        with held.lock:
            held.holder.mask = mask & ~held.bad
            held.holder.pending = pending
            m = held.manifest
            return self.etcd.put_guarded(
                self.keys.obj(m.name),
                m.revision,
                self.keys.holder(m.name, m.version, self.segment),
                held.holder.to_json(),
                lease=self.lease,
            )

    def _register_memory(self, sources: list[Source], name: str) -> list[Region]:
        regions: list[Region] = []
        try:
            for s in sources:
                if s.size == 0:
                    continue
                try:
                    regions.append(
                        self.engine.register(s.owner, name=f"p2p:{name}:{next(self._ids)}")
                    )
                except SegmentOverlap:
                    # already registered with this engine (e.g. the caller's own buffer)
                    self.engine.segments.find(s.addr, s.size)
        except BaseException:
            for r in regions:
                self.engine.unregister(r)
            raise
        return regions

    # ------------------------------------------------------------------ corrupt copies
    def _report(self, m: Manifest, h: Holder, shard: int) -> None:
        """Tell everyone that ``h``'s copy of ``shard`` failed this reader's checksum."""
        body = json.dumps({"by": self.segment, "t": time.time()}).encode()
        self.etcd.put_under(
            self.keys.report(m.name, m.version, h.segment, shard), body, h.lease, self.lease
        )

    def _follow_reports(self, held: _Held) -> None:
        """Re-verify this process's copy of a shard whenever a reader reports it corrupt."""
        watch = getattr(self.etcd, "watch", None)
        if watch is None:
            return
        m = held.manifest

        def on_report(key: str, raw: bytes | None, rev: int) -> None:
            if raw is None:
                return
            try:
                shard = int(self.keys.last_parts(key, 1)[0])
            except ValueError:
                return
            threading.Thread(
                target=self._reverify, args=(held, shard, key), name="mc-p2p-verify", daemon=True
            ).start()

        try:
            held.unwatch = watch(
                self.keys.reports(m.name, m.version, self.segment), on_report, prefix=True
            )
        except MetadataError as exc:
            logger.warning("p2p %s: cannot follow corruption reports: %s", m.name, exc)

    def _reverify(self, held: _Held, shard: int, key: str) -> None:
        m = held.manifest
        if not 0 <= shard < len(m.shards):
            return
        s = m.shards[shard]
        ok = True
        if held.holder.has(shard):
            view = held.replica.buffers[s.buf][s.offset : s.offset + s.length]
            ok = checksum(view) == s.xxh
        if not ok:
            logger.warning(
                "p2p %s: shard %d of this process's copy is corrupt (a reader reported it, "
                "re-verified here); it is no longer served",
                m.name,
                shard,
            )
            held.bad |= 1 << shard
            with contextlib.suppress(MooncakeError):
                self._announce(held, held.holder.mask, held.holder.pending)
        else:
            logger.info("p2p %s: shard %d was reported corrupt but verifies here", m.name, shard)
        with contextlib.suppress(MooncakeError):
            self.etcd.delete(key)  # after the new record: watchers see that first

    def _drop(self, held: _Held, *, delete_key: bool = True) -> None:
        m = held.manifest
        if held.unwatch is not None:
            held.unwatch()
            held.unwatch = None
        if delete_key:
            with contextlib.suppress(Exception):
                self.etcd.delete(self.keys.holder(m.name, m.version, self.segment))
        for r in held.regions:
            with contextlib.suppress(SegmentError):
                self.engine.unregister(r)
        if held.managed is not None:
            with contextlib.suppress(SegmentError):
                self.engine.free(held.managed)

    def _check_open(self) -> None:
        if self._closed:
            raise P2PError("this P2P store is closed")

    # ------------------------------------------------------------------ API
    def register(
        self,
        name: str,
        buffers: Any,
        *,
        max_shard_size: int | str = "64MB",
        force: bool = False,
        meta: dict[str, str] | None = None,
    ) -> Replica:
        """Publish ``buffers`` under ``name`` and serve them from this process.

        Raises:
            BadName: a bad name, shard size or buffer; nothing to publish.
            NameExists: ``name`` is registered already (``force=True`` replaces it: readers
                of the old version are then told, see :class:`VersionChanged`).

        ``meta`` (short strings) travels with the manifest: :meth:`list` and replicas show it.
        """
        self._check_open()
        check_name(name)
        shard_size = check_shard_size(max_shard_size)
        sources = collect(buffers)
        sizes = [s.size for s in sources]
        if sum(sizes) == 0:
            raise BadName(f"{name!r}: nothing to publish (every buffer is empty)")
        shards = [
            Shard(i, b, off, n, checksum(sources[b].view[off : off + n]))
            for i, (b, off, n) in enumerate(_shards(sizes, shard_size))
        ]
        m = Manifest(
            name=name,
            version=uuid.uuid4().hex,
            shard_size=shard_size,
            sizes=sizes,
            labels=[s.label for s in sources],
            shards=shards,
            origin=self.segment,
            created=time.time(),
            meta=dict(meta or {}),
        )
        with self._lock:
            old = self._held.get(name)
            if old is not None and not force:
                raise NameExists(
                    f"{name!r} is already held by this process; pass force=True to replace it"
                )
            regions = self._register_memory(sources, name)
            key = self.keys.obj(name)
            try:
                rev = self.etcd.create_rev(key, m.to_json())
                if rev is None:
                    if not force:
                        raise NameExists(self._exists_message(name))
                    self.etcd.delete_prefix(self.keys.holders(name))
                    rev = self.etcd.replace_rev(key, m.to_json())
                m.revision = rev
                holder = self._holder_record([s.addr for s in sources], True)
                replica = Replica(
                    name,
                    m.version,
                    m.size,
                    shard_size,
                    m.labels,
                    [s.view for s in sources],
                    True,
                    meta=m.meta,
                )
                held = _Held(m, holder, replica, sources, regions)
                if not self._announce(held, (1 << len(shards)) - 1):
                    raise VersionChanged(f"{name!r} was registered again while registering it")
            except BaseException:
                for r in regions:
                    with contextlib.suppress(SegmentError):
                        self.engine.unregister(r)
                raise
            if old is not None:
                self._drop(old, delete_key=False)
            self._held[name] = held
        self._follow_reports(held)
        logger.info(
            "p2p: registered %s (%d bytes, %d shard(s) of <= %d bytes, version %s)",
            name,
            m.size,
            len(shards),
            shard_size,
            m.version[:12],
        )
        return replica

    def _exists_message(self, name: str) -> str:
        try:
            info = next((o for o in self.list(name) if o.name == name), None)
        except P2PError:
            info = None
        if info is None:
            return f"{name!r} is already registered; pass force=True to replace it"
        return (
            f"{name!r} is already registered (version {info.version[:12]}, {info.size} bytes, "
            f"{len(info.holders)} live holder(s)); pass force=True (seed --force) to replace it or "
            "unregister it first"
        )

    def get_replica(
        self,
        name: str,
        into: Any = None,
        *,
        swarm: bool = True,
        concurrency: int = 8,
        origin_streams: int = 2,
        progress: Callable[[Progress], None] | None = None,
        timeout: float | None = None,
        stall_timeout: float = 20.0,
    ) -> Replica:
        """Fetch every shard of ``name`` (verified) and serve them from here afterwards.

        Args:
            into: memory to fetch into (bytearray, numpy array, CPU torch tensor, mmap...):
                one buffer of at least the total size, or one buffer per buffer of the name
                with the same sizes; by default shared memory the engine allocates. When this
                process holds that version already, its bytes are copied into ``into``.
            swarm: False fetches from the original copy only (the seeder-only baseline).
            concurrency: shards fetched at once; ``origin_streams`` of them at most from
                the original copy (readers' replicas are preferred).
            progress: called after every verified shard.
            timeout: seconds for one shard's read (default: the engine's).
            stall_timeout: give up when no holder can supply any remaining shard this long.

        Raises:
            NameNotFound: no such name, or it was unregistered during the download.
            VersionChanged: it was registered again (a new version) during the download.
            ShardUnavailable: no live holder could supply some shard intact.
        """
        self._check_open()
        check_name(name)
        m = self._manifest(name)
        with self._lock:
            cur = self._held.get(name)
            if cur is not None:
                if cur.manifest.version == m.version:
                    if into is None:
                        return cur.replica
                    return self._copy_held(cur, into)
                self._drop(self._held.pop(name))
        managed: ManagedBuffer | None = None
        regions: list[Region] = []
        if into is None:
            if m.size:
                managed = self.engine.allocate(m.size, name=f"p2p:{name}:{next(self._ids)}")
                base = managed.addr
                mv = managed.view
            else:
                base, mv = 0, memoryview(bytearray(0))
            addrs, views, off = [], [], 0
            for s in m.sizes:
                addrs.append(base + off)
                views.append(mv[off : off + s])
                off += s
        else:
            srcs, addrs, views = _place(m, into)
            regions = self._register_memory(srcs, name)
        holder = self._holder_record(addrs, False)
        replica = Replica(
            name, m.version, m.size, m.shard_size, m.labels, views, False, meta=m.meta
        )
        held = _Held(m, holder, replica, [], regions, managed)
        dl = Download(
            engine=self.engine,
            etcd=self.etcd,
            keys=self.keys,
            manifest=m,
            dest_addrs=addrs,
            me=self.segment,
            announce=lambda mask, pending: self._announce(held, mask, pending),
            swarm=swarm,
            concurrency=concurrency,
            origin_streams=origin_streams,
            stall_timeout_s=stall_timeout,
            timeout_s=timeout,
            progress=progress,
            report=lambda h, shard: self._report(m, h, shard),
        )
        self._follow_reports(held)
        try:
            stats = dl.run()
        except BaseException:
            self._drop(held)
            raise
        replica.stats = stats.as_dict()
        with self._lock:
            self._held[name] = held
        logger.info(
            "p2p: fetched %s (%d bytes in %.2fs: %d shard(s) from peers, %d from the origin, "
            "%d corrupt, %d failed read(s), %d holder(s) dropped)",
            name,
            m.size,
            stats.seconds,
            stats.from_peers,
            stats.from_origin,
            stats.corrupt,
            stats.failed,
            stats.holders_dropped,
        )
        return replica

    def _copy_held(self, held: _Held, into: Any) -> Replica:
        """``get_replica(into=...)`` of a version this process holds already: a local copy
        into the caller's memory (nothing fetched; the held replica stays the one served)."""
        m = held.manifest
        _, _, views = _place(m, into)
        for dst, src in zip(views, held.replica.buffers, strict=True):
            dst[:] = src
        stats: dict[str, float | int] = {"from_origin": 0, "from_peers": 0, "local_copy": 1}
        return Replica(
            m.name, m.version, m.size, m.shard_size, m.labels, views, False, stats, m.meta
        )

    def delete_replica(self, name: str) -> None:
        """Stop serving this process's replica of ``name`` and free its memory.

        Raises:
            NameNotFound: this process holds no replica of ``name``.
        """
        check_name(name)
        with self._lock:
            held = self._held.pop(name, None)
        if held is None:
            raise NameNotFound(f"this process holds no replica of {name!r}")
        self._drop(held)

    def unregister(self, name: str) -> None:
        """Remove ``name`` for everyone: its manifest and every holder record. Readers in
        the middle of a download get :class:`NameNotFound`; holders stop being listed
        (processes that hold it free their memory on :meth:`delete_replica` / exit).

        Raises:
            NameNotFound: ``name`` is not registered.
        """
        self._check_open()
        check_name(name)
        m = self._manifest(name)
        if not self.etcd.delete_guarded(self.keys.obj(name), m.revision):
            raise VersionChanged(f"{name!r} changed while unregistering it; try again")
        self.etcd.delete_prefix(self.keys.holders(name))
        with self._lock:
            held = self._held.pop(name, None)
        if held is not None:
            self._drop(held, delete_key=False)
        logger.info("p2p: unregistered %s (version %s)", name, m.version[:12])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every registered name starting with ``prefix``, sorted, with its live holders."""
        if not isinstance(prefix, str):
            raise BadName(f"prefix must be a string, got {type(prefix).__name__}")
        objs = self.etcd.get_prefix_rev(self.keys.objects(prefix))
        out = []
        for key, (raw, rev) in sorted(objs.items()):
            try:
                m = Manifest.from_json(raw, rev)
            except (ValueError, KeyError, TypeError):
                logger.warning("p2p: ignoring a malformed manifest at %s", key)
                continue
            holders = []
            for raw_h, _ in self.etcd.get_prefix_rev(self.keys.holders(m.name, m.version)).values():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    holders.append(Holder.from_json(raw_h))
            full = (1 << len(m.shards)) - 1
            out.append(
                ObjectInfo(
                    name=m.name,
                    version=m.version,
                    size=m.size,
                    shard_size=m.shard_size,
                    shards=len(m.shards),
                    sizes=m.sizes,
                    labels=m.labels,
                    origin=m.origin,
                    holders=sorted(h.segment for h in holders if h.mask),
                    complete=sum(1 for h in holders if h.mask & full == full),
                    created=m.created,
                    meta=m.meta,
                )
            )
        return out

    def held(self) -> builtins.list[str]:
        """Names this process holds and serves."""
        with self._lock:
            return sorted(self._held)

    def close(self) -> None:
        """Stop serving everything, withdraw this process's holder records, release."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for h in held:
            self._drop(h)
        with contextlib.suppress(Exception):
            self.etcd.close()  # revokes the lease: whatever was left vanishes
        if self._server is not None:
            self._server.stop()
        if self._own_engine:
            self.engine.close()
