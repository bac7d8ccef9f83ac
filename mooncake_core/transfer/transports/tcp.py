"""TCP transport: several authenticated connections per peer, sliced and pipelined.

Requests are cut into slices (``transfer.slice_size``) that are spread over the peer's
connections (``transfer.connections_per_peer``); each connection pipelines its slices
(up to a window of outstanding requests) and moves payload with ``sendmsg`` /
``recv_into`` on memoryviews of the registered memory: no intermediate bytes objects on
either end. A slice whose connection breaks is retried on a fresh connection, with
bounded retries and backoff; a write counts as done only when the peer acknowledged it.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from mooncake_core.errors import (
    AuthError,
    InvalidRequest,
    PeerUnreachable,
    TransferTimeout,
    TransportError,
)
from mooncake_core.metrics.transfer import TRANSFER
from mooncake_core.plugins import TransportInfo, hookimpl
from mooncake_core.transfer.net import recv_exact, recv_views, send_parts, tune_socket
from mooncake_core.transfer.protocol import (
    GREETING,
    MAGIC,
    MAX_READV_BYTES,
    MAX_READV_RANGES,
    RANGE,
    REQ,
    RESP,
    STATUS_TEXT,
    Op,
    Status,
    auth_digest,
)
from mooncake_core.transfer.transports.base import Transport
from mooncake_core.transfer.types import READ, PeerInfo, TransportHost, WorkItem

__all__ = ["TCPTransport", "TCPConnection"]

logger = logging.getLogger(__name__)

WINDOW = 32  # outstanding requests per connection
# Spin for the answer only to slices up to this size: a larger one is never answered within the
# spin, and polling on a small host takes the core the peer (and the store master) need then.
SPIN_MAX_BYTES = 256 << 10
READV_MIN_VERSION = 2  # peers from this protocol version on serve READV


class TCPConnection:
    """One authenticated connection to a peer's listener. Not thread-safe: hold ``lock``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: str,
        timeout: float,
        peer: str,
        source: str | None = None,
    ) -> None:
        self.peer = peer
        self.lock = threading.Lock()
        self.broken = False
        self.peer_version = 0
        #: reads up to this many bytes together go out as one READV (set by the transport)
        self.readv_bytes = 0
        self._req_id = 0
        self.spin_s = (
            0.0  # wait for an answer this long with poll(0) before sleeping (set by the transport)
        )
        self._poller: select.poll | None = None
        self._head = memoryview(bytearray(RESP.size))  # the answer header of run()'s requests
        #: the socket timeout last set through :meth:`set_timeout` (each settimeout is a syscall)
        self.timeout_s = -1.0
        try:
            self.sock = socket.create_connection(
                (host, port), timeout=timeout, source_address=(source, 0) if source else None
            )
        except OSError as exc:
            raise PeerUnreachable(
                f"cannot connect to peer {peer!r} at {host}:{port}: {exc.strerror or exc}"
            ) from exc
        try:
            tune_socket(self.sock)
            self.sock.settimeout(timeout)
            g = memoryview(bytearray(GREETING.size))
            if not recv_exact(self.sock, g):
                raise PeerUnreachable(
                    f"peer {peer!r} at {host}:{port} closed the connection during the handshake"
                )
            magic, self.peer_version, _flags, nonce = GREETING.unpack(g)
            if magic != MAGIC:
                raise PeerUnreachable(
                    f"{host}:{port} is not a mooncake-core transfer engine (bad greeting)"
                )
            body = auth_digest(secret, nonce) + json.dumps({"v": 1}).encode()
            status, _ = self.request(Op.HELLO, payload=body)
            if status == Status.AUTH_FAILED:
                raise AuthError(
                    f"peer {peer!r} rejected our shared secret "
                    "(check transfer.secret on both sides)"
                )
            if status != Status.OK:
                raise PeerUnreachable(
                    f"peer {peer!r} refused the handshake: {STATUS_TEXT.get(status, status)}"
                )
        except TimeoutError as exc:
            self.close()
            raise PeerUnreachable(
                f"peer {peer!r} at {host}:{port} did not answer the handshake within {timeout:.1f}s"
            ) from exc
        except (OSError, ConnectionError) as exc:
            self.close()
            if isinstance(exc, TransportError):
                raise
            raise PeerUnreachable(
                f"handshake with peer {peer!r} at {host}:{port} failed: {exc}"
            ) from exc
        except TransportError:
            self.close()
            raise

    def set_timeout(self, remaining: float, cap: float) -> None:
        """Bound each socket call by ``min(remaining, cap)`` seconds; kept as it is when it
        already lies within 10 ms above that (per call, the deadline is what it bounds)."""
        want = remaining if remaining < cap else cap
        if not 0.0 <= self.timeout_s - want < 0.01:
            self.sock.settimeout(want)
            self.timeout_s = want

    def _next_id(self) -> int:
        self._req_id = (self._req_id + 1) & 0xFFFFFFFF
        return self._req_id

    def close(self) -> None:
        """Close it: by the thread that holds ``lock``, or through :meth:`retire`."""
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    def retire(self) -> None:
        """Close it from a thread that does not hold ``lock`` (dropping a peer's pool).

        It is shut down first, so a transfer waiting on it sees end-of-stream at once and
        retries on a new connection; it is closed once that transfer lets go. Closing it
        under a waiting thread would not wake that thread (Linux), and the descriptor number,
        reused by the next connection, would leave it waiting out its whole timeout.
        """
        self.broken = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self.lock:
            self.close()

    def break_now(self) -> None:
        """Fault injection: break the connection as a network failure would."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _spin(self) -> None:
        """Poll (without sleeping) for up to ``spin_s`` until the peer's answer is readable.

        A small transfer is answered within tens of microseconds; sleeping in ``recv`` for it
        costs a scheduler wake-up, which on a virtual machine is about as long again.
        """
        p = self._poller
        if p is None:
            p = self._poller = select.poll()
            p.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        end = time.perf_counter() + self.spin_s
        while not p.poll(0) and time.perf_counter() < end:
            pass

    def _read_resp(self) -> tuple[int, int, int]:
        head = memoryview(bytearray(RESP.size))
        if not recv_exact(self.sock, head):
            raise ConnectionError("peer closed the connection")
        magic, status, req_id, _pad, length = RESP.unpack(head)
        if magic != MAGIC:
            raise ConnectionError("bad response magic")
        return status, req_id, length

    def request(
        self, op: int, *, payload: bytes = b"", aux: int = 0, extra: memoryview | None = None
    ) -> tuple[int, bytes]:
        """One control request (HELLO, DESC, PING, NOTIFY, TENSOR): returns (status, reply body)."""
        n = len(payload) + (len(extra) if extra is not None else 0)
        parts: list[memoryview | bytes] = [
            REQ.pack(MAGIC, op, 0, 0, self._next_id(), aux, 0, n),
            payload,
        ]
        if extra is not None:
            parts.append(extra)
        send_parts(self.sock, parts)
        status, _rid, length = self._read_resp()
        body = memoryview(bytearray(length))
        if length and not recv_exact(self.sock, body):
            raise ConnectionError("peer closed the connection")
        return status, bytes(body)

    def _units(self, items: list[WorkItem]) -> list[list[WorkItem]]:
        """``items`` as requests: runs of consecutive reads that fit ``readv_bytes`` together
        become one READV (when the peer serves it); everything else goes alone."""
        limit = self.readv_bytes if self.peer_version >= READV_MIN_VERSION else 0
        units: list[list[WorkItem]] = []
        run: list[WorkItem] = []
        size = 0
        for it in items:
            if it.op == READ and it.length < limit:
                if run and (size + it.length > limit or len(run) >= MAX_READV_RANGES):
                    units.append(run)
                    run, size = [], 0
                run.append(it)
                size += it.length
                continue
            if run:
                units.append(run)
                run, size = [], 0
            units.append([it])
        if run:
            units.append(run)
        return units

    def run(self, items: list[WorkItem], on_send: Callable[[], None] | None = None) -> None:
        """Pipeline ``items`` on this connection; marks each done or sets its error.

        Small reads go out together as READV requests (see :meth:`_units`). Raises
        ConnectionError/OSError when the connection fails; items not marked done must then
        be retried elsewhere.
        """
        sock = self.sock
        units = [items] if len(items) == 1 else self._units(items)
        sent = 0
        recvd = 0
        n = len(units)
        head = self._head
        while recvd < n:
            while sent < n and sent - recvd < WINDOW:
                unit = units[sent]
                it = unit[0]
                if on_send is not None:
                    on_send()
                if len(unit) > 1:
                    desc = b"".join(RANGE.pack(u.remote_addr, u.length) for u in unit)
                    head_b = REQ.pack(MAGIC, Op.READV, 0, 0, sent, len(unit), 0, len(desc))
                    sock.sendall(head_b + desc)
                elif it.op == READ:
                    sock.sendall(REQ.pack(MAGIC, Op.READ, 0, 0, sent, 0, it.remote_addr, it.length))
                else:
                    send_parts(
                        sock,
                        [
                            REQ.pack(MAGIC, Op.WRITE, 0, 0, sent, 0, it.remote_addr, it.length),
                            it.local_view,
                        ],
                    )
                sent += 1
            unit = units[recvd]
            it = unit[0]
            # bytes this request moves (a READV: all ranges)
            want = it.length if len(unit) == 1 else sum(u.length for u in unit)
            if self.spin_s and want <= SPIN_MAX_BYTES:
                self._spin()
            if not recv_exact(sock, head):
                raise ConnectionError("peer closed the connection")
            magic, status, _rid, pad, length = RESP.unpack(head)
            if magic != MAGIC:
                raise ConnectionError("bad response magic")
            if status == Status.OK:
                if it.op == READ:
                    if length != want:
                        raise ConnectionError(
                            f"peer answered {length} bytes for a {want}-byte read"
                        )
                    if len(unit) > 1:
                        recv_views(sock, [u.local_view for u in unit])
                    elif not recv_exact(sock, it.local_view):
                        raise ConnectionError("peer closed the connection mid-payload")
                for u in unit:
                    u.done = True
            else:
                detail = memoryview(bytearray(length))
                if length:
                    recv_exact(sock, detail)
                msg = bytes(detail).decode(errors="replace") or STATUS_TEXT.get(status, str(status))
                if len(unit) > 1:  # a READV: only the range the peer names failed
                    if status != Status.OUT_OF_BOUNDS or pad >= len(unit):
                        raise ConnectionError(f"peer {self.peer!r} refused a READV: {msg}")
                    it = unit[pad]  # the others stay pending: the transport retries them
                it.error = InvalidRequest(
                    f"peer {self.peer!r} refused {'read' if it.op == READ else 'write'} "
                    f"of {it.length} bytes at 0x{it.remote_addr:x}: {msg}"
                )
                if it.op != READ:  # the peer closes after a refused write
                    raise ConnectionError("peer closed the connection after refusing a write")
            recvd += 1


class _PeerPool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[TCPConnection | None] = []


class TCPTransport(Transport):
    """The default transport across hosts, and the engine's control channel."""

    name = "tcp"
    carries_control = True

    def __init__(self, engine: TransportHost) -> None:
        super().__init__(engine)
        cfg = engine.config.transfer
        self.nconn = cfg.connections_per_peer
        self.slice_size = int(cfg.slice_size)
        self.retry_count = cfg.retry_count
        self.backoff = cfg.retry_backoff_s
        self.timeout_s = float(cfg.timeout_s)
        self._pools: dict[str, _PeerPool] = {}
        self._lock = threading.Lock()
        # Fault injection for tests: called before each slice is sent with the connection;
        # returning True breaks that connection (the slice then fails and is retried).
        self.fault_hook: Callable[[TCPConnection], bool] | None = None
        self.retried_slices = 0

    def can_reach(self, peer: PeerInfo) -> bool:
        return bool(peer.addresses)

    # ------------------------------------------------------------------ connections
    def _pool(self, peer: str) -> _PeerPool:
        with self._lock:
            pool = self._pools.get(peer)
            if pool is None:
                pool = self._pools[peer] = _PeerPool()
            return pool

    def connection(self, peer: PeerInfo, index: int, deadline: float) -> TCPConnection:
        pool = self._pools.get(peer.name)  # the usual case without locks: a live connection
        if pool is not None:
            conns = pool.conns
            if index < len(conns):
                conn = conns[index]
                if conn is not None and not conn.broken:
                    return conn
        pool = self._pool(peer.name)
        with pool.lock:
            while len(pool.conns) <= index:
                pool.conns.append(None)
            conn = pool.conns[index]
            if conn is not None and not conn.broken:
                return conn
            host, port = peer.addresses[index % len(peer.addresses)]
            sources = self.engine.source_addresses
            source = sources[index % len(sources)] if sources else None
            timeout = max(
                0.05,
                min(self.engine.config.transfer.connect_timeout_s, deadline - time.monotonic()),
            )
            conn = TCPConnection(
                host,
                port,
                secret=self.engine.config.transfer.secret,
                timeout=timeout,
                peer=peer.name,
                source=source,
            )
            conn.set_timeout(self.timeout_s, self.timeout_s)
            conn.spin_s = max(0.0, self.engine.config.transfer.spin_us) * 1e-6
            conn.readv_bytes = min(self.slice_size, MAX_READV_BYTES)
            pool.conns[index] = conn
            return conn

    def drop_peer(self, peer: str) -> None:
        with self._lock:
            pool = self._pools.pop(peer, None)
        if pool is not None:
            for c in pool.conns:
                if c is not None:
                    c.retire()

    def close(self) -> None:
        with self._lock:
            names = list(self._pools)
        for n in names:
            self.drop_peer(n)

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
        """A control request on the peer's first connection (with one reconnect)."""
        last: BaseException | None = None
        for _ in range(2):
            conn = self.connection(peer, 0, deadline)
            with conn.lock:
                try:
                    return conn.request(op, payload=payload, aux=aux, extra=extra)
                except (OSError, ConnectionError) as exc:
                    conn.close()
                    last = exc
        raise PeerUnreachable(f"peer {peer.name!r}: control request failed: {last}") from last

    # ------------------------------------------------------------------ data path
    def _run_on(
        self, peer: PeerInfo, index: int, items: list[WorkItem], deadline: float
    ) -> BaseException | None:
        try:
            conn = self.connection(peer, index, deadline)
        except TransportError as exc:
            return exc
        with conn.lock:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TransferTimeout(f"timed out before sending to peer {peer.name!r}")
            hook = self.fault_hook
            on_send: Callable[[], None] | None = None
            if hook is not None:

                def fault() -> None:
                    if hook(conn):
                        conn.break_now()

                on_send = fault

            try:
                # inside the try: another thread may have closed this connection since we took it
                # (a transfer that found the peer dead drops all its connections)
                conn.set_timeout(remaining, self.timeout_s)
                conn.run(items, on_send)
                return None
            except TimeoutError as exc:
                conn.close()
                return TransferTimeout(
                    f"peer {peer.name!r} did not answer within the timeout"
                ).with_traceback(exc.__traceback__)
            except (OSError, ConnectionError) as exc:
                conn.close()
                return exc

    def execute(self, peer: PeerInfo, items: list[WorkItem], deadline: float) -> None:
        pending = [it for it in items if not it.done and it.error is None]
        attempt = 0
        offset = 0
        while pending:
            groups: list[list[WorkItem]]
            if len(pending) == 1:
                groups = [pending]
            else:
                groups = [[] for _ in range(min(self.nconn, len(pending)))]
                for i, it in enumerate(pending):
                    groups[i % len(groups)].append(it)
            errors: list[BaseException | None]
            if len(groups) == 1:
                errors = [self._run_on(peer, offset % self.nconn, groups[0], deadline)]
            else:
                futs = [
                    self.engine.io_pool.submit(
                        self._run_on, peer, (offset + g) % self.nconn, grp, deadline
                    )
                    for g, grp in enumerate(groups[1:], start=1)
                ]
                first = self._run_on(peer, offset % self.nconn, groups[0], deadline)
                errors = [first] + [f.result() for f in futs]
            pending = [it for it in pending if not it.done and it.error is None]
            if not pending:
                return
            err = next((e for e in errors if e is not None), None)
            if isinstance(err, AuthError):
                raise err
            if isinstance(err, TransferTimeout) or time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"transfer to peer {peer.name!r} timed out "
                    f"with {len(pending)} slice(s) outstanding"
                ) from err
            attempt += 1
            if attempt > self.retry_count:
                if isinstance(err, PeerUnreachable):
                    raise err
                raise PeerUnreachable(
                    f"peer {peer.name!r}: {len(pending)} slice(s) failed after {self.retry_count} "
                    f"retries: {err}"
                ) from err
            self.retried_slices += len(pending)
            TRANSFER.path(peer.name, "tcp").retry(len(pending))
            logger.debug(
                "retrying %d slice(s) to %s (attempt %d): %s", len(pending), peer.name, attempt, err
            )
            offset += 1  # move to other connections
            time.sleep(
                min(self.backoff * (2 ** (attempt - 1)), max(0.0, deadline - time.monotonic()))
            )


@hookimpl
def mooncake_transports() -> list[TransportInfo]:
    return [
        TransportInfo(
            "tcp",
            TCPTransport,
            priority=30,
            description=(
                "TCP: sliced over several connections per peer, sendmsg/recv_into zero-copy"
            ),
        )
    ]
