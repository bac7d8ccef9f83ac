"""The transfer engine: registered memory, peers, batched asynchronous transfers.

Typical use::

    with TransferEngine(load_config()) as eng:          # listens on 127.0.0.1:<port>
        buf = eng.allocate(64 << 20)                     # shm-backed, registered
        eng.write(peer, buf.view[:1 << 20], remote_addr) # synchronous
        batch = eng.submit([TransferRequest("read", peer, local, remote_addr=a, length=n)])
        batch.wait()

A request is cut into slices; each peer's slices go to the best transport that reaches
it (shared memory on the same host, RDMA when both ends have a device, else TCP; a
request may name its transport). When a transport fails, the items still outstanding
fail over to the next transport; a batch reports success only when every byte moved.

Where it listens: ``transfer.listen_host`` when set, else the address ``local_hostname``
names when it is this host's (an IP literal, or a name resolving to one), else 127.0.0.1;
see :func:`~mooncake_core.transfer.topology.plan_listen`. A setting other hosts cannot
reach is logged as a warning; an address that is not this host's is refused.

Neighbours: the value types and the narrow interfaces that transports and the listener
see of the engine are in :mod:`~mooncake_core.transfer.types`; control messages (tensors,
notifications) arrive in a :class:`~mooncake_core.transfer.control.ControlInbox`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mooncake_core.config import MooncakeConfig, load_config
from mooncake_core.errors import (
    InvalidRequest,
    MetadataError,
    PeerUnreachable,
    SegmentError,
    TransferTimeout,
    TransportError,
)
from mooncake_core.metadata.base import MetadataBackend, open_backend
from mooncake_core.metrics import serve_process
from mooncake_core.metrics.transfer import TRANSFER
from mooncake_core.plugins import transports as discover_transports
from mooncake_core.transfer.batch import (
    OPS,
    Batch,
    DoneBatch,
    RequestStatus,
    TransferRequest,
    local_side,
    wait_all,
)
from mooncake_core.transfer.control import ControlInbox
from mooncake_core.transfer.memory import (
    ManagedBuffer,
    Region,
    SegmentTable,
    buffer_address,
    view_address,
)
from mooncake_core.transfer.protocol import Op, Status
from mooncake_core.transfer.server import TransferServer
from mooncake_core.transfer.tensors import encode_tensor
from mooncake_core.transfer.topology import host_identity, plan_listen, resolve_interfaces
from mooncake_core.transfer.transports.base import Transport
from mooncake_core.transfer.types import READ, WRITE, PeerInfo, TransportHost, WorkItem

__all__ = [
    "TransferEngine",
    "TransferRequest",
    "Batch",
    "RequestStatus",
    "PeerInfo",
    "wait_all",
]

logger = logging.getLogger(__name__)


class TransferEngine:
    """Moves bytes between registered memory of this process and its peers.

    Args:
        config: configuration (defaults to :func:`load_config`).
        **overrides: config overrides, e.g. ``protocol="tcp"``, ``transfer={"secret": "s"}``.
    """

    def __init__(self, config: MooncakeConfig | None = None, **overrides: Any) -> None:
        cfg = config if config is not None else load_config()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config = cfg
        self.segments = SegmentTable()
        self.host_id = host_identity()
        self.name = ""
        self.port = 0
        self.io_pool = ThreadPoolExecutor(
            max_workers=max(4, 4 * cfg.transfer.connections_per_peer), thread_name_prefix="mc-io"
        )
        self._batch_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mc-batch")
        self._peers: dict[str, PeerInfo] = {}
        self._peers_lock = threading.Lock()
        self._transports: dict[str, Transport] = {}
        self._control: Transport | None = None  # the transport that carries control messages
        self._server: TransferServer | None = None
        self._metadata: MetadataBackend | None = None
        self._managed: dict[int, ManagedBuffer] = {}
        self.inbox = ControlInbox()  # tensors and notifications peers sent us
        self._names = itertools.count()
        self.source_addresses: list[str] = []
        self._started = False
        self._closed = False
        self.stats = {"bytes_read": 0, "bytes_written": 0, "failovers": 0}
        self._slice_size = int(cfg.transfer.slice_size)  # read per transfer: looked up once
        self._timeout_s = float(cfg.transfer.timeout_s)
        self.metrics_url = ""  # this process's /metrics when transfer.metrics_port >= 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TransferEngine:
        """Open the listener, load transports, publish metadata. Idempotent."""
        if self._started:
            return self
        cfg = self.config
        host_part, sep, port_part = cfg.local_hostname.rpartition(":")
        advertised = host_part if sep and port_part.isdigit() else cfg.local_hostname
        port = int(port_part) if sep and port_part.isdigit() else cfg.transfer.port
        if cfg.transfer.interfaces:
            listen = resolve_interfaces(cfg.transfer.interfaces)
            if cfg.transfer.stripe_interfaces:
                self.source_addresses = list(listen)
            advertise = list(listen)
        else:
            # listen where local_hostname says peers connect (loopback by default)
            plan = plan_listen(advertised, cfg.transfer.listen_host)
            for why in plan.warnings:
                logger.warning("transfer engine: %s", why)
            listen, advertise = plan.listen, plan.advertise
        self._server = TransferServer(self, listen, port, cfg.transfer.secret)
        self.port = self._server.port
        self._advertise = advertise
        p2p = cfg.metadata_server.strip().upper() == "P2PHANDSHAKE"
        # P2P handshake: the name is how peers reach us; with a metadata service it is
        # local_hostname as given (resolved through rpc_meta).
        self.name = f"{advertised}:{self.port}" if p2p else cfg.local_hostname
        host: TransportHost = self  # what transports see of the engine
        for tname, info in sorted(discover_transports().items(), key=lambda kv: kv[1].priority):
            try:
                self._transports[tname] = info.factory(host)
            except Exception as exc:  # a broken optional transport must not stop the engine
                logger.warning("transport %s unavailable: %s", tname, exc)
        self._control = next((t for t in self._transports.values() if t.carries_control), None)
        self._metadata = open_backend(cfg.metadata_server, cfg)
        self._publish()
        self.segments.on_change.append(self._publish)
        self._started = True
        if cfg.transfer.metrics_port >= 0:  # /metrics of this process (one per process)
            t = cfg.transfer
            self.metrics_url = serve_process(t.metrics_host, t.metrics_port).url
        logger.info(
            "transfer engine %s listening on %s port %d (transports: %s)",
            self.name,
            ",".join(listen),
            self.port,
            ", ".join(self._transports),
        )
        return self

    def _publish(self) -> None:
        if self._metadata is None:
            return
        try:
            self._metadata.publish(
                self.name,
                {
                    "ip_or_host_name": self._advertise[0],
                    "rpc_port": self.port,
                    "addresses": [[a, self.port] for a in self._advertise],
                },
                self.describe(),
            )
        except MetadataError as exc:
            logger.warning("publishing metadata for %s failed: %s", self.name, exc)

    def close(self) -> None:
        """Stop serving, drop connections and free engine-allocated memory."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for t in self._transports.values():
            t.close()
        if self._metadata is not None:
            try:
                self._metadata.unpublish(self.name)
            except MetadataError:
                pass
            self._metadata.close()
        self._batch_pool.shutdown(wait=False, cancel_futures=True)
        self.io_pool.shutdown(wait=False, cancel_futures=True)
        for buf in list(self._managed.values()):
            buf.close()
        self._managed.clear()

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """This engine's segment descriptor (what peers learn in the handshake)."""
        d: dict[str, Any] = {
            "name": self.name,
            "protocol": self.config.protocol,
            "host_id": self.host_id,
            "pid": os.getpid(),
            "addresses": [[a, self.port] for a in getattr(self, "_advertise", [])],
            "buffers": self.segments.describe(),
        }
        rdma = self._transports.get("rdma")
        if rdma is not None and getattr(rdma, "available", False):
            d["rdma"] = rdma.describe()  # type: ignore[attr-defined]
        return d

    @property
    def transports(self) -> dict[str, Transport]:
        return dict(self._transports)

    # ------------------------------------------------------------------ memory
    def register(self, buf: Any, *, name: str | None = None, location: str = "cpu:0") -> Region:
        """Register a buffer object (bytearray, numpy array, torch tensor, mmap) for remote
        access."""
        addr, length, kind = buffer_address(buf)
        return self.segments.add(
            Region(
                addr,
                length,
                name or f"buf{next(self._names)}",
                kind,
                location="cuda" if kind == "cuda" else location,
                owner=buf,
            )
        )

    def register_memory(
        self, addr: int, length: int, *, name: str | None = None, location: str = "cpu:0"
    ) -> Region:
        """Register raw memory ``[addr, addr+length)``; the caller keeps it alive."""
        if not isinstance(addr, int) or not isinstance(length, int):
            raise SegmentError(
                f"register_memory needs integer address and length, got {addr!r}, {length!r}"
            )
        return self.segments.add(
            Region(addr, length, name or f"mem{next(self._names)}", "host", location=location)
        )

    def unregister(self, buf_or_addr: Any) -> None:
        """Withdraw registered memory (by address, Region, or the registered object)."""
        if isinstance(buf_or_addr, Region):
            addr = buf_or_addr.addr
        elif isinstance(buf_or_addr, int):
            addr = buf_or_addr
        else:
            addr = buffer_address(buf_or_addr, writable=False)[0]
        self.segments.remove(addr)

    def allocate(
        self, length: int, *, name: str | None = None, prefault: bool = False
    ) -> ManagedBuffer:
        """Allocate shared, registered memory that same-host peers map directly."""
        buf = ManagedBuffer(length, prefault=prefault, directory=self.config.transfer.shm_dir)
        try:
            self.segments.add(
                Region(
                    buf.addr,
                    length,
                    name or f"shm{next(self._names)}",
                    "host",
                    owner=buf,
                    memfd=buf.fd,
                    memfd_offset=0,
                )
            )
        except SegmentError:
            buf.close()
            raise
        self._managed[buf.addr] = buf
        return buf

    def free(self, buf: ManagedBuffer | int) -> None:
        addr = buf if isinstance(buf, int) else buf.addr
        mb = self._managed.pop(addr, None)
        if mb is None:
            raise SegmentError(f"no engine-allocated buffer at 0x{addr:x}")
        self.segments.remove(addr)
        mb.close()

    # ------------------------------------------------------------------ peers
    def peer(self, name: str, *, refresh: bool = False, deadline: float | None = None) -> PeerInfo:
        """Resolve and handshake with ``name``; cached until ``refresh``."""
        if not self._started:
            self.start()
        if not refresh:
            with self._peers_lock:
                hit = self._peers.get(name)
            if hit is not None:
                return hit
        assert self._metadata is not None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"peer name must be a non-empty string, got {name!r}")
        try:
            rpc = self._metadata.resolve(name)
        except MetadataError as exc:
            raise PeerUnreachable(f"unknown peer {name!r}: {exc}") from exc
        addrs = [(str(a), int(p)) for a, p in rpc.get("addresses", [])] or [
            (str(rpc["ip_or_host_name"]), int(rpc["rpc_port"]))
        ]
        dl = (
            deadline
            if deadline is not None
            else time.monotonic() + self.config.transfer.connect_timeout_s
        )
        stub = PeerInfo(name, addrs, {})
        if refresh and self._control is not None:
            # a refresh re-reads what the peer registered; its connections stay unless it
            # now listens elsewhere (dropping them made every transfer in flight retry)
            with self._peers_lock:
                old = self._peers.get(name)
            if old is None or not set(addrs) <= set(old.addresses):
                self._control.drop_peer(name)
        status, body = self.control(stub, Op.DESC, dl)
        if status != Status.OK:
            raise PeerUnreachable(
                f"peer {name!r} refused to describe its segments (status {status})"
            )
        import json

        desc = json.loads(body)
        # the peer may listen on several interfaces: stripe over all it advertises
        advertised = [(str(a), int(p)) for a, p in desc.get("addresses", [])]
        info = PeerInfo(name, advertised if len(advertised) > 1 else addrs, desc)
        with self._peers_lock:
            self._peers[name] = info
        return info

    def is_resolved(self, name: str) -> bool:
        """True when ``name`` is resolved and cached: a transfer to it starts without a lookup."""
        with self._peers_lock:
            return name in self._peers

    def forget_peer(self, name: str) -> None:
        with self._peers_lock:
            self._peers.pop(name, None)
        if self._control is not None:
            self._control.drop_peer(name)

    def control(
        self,
        peer: PeerInfo,
        op: int,
        deadline: float,
        *,
        payload: bytes = b"",
        aux: int = 0,
        extra: memoryview | None = None,
    ) -> tuple[int, bytes]:
        """One control request to ``peer`` (see :mod:`~mooncake_core.transfer.control`)."""
        channel = self._control
        if channel is None:
            raise PeerUnreachable(
                f"engine {self.name!r} has no transport that carries control "
                "messages (is the tcp transport blocked?)"
            )
        return channel.control(peer, op, deadline, payload=payload, aux=aux, extra=extra)

    # ------------------------------------------------------------------ transfers
    def _plan(self, batch: Batch) -> list[WorkItem]:
        items: list[WorkItem] = []
        for i, req in enumerate(batch.requests):
            op = OPS.get(req.op)
            if op is None:
                raise InvalidRequest(f"request {i}: op must be 'read' or 'write', got {req.op!r}")
            if req.remote_addr is None and req.segment is None:
                raise InvalidRequest(f"request {i}: give remote_addr or segment (+offset)")
            if req.remote_addr is not None and (
                not isinstance(req.remote_addr, int) or req.remote_addr < 0
            ):
                raise InvalidRequest(
                    f"request {i}: remote_addr must be a non-negative int, got {req.remote_addr!r}"
                )
            if req.offset < 0:
                raise InvalidRequest(f"request {i}: offset must not be negative, got {req.offset}")
            if req.transport is not None and req.transport not in self._transports:
                raise InvalidRequest(
                    f"request {i}: unknown transport {req.transport!r} "
                    f"(have {', '.join(self._transports)})"
                )
            if not isinstance(req.peer, str) or not req.peer:
                raise InvalidRequest(
                    f"request {i}: peer must be a non-empty string, got {req.peer!r}"
                )
            addr, view, length, staging = local_side(self.segments, req, i)
            remote = req.remote_addr if req.remote_addr is not None else -1
            ss = int(self.config.transfer.slice_size)
            for off in range(0, length, ss):
                n = min(ss, length - off)
                # merge a small tail into the previous slice
                if off and length - off < ss // 4 and items and items[-1].req == i:
                    items[-1].length += n
                    items[-1].local_view = view[
                        items[-1].local_addr - addr : items[-1].local_addr - addr + items[-1].length
                    ]
                    break
                items.append(
                    WorkItem(
                        i,
                        op,
                        addr + off,
                        view[off : off + n],
                        remote + off if remote >= 0 else off,
                        n,
                        extra={"staging": staging, "seg": req.segment is not None},
                    )
                )
        return items

    def submit(
        self, requests: Sequence[TransferRequest] | TransferRequest, *, timeout: float | None = None
    ) -> Batch:
        """Start a batch and return at once; bad input raises here, transfer failures in
        ``wait()``."""
        reqs = [requests] if isinstance(requests, TransferRequest) else list(requests)
        if not reqs:
            raise InvalidRequest("empty batch: give at least one request")
        batch = Batch(reqs)
        items = self._plan(batch)
        self._batch_pool.submit(self._run_batch, batch, items, timeout)
        return batch

    def transfer(
        self, requests: Sequence[TransferRequest] | TransferRequest, *, timeout: float | None = None
    ) -> Batch:
        """Run a batch to completion in the calling thread; raise on any failure."""
        reqs = [requests] if isinstance(requests, TransferRequest) else list(requests)
        if not reqs:
            raise InvalidRequest("empty batch: give at least one request")
        if len(reqs) == 1:
            moved = self._transfer_one(reqs[0], timeout)
            if moved:
                batch: Batch = DoneBatch(reqs)
                batch.statuses[0].state = "completed"
                batch.statuses[0].transferred = moved
                return batch
        batch = DoneBatch(reqs)
        items = self._plan(batch)
        self._run_batch(batch, items, timeout)
        batch.wait()
        return batch

    def _transfer_one(self, req: TransferRequest, timeout: float | None) -> int:
        """The common small case without the batch machinery: one host-memory request that fits one
        slice, to a peer already resolved, at an absolute address inside its registered memory.

        Returns the bytes moved, or 0 (nothing done) when the request is not of that shape;
        the general path then handles it, with the same validation and error messages.
        Failures raise as there.
        """
        op = OPS.get(req.op)
        local = req.local
        remote = req.remote_addr
        if (
            op is None
            or req.segment is not None
            or type(remote) is not int
            or remote < 0
            or req.offset
            or (req.transport is not None and req.transport not in self._transports)
        ):
            return 0
        peer = self._peers.get(req.peer)  # one dict read (atomic): no lock on the hot path
        if peer is None:
            return 0
        slice_size = self._slice_size
        if type(local) is int:  # an address inside our registered host memory
            length = req.length or 0
            if not 0 < length <= slice_size:
                return 0
            try:
                region = self.segments.find(local, length)
            except InvalidRequest:
                return 0
            if region.kind != "host":
                return 0
            addr, view = local, region.view(local, length)
        elif type(local) is memoryview or type(local) is bytearray:
            mv = local if type(local) is memoryview else memoryview(local)
            if (
                mv.format != "B"
                or mv.ndim != 1
                or not mv.contiguous
                or (op == READ and mv.readonly)
            ):
                return 0
            length = mv.nbytes if req.length is None else req.length
            if not 0 < length <= min(mv.nbytes, slice_size):
                return 0
            addr = view_address(mv)
            view = mv[:length] if length != mv.nbytes else mv
        else:
            return 0
        if peer.find_region(remote, length) is None:
            return 0
        chain = self._choose(peer, req.transport)
        if not chain:
            return 0
        it = WorkItem(0, op, addr, view, remote, length)
        deadline = time.monotonic() + (timeout if timeout is not None else self._timeout_s)
        self._execute_chain(req.peer, peer, chain, [it], deadline)
        if it.done:
            return length
        batch = DoneBatch([req])
        cause = it.error
        if cause is None:
            cause = TransportError(f"request 0 to {req.peer!r} did not complete")
            batch._named = (cause,)
        batch.statuses[0].error = cause
        batch.statuses[0].state = "timeout" if isinstance(cause, TransferTimeout) else "failed"
        exc = batch._failure()
        assert exc is not None
        raise exc

    def write(
        self,
        peer: str,
        local: Any,
        remote_addr: int | None = None,
        length: int | None = None,
        **kw: Any,
    ) -> None:
        """Synchronous write of ``local`` to ``remote_addr`` on ``peer``."""
        self.transfer(TransferRequest("write", peer, local, length, remote_addr, **kw))

    def read(
        self,
        peer: str,
        local: Any,
        remote_addr: int | None = None,
        length: int | None = None,
        **kw: Any,
    ) -> None:
        """Synchronous read from ``remote_addr`` on ``peer`` into ``local``."""
        self.transfer(TransferRequest("read", peer, local, length, remote_addr, **kw))

    def _choose(self, peer: PeerInfo, hint: str | None) -> list[Transport]:
        if hint is not None:
            chain = [self._transports[hint]]
            if hint != "tcp":
                chain.append(self._transports["tcp"])
        else:
            chain = list(self._transports.values())
            proto = self.config.protocol.lower()
            if proto == "tcp":
                chain = [t for t in chain if t.name != "rdma"]
        return [t for t in chain if t.can_reach(peer)]

    def _run_batch(self, batch: Batch, items: list[WorkItem], timeout: float | None) -> None:
        deadline = time.monotonic() + (
            timeout if timeout is not None else self.config.transfer.timeout_s
        )
        try:
            by_peer: dict[tuple[str, str | None], list[WorkItem]] = {}
            for it in items:
                req = batch.requests[it.req]
                by_peer.setdefault((req.peer, req.transport), []).append(it)
            groups = list(by_peer.items())
            if len(groups) == 1:
                self._run_peer(batch, groups[0][0], groups[0][1], deadline)
            else:
                futs = [
                    self._batch_pool.submit(self._run_peer, batch, k, v, deadline)
                    for k, v in groups[1:]
                ]
                self._run_peer(batch, groups[0][0], groups[0][1], deadline)
                for f in futs:
                    f.result()
            for it in items:
                st = batch.statuses[it.req]
                if it.done:
                    st.transferred += it.length
                elif st.error is None:
                    st.error = it.error
                    if st.error is None:
                        peer = batch.requests[it.req].peer
                        st.error = TransportError(f"request {it.req} to {peer!r} did not complete")
                    if st.error is not it.error or it.extra.get("names_request"):
                        batch._named += (st.error,)
            wanted = [0] * len(batch.statuses)
            for it in items:
                wanted[it.req] += it.length
            for i, st in enumerate(batch.statuses):
                if st.error is None and st.transferred >= wanted[i]:
                    st.state = "completed"
                else:
                    st.state = "timeout" if isinstance(st.error, TransferTimeout) else "failed"
            for it in items:
                if (
                    it.done
                    and it.op == READ
                    and it.extra.get("staging") is not None
                    and isinstance(it.extra["staging"], tuple)
                ):
                    region, dev, host_base, _ = it.extra["staging"]
                    region.copy_in(dev + (it.local_addr - host_base), it.local_view)
        except BaseException as exc:  # never leave a future pending
            for st in batch.statuses:
                if st.state == "pending":
                    st.state, st.error = "failed", st.error or exc
        batch._finish()

    def _run_peer(
        self, batch: Batch, key: tuple[str, str | None], items: list[WorkItem], deadline: float
    ) -> None:
        name, hint = key
        try:
            peer = self.peer(name, deadline=deadline)
        except TransportError as exc:
            for it in items:
                it.error = exc
            return
        # Resolve segment-relative addresses and check bounds against the descriptor
        # (refresh the descriptor once: the peer may have registered memory since).
        for attempt in range(2):
            bad = []
            for it in items:
                req = batch.requests[it.req]
                if it.extra.get("seg"):
                    region = peer.region_named(str(req.segment))
                    if region is None:
                        bad.append(it)
                        continue
                    if "base" not in it.extra:
                        it.extra["base"] = it.remote_addr
                    it.remote_addr = int(region["addr"]) + req.offset + int(it.extra["base"])
                if peer.find_region(it.remote_addr, it.length) is None:
                    bad.append(it)
            if not bad:
                break
            if attempt == 0:
                peer = self.peer(name, refresh=True, deadline=deadline)
                continue
            for it in bad:
                req = batch.requests[it.req]
                where = (
                    f"segment {req.segment!r}"
                    if req.segment is not None
                    else f"0x{it.remote_addr:x}+{it.length}"
                )
                it.error = InvalidRequest(
                    f"request {it.req}: {where} is not inside memory registered by peer {name!r}"
                )
                it.extra["names_request"] = True
        if self.config.transfer.secret and not peer.desc:
            raise PeerUnreachable(f"peer {name!r} gave no descriptor")
        # staging: device memory to host before writes
        for it in items:
            st = it.extra.get("staging")
            if it.op == WRITE and isinstance(st, tuple) and it.error is None:
                region, dev, host_base, _ = st
                it.local_view[:] = region.copy_out(dev + (it.local_addr - host_base), it.length)
        chain = self._choose(peer, hint)
        if not chain:
            for it in items:
                it.error = it.error or PeerUnreachable(f"no transport reaches peer {name!r}")
            return
        self._execute_chain(name, peer, chain, items, deadline)

    def _execute_chain(
        self,
        name: str,
        peer: PeerInfo,
        chain: list[Transport],
        items: list[WorkItem],
        deadline: float,
    ) -> None:
        """Run ``items`` on the first transport of ``chain``, failing over to the next ones."""
        last: BaseException | None = None
        for t in chain:
            todo = [it for it in items if not it.done and it.error is None]
            if not todo:
                break
            path = TRANSFER.path(name, t.name)
            if last is not None:
                self.stats["failovers"] += 1
                path.failover()
                logger.info(
                    "failing over %d slice(s) to %s via %s: %s", len(todo), name, t.name, last
                )
            t0 = time.perf_counter()
            try:
                t.execute(peer, todo, deadline)
                last = None
            except TransferTimeout as exc:
                last = exc
                break
            except TransportError as exc:
                last = exc
                if isinstance(exc, PeerUnreachable) and t.carries_control:
                    self.forget_peer(name)
                continue
            finally:
                path.record(todo, time.perf_counter() - t0)
        for it in items:
            if not it.done and it.error is None:
                it.error = last or TransportError(f"transfer to {name!r} failed")
            elif it.done:
                key2 = "bytes_read" if it.op == READ else "bytes_written"
                self.stats[key2] += it.length

    # ------------------------------------------------------------------ tensors and notifications
    def put_tensor_async(self, tensor: Any, peer: str, key: str) -> Future[None]:
        """Send a tensor (torch or numpy) to ``peer``'s inbox under ``key``; returns a future."""
        if not isinstance(key, str) or not key:
            raise InvalidRequest("tensor key must be a non-empty string")
        meta, data = encode_tensor(tensor, key)
        fut: Future[None] = Future()

        def run() -> None:
            try:
                dl = time.monotonic() + self.config.transfer.timeout_s
                p = self.peer(peer, deadline=dl)
                status, body = self.control(
                    p, Op.TENSOR, dl, payload=meta, aux=len(meta), extra=data
                )
                if status != Status.OK:
                    raise InvalidRequest(
                        f"peer {peer!r} refused tensor {key!r}: "
                        f"{body.decode(errors='replace') or status}"
                    )
                fut.set_result(None)
            except BaseException as exc:
                fut.set_exception(exc)

        self._batch_pool.submit(run)
        return fut

    def put_tensor(self, tensor: Any, peer: str, key: str) -> None:
        self.put_tensor_async(tensor, peer, key).result()

    def get_tensor(self, key: str, timeout: float | None = None) -> Any:
        """Wait for the tensor a peer sent under ``key`` and return it (same kind as sent)."""
        wait = self.config.transfer.timeout_s if timeout is None else timeout
        return self.inbox.tensors.take(key, wait)

    def notify(self, peer: str, name: str, msg: str) -> None:
        """Deliver a (name, msg) notification to ``peer`` (see :meth:`get_notifies`)."""
        import json

        dl = time.monotonic() + self.config.transfer.timeout_s
        p = self.peer(peer, deadline=dl)
        body = json.dumps({"name": name, "msg": msg}).encode()
        status, _ = self.control(p, Op.NOTIFY, dl, payload=body)
        if status != Status.OK:
            raise InvalidRequest(f"peer {peer!r} refused the notification (status {status})")

    def ping(self, peer: str, timeout: float = 2.0) -> bool:
        """True if ``peer`` answers."""
        try:
            p = self.peer(peer, deadline=time.monotonic() + timeout)
            return self.control(p, Op.PING, time.monotonic() + timeout)[0] == Status.OK
        except (TransportError, OSError):
            self.forget_peer(peer)
            return False

    def get_notifies(self) -> list[tuple[str, str]]:
        """Every notification peers sent since the last call, oldest first."""
        return self.inbox.take_notifies()

    def accept_rdma(self, info: dict[str, Any]) -> dict[str, Any]:
        """Server side of the queue-pair exchange (called by the listener)."""
        rdma = self._transports.get("rdma")
        if rdma is None or not getattr(rdma, "available", False):
            raise TransportError(f"RDMA is not available on engine {self.name!r} (no RDMA device)")
        answer: dict[str, Any] = rdma.accept(info)  # type: ignore[attr-defined]
        return answer
