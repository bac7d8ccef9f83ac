"""The store master: an asyncio RPC service over :class:`MasterState`, plus its HTTP port.

Contract:

- RPC: length-prefixed msgpack frames (:mod:`mooncake_core.store.protocol`) on
  ``rpc_port``. Requests on one connection are answered in order of completion; the
  bundled client sends one request at a time per connection. A malformed frame closes
  that connection only.
- HTTP on ``http_port``: ``/metrics`` (Prometheus), ``/health``, ``/role``,
  ``/query_key?key=K``, ``/segments``, and (unless disabled) the HTTP metadata server at
  ``/metadata`` so one process serves a small deployment.
- HA (``ha_url`` = ``etcd://host:port``): see :mod:`mooncake_core.store.ha`. A standby
  answers every RPC with ``NOT_LEADER`` naming the leader.
- Background: expire silent clients, reclaim unfinished puts, evict above the high
  watermark (every ``tick_s``).

:class:`MasterServer` is used by ``mooncake-core master`` and by tests (``start_in_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from mooncake_core.config import StoreConfig
from mooncake_core.errors import ConfigError
from mooncake_core.store import protocol as P
from mooncake_core.store.ha_node import HANode
from mooncake_core.store.master_conn import (
    CONFIRMS,
    PARKED_ON_KEYS,
    Conn,
    Handler,
    early_key,
    install_uvloop,
)
from mooncake_core.store.metrics import Metrics
from mooncake_core.store.state import MasterState, error_tuple

__all__ = ["MasterServer", "install_uvloop"]

logger = logging.getLogger(__name__)


class MasterServer(HANode):
    """One master process (leader, or standby with HA).

    Args:
        cfg: store settings (leases, watermarks, placement, timeouts).
        host, rpc_port: RPC listen address (port 0 picks a free one).
        http_host, http_port: HTTP listen address (port 0 picks; -1 disables HTTP).
        ha_url: ``etcd://host:port`` to run with leader election; None for a single master.
        cluster_id: namespace of the leader key and oplog in etcd.
        advertise: RPC address clients should use (defaults to host:port).
        serve_metadata: also serve the HTTP metadata protocol at ``/metadata``.
        tick_s: period of the background checks.
        ha_lease_ttl_s: etcd lease of the leader key (failover takes about this long).
        snapshot_every: (HA) snapshot into etcd every this many oplog batches.
        snapshot_interval_s: (HA) also every this many seconds when the oplog grew; 0 = off.
        snapshot_retention: (HA) snapshots kept in etcd (the oplog is kept from the oldest).
        takeover_lease_s: (HA) lease every object gets when this master takes over, on top of
            the replicated ones (it covers reads granted in the last moments before the old
            leader died, not yet logged); None = the read lease (``cfg.lease_ttl_s``).
        kv_events_endpoint: bind a ZMQ PUB socket there and publish KV events of every
            object stored, evicted or removed (:mod:`mooncake_core.store.kvevents`); "" = off.
        kv_events_queue: most events waiting to be sent (oldest dropped beyond).
        kv_events_backend_id: copied into every event.
        tenant_quotas: byte quota per tenant (:mod:`mooncake_core.store.tenants`; ``"*"``: any
            tenant without its own).
    """

    def __init__(
        self,
        cfg: StoreConfig | None = None,
        *,
        host: str = "127.0.0.1",
        rpc_port: int = 50051,
        http_host: str = "127.0.0.1",
        http_port: int = 9003,
        ha_url: str | None = None,
        cluster_id: str = "default",
        advertise: str = "",
        serve_metadata: bool = True,
        tick_s: float = 0.2,
        ha_lease_ttl_s: float = 2.0,
        snapshot_every: int = 2000,
        snapshot_interval_s: float = 0.0,
        snapshot_retention: int = 2,
        takeover_lease_s: float | None = None,
        kv_events_endpoint: str = "",
        kv_events_queue: int = 65536,
        kv_events_backend_id: str = "",
        tenant_quotas: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg or StoreConfig()
        self.state = MasterState(self.cfg)
        self.metrics = Metrics(self)
        self.host, self.rpc_port = host, rpc_port
        self.http_host, self.http_port = http_host, http_port
        self.ha_url = ha_url
        self.cluster_id = cluster_id
        self.advertise = advertise
        self.serve_metadata = serve_metadata
        self.tick_s = tick_s
        self.ha_lease_ttl_s = ha_lease_ttl_s
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        if snapshot_retention < 1:
            raise ConfigError(f"--snapshot-retention must be at least 1, got {snapshot_retention}")
        self.snapshot_retention = snapshot_retention
        self.takeover_lease_s = takeover_lease_s
        self._snap_seq = 0
        self._snap_time = time.monotonic()
        self._snapshotting = False
        self.kv_events_endpoint = kv_events_endpoint
        self.kv_events_queue = kv_events_queue
        self.kv_events_backend_id = kv_events_backend_id
        self.kv_events: Any = None  # KVEventPublisher once started
        self.snapshots: Any = None  # a snapshots.SnapshotService: restore, periodic snapshots
        self.tenant_quotas = dict(tenant_quotas or {})
        self.state.tenant_quotas = self.tenant_quotas
        self.id = uuid.uuid4().hex[:12]
        self.role = "starting"
        self.leader_hint = ""
        self._etcd: Any = None
        self._me: Any = None
        self._seq = 0
        self._log: list[Any] = []
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._flush_wake: asyncio.Event | None = None
        self._pollers: dict[str, asyncio.Future[None]] = {}
        self._parked: dict[
            str, list[tuple[Conn, P.Request]]
        ] = {}  # key -> requests waiting for its put_confirm
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: asyncio.base_events.Server | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self.state.on_task = self._wake_poller
        self._handlers: dict[str, Handler] = self._make_handlers()

    # ------------------------------------------------------------------ handlers
    def _make_handlers(self) -> dict[str, Handler]:
        st = self.state

        def batch_put_start(a: Any, now: float) -> list[Any]:
            if len(a.keys) != len(a.sizes):
                raise P.InvalidArgument(
                    f"batch_put_start: {len(a.keys)} keys but {len(a.sizes)} sizes"
                )
            if len(a.keys) > P.MAX_BATCH:
                raise P.InvalidArgument(
                    f"batch of {len(a.keys)} keys exceeds the limit of {P.MAX_BATCH}"
                )
            out: list[Any] = []
            for k, n in zip(a.keys, a.sizes, strict=True):
                try:
                    tok, reps = st.put_start(a.client_id, k, n, a.cfg, now, a.exclude)
                    out.append((0, tok, reps))
                except P.UnknownClient:
                    raise
                except Exception as exc:
                    code, msg = error_tuple(exc)
                    out.append((code, msg, []))
            return out

        def each_key(name: str, a: Any, fn: Callable[[str, int, bool], None]) -> list[Any]:
            """Per key of ``a`` (keys, tokens, ok): (0, "") or the error of
            ``fn(key, token, ok)``."""
            if not len(a.keys) == len(a.tokens) == len(a.ok):
                raise P.InvalidArgument(f"{name}: keys, tokens and ok must have the same length")
            out: list[Any] = []
            for k, t, ok in zip(a.keys, a.tokens, a.ok, strict=True):
                try:
                    fn(k, t, ok)
                    out.append((0, ""))
                except P.UnknownClient:
                    raise
                except Exception as exc:
                    out.append(error_tuple(exc))
            return out

        def batch_put_end(a: Any, now: float) -> list[Any]:
            return each_key(
                "batch_put_end",
                a,
                lambda k, t, ok: (
                    st.put_end(a.client_id, k, t, now)
                    if ok
                    else st.put_revoke(a.client_id, k, t, now)
                ),
            )

        def no_early_with_ha(a: Any, what: str) -> None:
            if a.early and self.ha_url is not None:
                # an early commit is acknowledged before it could be logged: only without HA
                raise P.EarlyCommitsOff(
                    f"{what}: early commits are off on an HA master (its reservations stay "
                    f"usable); commit after the write"
                )

        def put_commit(a: Any, now: float) -> tuple[float, int]:
            no_early_with_ha(a, f"put {a.key!r}")
            return st.put_commit(
                a.client_id, a.key, a.rid, a.offset, a.size, a.cfg, now, early=a.early
            )

        def batch_put_commit(a: Any, now: float) -> list[Any]:
            n = len(a.keys)
            if not n == len(a.rids) == len(a.offsets) == len(a.sizes):
                raise P.InvalidArgument(
                    "batch_put_commit: keys, rids, offsets and sizes must have the same length"
                )
            if n > P.MAX_BATCH:
                raise P.InvalidArgument(f"batch of {n} keys exceeds the limit of {P.MAX_BATCH}")
            no_early_with_ha(a, "batch_put_commit")
            out: list[Any] = []
            for k, rid, off, size in zip(a.keys, a.rids, a.offsets, a.sizes, strict=True):
                try:
                    ttl, token = st.put_commit(
                        a.client_id, k, rid, off, size, a.cfg, now, early=a.early
                    )
                    out.append((0, ttl, token))
                except P.UnknownClient:
                    raise
                except Exception as exc:
                    code, msg = error_tuple(exc)
                    out.append((code, msg, 0))
            return out

        def batch_put_confirm(a: Any, now: float) -> list[Any]:
            return each_key(
                "batch_put_confirm", a, lambda k, t, ok: st.put_confirm(a.client_id, k, t, ok, now)
            )

        return {
            "register_client": lambda a, now: {
                **st.register_client(a.client_id, a.host, a.peer, a.ssd, now),
                "early_commit": self.ha_url is None,
            },
            "mount": lambda a, now: st.mount(
                a.client_id, a.segment, a.peer, a.base, a.size, a.host, now
            ),
            "unmount": lambda a, now: st.unmount(a.client_id, a.segment, now),
            "task_done": lambda a, now: st.task_done(
                a.client_id, a.kind, a.key, a.token, a.ok, a.detail, now
            ),
            "put_start": lambda a, now: st.put_start(
                a.client_id, a.key, a.size, a.cfg, now, a.exclude
            ),
            "batch_put_start": batch_put_start,
            "put_end": lambda a, now: st.put_end(a.client_id, a.key, a.token, now),
            "put_revoke": lambda a, now: st.put_revoke(a.client_id, a.key, a.token, now),
            "batch_put_end": batch_put_end,
            "reserve": lambda a, now: st.reserve(
                a.client_id, a.size, a.cfg, a.release, now, a.count
            ),
            "batch_put_commit": batch_put_commit,
            "batch_put_confirm": batch_put_confirm,
            "put_commit": put_commit,
            "put_confirm": lambda a, now: st.put_confirm(a.client_id, a.key, a.token, a.ok, now),
            "get_replica_list": lambda a, now: st.get_replica_list(a.key, now),
            "batch_get_replica_list": lambda a, now: st.batch_get_replica_list(a.keys, now),
            "exists": lambda a, now: st.exists(a.key, now),
            "batch_exists": lambda a, now: st.batch_exists(a.keys, now),
            "get_size": lambda a, now: st.get_size(a.key, now),
            "remove": lambda a, now: st.remove(a.key, a.force, now),
            "batch_remove": lambda a, now: st.batch_remove(a.keys, a.force, now),
            "remove_by_regex": lambda a, now: st.remove_by_regex(a.pattern, a.force, now, a.tenant),
            "keys_by_regex": lambda a, now: st.keys_by_regex(a.pattern, a.tenant),
            "remove_all": lambda a, now: st.remove_all(a.force, now, a.tenant),
            "ping": lambda a, now: {"role": self.role, "id": self.id},
            "stats": lambda a, now: st.stats(),
            "query_key": lambda a, now: st.query_key(a.key),
            "create_replica_task": lambda a, now: st.create_replica_task(
                a.client_id, a.kind, a.key, a.targets, a.source, now
            ),
            "query_replica_task": lambda a, now: st.query_replica_task(a.task_id),
            "drop_replicas": lambda a, now: st.drop_replicas(a.client_id, a.key, a.segment, now),
            "drop_disk": lambda a, now: st.drop_disk(a.client_id, now),
        }

    def handle(self, conn: Conn, req: P.Request) -> None:
        t0 = time.perf_counter()
        method = req.method
        if req.v != P.VERSION:
            conn.send(
                P.encode_response(
                    req.id,
                    P.Code.UNSUPPORTED,
                    f"RPC version {req.v} is not supported (this master speaks {P.VERSION})",
                )
            )
            return
        if self.role != "leader" and method != "ping":
            hint = f"; the leader is {self.leader_hint}" if self.leader_hint else ""
            conn.send(
                P.encode_response(
                    req.id, P.Code.NOT_LEADER, f"master {self.id} is {self.role}{hint}"
                )
            )
            return
        if method == "poll":
            asyncio.ensure_future(self._poll(conn, req, t0))
            return
        ok = True
        args: Any = None
        try:
            args = P.decode_params(method, req.params)
            if self.state.early and method in PARKED_ON_KEYS:
                key = early_key(method, args, self.state.early)
                if (
                    key is not None
                ):  # a put of this key is committed and about to be confirmed: wait for it
                    self._parked.setdefault(key, []).append((conn, req))
                    return
            result = self._handlers[method](args, time.monotonic())
            if method == "put_commit" and args.early:
                conn.early[args.key] = int(result[1])
            elif method == "batch_put_commit" and args.early:
                for k, (code, _ttl, token) in zip(args.keys, result, strict=True):
                    if code == 0:
                        conn.early[k] = int(token)
            out = P.encode_response(req.id, P.Code.OK, result)
        except Exception as exc:
            ok = False
            code, msg = error_tuple(exc)
            if code == P.Code.INTERNAL:
                logger.exception("internal error in %s", method)
            out = P.encode_response(req.id, code, msg)
        self.metrics.observe(method, time.perf_counter() - t0, ok, args, result if ok else None)
        if method in CONFIRMS and args is not None:
            for k in args.keys if method == "batch_put_confirm" else (args.key,):
                conn.early.pop(k, None)
            if not args.reply:
                if not ok:
                    logger.info(
                        "one-way %s", msgspec.msgpack.decode(P.decode_response(out[4:]).result)
                    )
                elif method == "batch_put_confirm" and any(r[0] for r in result):
                    logger.info("one-way batch_put_confirm: %s", next(r[1] for r in result if r[0]))
                out = b""
        if self._parked:
            self._unpark_resolved()
        if self._log and self._etcd is not None:
            asyncio.ensure_future(self._reply_when_durable(conn, out))
        else:
            self._log.clear()
            if out:
                conn.send(out)

    def revoke_early(self, conn: Conn) -> None:
        """A connection closed: drop the early commits it made and never confirmed (their writes
        may not have landed, and no put that made them returned)."""
        early, conn.early = conn.early, {}
        for key, token in early.items():
            o = self.state.objects.get(key)
            if o is not None and o.early and o.token == token:
                logger.info(
                    "dropping the early commit of %r: its connection closed before put_confirm", key
                )
                self.state.put_confirm(o.owner, key, token, False, time.monotonic())
        if self._parked:
            self._unpark_resolved()

    def _unpark_resolved(self) -> None:
        """Serve again the requests that waited for early commits which are now confirmed or
        dropped."""
        done = [k for k in self._parked if k not in self.state.early]
        for k in done:
            for conn, req in self._parked.pop(k):
                if self._loop is not None:
                    self._loop.call_soon(self.handle, conn, req)
                else:
                    self.handle(conn, req)

    async def _poll(self, conn: Conn, req: P.Request, t0: float) -> None:
        try:
            a = P.decode_params("poll", req.params)
            assert isinstance(a, P.PollArgs)
            conn.poller = a.client_id
            now = time.monotonic()
            tasks = self.state.take_tasks(a.client_id, now)
            if not tasks and a.timeout_s > 0:
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                old = self._pollers.pop(a.client_id, None)
                if old is not None and not old.done():
                    old.set_result(None)
                self._pollers[a.client_id] = fut
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(fut, min(a.timeout_s, 30.0))
                if self._pollers.get(a.client_id) is fut:
                    del self._pollers[a.client_id]
                if self.role != "leader":
                    raise P.NotLeader(f"master {self.id} is {self.role}")
                tasks = self.state.take_tasks_after_wait(a.client_id, time.monotonic())
            out = P.encode_response(req.id, P.Code.OK, tasks)
            ok = True
        except Exception as exc:
            ok = False
            out = P.encode_response(req.id, *error_tuple(exc))
        self.metrics.observe("poll", time.perf_counter() - t0, ok)
        conn.send(out)

    def heartbeat_lost(self, client_id: str) -> None:
        """The connection ``client_id``'s polls came on closed (see
        :meth:`~mooncake_core.store.state.MasterState.heartbeat_lost`)."""
        if self.role == "leader":
            self.state.heartbeat_lost(client_id, time.monotonic())

    def _wake_poller(self, client_id: str) -> None:
        fut = self._pollers.get(client_id)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------------ background
    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if self.role != "leader":
                continue
            now = time.monotonic()
            try:
                self.state.expire_clients(now)
                self.state.reclaim(now)
                self.state.check_watermarks(now)
                self.state.tier_tick(now)
                self.state.replica_task_tick(now)
                if self._parked:  # early commits that timed out
                    self._unpark_resolved()
                if self._etcd is not None:
                    self._ha_tick(now)
            except Exception:
                logger.exception("background check failed")
            if self._log:
                if self._etcd is not None:
                    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    self._flush_waiters.append(fut)
                    assert self._flush_wake is not None
                    self._flush_wake.set()
                else:
                    self._log.clear()

    def _change_sink(self) -> Callable[[tuple[Any, ...]], None]:
        """Where the state's change entries go: the oplog, and the KV-event publisher if on."""
        if self.kv_events is None:
            return self._log.append
        sink: Callable[[tuple[Any, ...]], None] = self.kv_events.sink(self._log.append, self.state)
        return sink

    # ------------------------------------------------------------------ HTTP
    def _http_app(self) -> web.Application:
        from mooncake_core.store.master_http import build_http_app

        return build_http_app(self)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.ha_url:  # refuse, before binding, a leader address other hosts cannot use
            from mooncake_core.store.ha import check_listen

            check_listen(self.host, self.advertise, self.ha_url)
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopped = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._server = await loop.create_server(
            lambda: Conn(self), self.host, self.rpc_port, reuse_address=True
        )
        self.rpc_port = self._server.sockets[0].getsockname()[1]
        if self.http_port >= 0:
            self._runner = web.AppRunner(self._http_app(), access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.http_host, self.http_port, reuse_address=True)
            await site.start()
            srv: Any = site._server
            self.http_port = srv.sockets[0].getsockname()[1]
        rpc = self.advertise or f"{self.host}:{self.rpc_port}"
        if self.kv_events_endpoint and self.kv_events is None:
            from mooncake_core.store.kvevents import KVEventPublisher
            from mooncake_core.store.tenants import tenant_of

            self.kv_events = KVEventPublisher(
                self.kv_events_endpoint,
                queue_capacity=self.kv_events_queue,
                backend_id=self.kv_events_backend_id,
                tenant_of=tenant_of,
            )
        self._tasks += self.snapshots.attach(self) if self.snapshots is not None else []
        self._tasks.append(asyncio.ensure_future(self._ticker()))
        if self.ha_url:
            from mooncake_core.store.ha import LeaderInfo, StoreEtcd, leader_addresses

            rpc, http = leader_addresses(
                self.host,
                self.rpc_port,
                self.http_host,
                self.http_port,
                self.advertise,
                self.ha_url,
            )
            self._etcd = await loop.run_in_executor(None, StoreEtcd, self.ha_url, self.cluster_id)
            self._me = LeaderInfo(self.id, rpc, http)
            self.role = "standby"
            self.state.lease_dirty = {}  # leases are replicated (coarsely) with HA
            self.state.on_change = self._change_sink()
            self._tasks.append(asyncio.ensure_future(self._flusher()))
            self._tasks.append(asyncio.ensure_future(self._ha_loop()))
        else:
            self.state.on_change = self._change_sink()
            self.role = "leader"
            self.leader_hint = rpc
        logger.info(
            "store master %s: RPC on %s:%d, HTTP on %s:%d%s",
            self.id,
            self.host,
            self.rpc_port,
            self.http_host,
            self.http_port,
            f", HA via {self.ha_url}" if self.ha_url else "",
        )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._etcd is not None:
            etcd, self._etcd = self._etcd, None
            await asyncio.get_running_loop().run_in_executor(None, etcd.close)
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    async def serve_forever(self) -> None:
        await self.start()
        assert self._stopped is not None
        try:
            await self._stopped.wait()
        finally:
            await self.stop()

    def start_in_thread(self) -> MasterServer:
        """Run the master on a private event loop thread (tests, embedding)."""
        ready = threading.Event()
        err: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def boot() -> None:
                try:
                    await self.start()
                except BaseException as exc:
                    err.append(exc)
                    raise
                finally:
                    ready.set()
                assert self._stopped is not None
                await self._stopped.wait()
                await self.stop()

            with contextlib.suppress(BaseException):
                loop.run_until_complete(boot())
            loop.close()

        self._thread = threading.Thread(target=main, name="mc-master", daemon=True)
        self._thread.start()
        ready.wait()
        if err:
            raise err[0]
        return self

    def shutdown(self) -> None:
        """Stop a master started with :meth:`start_in_thread`."""
        loop = self._loop
        if loop is not None and self._stopped is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"
