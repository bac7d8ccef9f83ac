"""Client side of the master RPC: a pool of blocking connections that follows the leader.

Contract: :meth:`MasterRPC.call` is thread-safe (each call borrows a connection), sends
one request and waits for its answer. Connection failures and ``NOT_LEADER`` answers
make it re-resolve the master (``etcd://`` addresses read the leader key) and retry
until ``failover_timeout_s``; then it raises :class:`MasterUnavailable`. Error answers
raise the matching :mod:`mooncake_core.errors` class.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from mooncake_core.errors import ConfigError, MasterUnavailable, MetadataError
from mooncake_core.store import protocol as P
from mooncake_core.store.tenants import namespaced

__all__ = ["MasterRPC"]

logger = logging.getLogger(__name__)


class _Sock:
    """One connection to the master: non-blocking fd, a short spin before sleeping in poll().

    Spinning for the answer (``spin_s``, default 100 us) avoids a scheduler wake-up per
    RPC; on virtual machines that wake-up alone costs tens of microseconds.
    """

    __slots__ = ("sock", "addr", "buf", "next_id", "poller", "spin_s", "ns", "__weakref__")

    def __init__(self, addr: str, timeout: float, spin_s: float = 100e-6) -> None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"master_server_address: {addr!r} is not host:port or etcd://host:port"
            )
        self.addr = addr
        self.ns = ""  # the client's tenant: keys are named in its namespace on the wire
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.poller = select.poll()
        self.poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        self.buf = bytearray(65536)
        self.next_id = 0
        self.spin_s = spin_s

    def _wait(self, deadline: float | None, events: int = select.POLLIN) -> None:
        timeout_ms = (
            None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        )
        if deadline is not None and deadline <= time.monotonic():
            raise TimeoutError("master did not answer within the timeout")
        if events != select.POLLIN:
            p = select.poll()
            p.register(self.sock.fileno(), events)
            p.poll(timeout_ms)
        else:
            self.poller.poll(timeout_ms)

    def _send(self, data: bytes, deadline: float | None) -> None:
        view = memoryview(data)
        while view:
            try:
                k = self.sock.send(view)
            except BlockingIOError:
                self._wait(deadline, select.POLLOUT)
                continue
            view = view[k:]

    def _recv(self, view: memoryview, deadline: float | None, spin_until: float) -> int:
        while True:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:
                if time.perf_counter() < spin_until:
                    continue
                self._wait(deadline)
                continue
            if not k:
                raise ConnectionError("master closed the connection")
            return k

    def send_request(self, method: str, params: Any, deadline: float | None) -> int:
        """Send one request; returns its id (read the answer with :meth:`read_response`)."""
        self.next_id += 1
        if self.ns:
            params = namespaced(method, params, self.ns)
        self._send(P.encode_request(self.next_id, method, params), deadline)
        return self.next_id

    def read_response(self, rid: int, deadline: float | None) -> P.Response:
        spin_until = time.perf_counter() + self.spin_s
        # one recv usually brings the whole (small) answer; large ones continue below
        buf = self.buf
        mv = memoryview(buf)
        got = self._recv(mv, deadline, spin_until)
        while got < 4:
            got += self._recv(mv[got:], deadline, spin_until)
        (n,) = P.HEADER.unpack_from(buf)
        if n > P.MAX_FRAME:
            raise ConnectionError(f"master sent a {n}-byte frame")
        if got > 4 + n:
            raise ConnectionError("master sent more than one answer")
        if got == 4 + n:
            # Raw results must not alias the reused buffer: one copy of the frame
            resp = P.decode_response(bytes(mv[4:got]))
        else:
            body = bytearray(n)
            view = memoryview(body)
            view[: got - 4] = mv[4:got]
            got -= 4
            while got < n:
                got += self._recv(view[got:], deadline, 0.0)
            resp = P.decode_response(body)
        if resp.id != rid:
            raise ConnectionError(f"answer id {resp.id} does not match request {rid}")
        return resp

    def roundtrip(self, method: str, params: Any, timeout: float | None) -> P.Response:
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.read_response(self.send_request(method, params, deadline), deadline)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Pending:
    """A request sent by :meth:`MasterRPC.start` whose answer :meth:`MasterRPC.finish` reads."""

    __slots__ = ("sock", "rid", "method", "params", "sent", "deadline")

    def __init__(
        self, sock: _Sock, rid: int, method: str, params: Any, sent: float, deadline: float
    ) -> None:
        self.sock, self.rid, self.method, self.params = sock, rid, method, params
        self.sent = sent  # time.monotonic() just before the request went out
        self.deadline = deadline


_RETRY = object()  # a standby answered: find the leader and call again


class MasterRPC:
    """Calls to the (leader) master.

    Args:
        address: ``host:port`` or ``etcd://host:port[,host:port]`` (HA: follow the leader).
        cluster_id: the HA cluster namespace in etcd.
        timeout_s: per-call socket timeout.
        failover_timeout_s: how long to keep retrying while no leader answers.
    """

    def __init__(
        self,
        address: str,
        *,
        cluster_id: str = "default",
        timeout_s: float = 30.0,
        failover_timeout_s: float = 15.0,
        spin_us: float = 100.0,
    ) -> None:
        self.address = address
        self.cluster_id = cluster_id
        self.timeout_s = timeout_s
        self.failover_timeout_s = failover_timeout_s
        self.spin_s = max(0.0, spin_us) * 1e-6
        self._lock = threading.Lock()
        self._idle: list[_Sock] = []
        self._target = "" if address.startswith("etcd://") else address
        self._etcd: Any = None
        self._closed = False
        self._open: weakref.WeakSet[_Sock] = (
            weakref.WeakSet()
        )  # every connection, idle or in use (for close)
        self.failovers = 0
        # called before each request while set (the store client starts itself on first use)
        self.before_use: Callable[[], None] | None = None
        self.tenant = ""  # set by a client with a tenant (mooncake_core.store.tenants)

    # ------------------------------------------------------------------ leader resolution
    def _resolve(self) -> str:
        if not self.address.startswith("etcd://"):
            return self.address
        if self._etcd is None:
            from mooncake_core.store.ha import StoreEtcd

            self._etcd = StoreEtcd(self.address, self.cluster_id, timeout=3.0)
        info = self._etcd.leader()
        if info is None:
            raise MasterUnavailable(
                f"no store master is leader in etcd {self.address} (cluster {self.cluster_id!r})"
            )
        return str(info.rpc)

    def _drop_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def _acquire(self) -> _Sock:
        with self._lock:
            while self._idle:
                s = self._idle.pop()
                if s.addr == self._target:
                    return s
                s.close()
            target = self._target
        if not target:
            target = self._resolve()
            with self._lock:
                self._target = target
        try:
            s = _Sock(target, min(self.timeout_s, 5.0), self.spin_s)
        except OSError as exc:
            raise ConnectionError(
                f"cannot connect to master {target}: {exc.strerror or exc}"
            ) from exc
        s.ns = self.tenant
        with self._lock:
            self._open.add(s)
            closed = self._closed
        if closed:  # close() ran while we connected: it could not see this socket
            s.close()
            raise MasterUnavailable("the store client is closed")
        return s

    def _release(self, s: _Sock) -> None:
        with self._lock:
            if not self._closed and s.addr == self._target and len(self._idle) < 64:
                self._idle.append(s)
                return
        s.close()

    def generation(self) -> int:
        """A number that changes whenever a master connection failed or a standby answered.

        Idle connections are checked first (without waiting): the master never speaks
        unasked, so an idle connection that is readable was closed by a master that died.
        Clients compare it with the value they saw when the master granted them something
        (a reservation) before relying on that grant without asking again.
        """
        # Under the lock: an idle connection is then used by no other thread, so it is not
        # readable because of an answer to someone's request (nor polled twice at once).
        with self._lock:
            dead = any(s.poller.poll(0) for s in self._idle)
            if dead:
                self.failovers += 1
        if dead:
            self._drop_all()
        return self.failovers

    # ------------------------------------------------------------------ calls
    def call(
        self,
        method: str,
        params: Any,
        *,
        timeout: float | None = None,
        typ: Any = Any,
        failover_s: float | None = None,
    ) -> Any:
        """Send one request and return its decoded result (raises on error answers).

        ``failover_s`` bounds how long to keep trying while no master answers (default: the
        client's ``failover_timeout_s``).
        """
        hook = self.before_use
        if hook is not None:
            hook()
        wait = self.failover_timeout_s if failover_s is None else failover_s
        deadline = time.monotonic() + wait
        delay = 0.01
        last: BaseException | None = None
        while True:
            if self._closed:
                raise MasterUnavailable("the store client is closed")
            try:
                s = self._acquire()
            except (ConnectionError, MasterUnavailable, MetadataError) as exc:
                last = exc
                s = None
            if s is not None:
                try:
                    resp = s.roundtrip(
                        method, params, timeout if timeout is not None else self.timeout_s
                    )
                except (OSError, ConnectionError, msgspec.DecodeError) as exc:
                    s.close()
                    last = exc
                    if isinstance(exc, socket.timeout) and not self.address.startswith("etcd://"):
                        raise MasterUnavailable(
                            f"master {s.addr} did not answer {method} within the timeout"
                        ) from exc
                else:
                    self._release(s)
                    value = self._result(resp, typ)
                    if value is not _RETRY:
                        return value
                    last = P.NotLeader(str(msgspec.msgpack.decode(resp.result)))
            # connection failure or standby: find the leader again
            if time.monotonic() >= deadline:
                raise MasterUnavailable(
                    f"no store master answered {method} at {self.address} within "
                    f"{wait:.0f}s: {last}"
                ) from last
            self.failovers += 1
            logger.debug("master call %s failed (%s); re-resolving", method, last)
            with self._lock:
                if self.address.startswith("etcd://"):
                    self._target = ""
            self._drop_all()
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    @staticmethod
    def _result(resp: P.Response, typ: Any) -> Any:
        """The decoded result of an answer; raises error answers; ``_RETRY`` for a standby's
        answer."""
        if resp.code == P.Code.OK:
            return msgspec.msgpack.decode(resp.result, type=typ)
        if resp.code == P.Code.NOT_LEADER:
            return _RETRY
        P.raise_for(resp.code, str(msgspec.msgpack.decode(resp.result)))
        raise AssertionError("unreachable")  # raise_for raised

    def start(self, method: str, params: Any) -> Pending | None:
        """Send an (idempotent) request and return at once, so the caller can work while the master
        answers; None when no connection is at hand (use :meth:`call`)."""
        hook = self.before_use
        if hook is not None:
            hook()
        if self._closed:
            return None
        try:
            s = self._acquire()
        except (ConnectionError, MasterUnavailable, MetadataError):
            return None
        sent = time.monotonic()
        deadline = sent + self.timeout_s
        try:
            rid = s.send_request(method, params, deadline)
        except (OSError, ConnectionError):
            s.close()
            with self._lock:
                self.failovers += 1
            return None
        return Pending(s, rid, method, params, sent, deadline)

    def finish(self, p: Pending, *, typ: Any = Any) -> Any:
        """The result of a :meth:`start` request, as :meth:`call` would return it.

        If the connection failed or a standby answered, the request is made again with
        :meth:`call` (so it must be idempotent), after counting a failover.
        """
        try:
            resp = p.sock.read_response(p.rid, p.deadline)
        except (OSError, ConnectionError, msgspec.DecodeError):
            p.sock.close()
        else:
            self._release(p.sock)
            value = self._result(resp, typ)
            if value is not _RETRY:
                return value
        with self._lock:
            self.failovers += 1
            if self.address.startswith("etcd://"):
                self._target = ""
        return self.call(p.method, p.params, typ=typ)

    def answer(self, p: Pending) -> P.Response | None:
        """Read the answer to a :meth:`start` request and keep its connection (for :meth:`tell`
        or :meth:`release`); None when the connection failed (it is closed, nothing is retried)."""
        try:
            return p.sock.read_response(p.rid, p.deadline)
        except (OSError, ConnectionError, msgspec.DecodeError):
            p.sock.close()
            with self._lock:
                self.failovers += 1
            return None

    @staticmethod
    def result(resp: P.Response, typ: Any = Any) -> Any:
        """The decoded result of ``resp``; raises its error (a standby's answer raises
        NotLeader)."""
        value = MasterRPC._result(resp, typ)
        if value is _RETRY:
            raise P.NotLeader(str(msgspec.msgpack.decode(resp.result)))
        return value

    def tell(self, p: Pending, method: str, params: Any) -> bool:
        """Send a one-way request (one the master does not answer) on ``p``'s connection, behind
        the request it answered, then give the connection back. False if sending failed."""
        try:
            p.sock.send_request(method, params, p.deadline)
        except (OSError, ConnectionError):
            p.sock.close()
            with self._lock:
                self.failovers += 1
            return False
        self._release(p.sock)
        return True

    def release(self, p: Pending) -> None:
        """Give back the connection of a :meth:`start` request whose answer :meth:`answer` read."""
        self._release(p.sock)

    def abandon(self, p: Pending) -> None:
        """Give up on a :meth:`start` request (its answer is never read: the connection is
        closed)."""
        p.sock.close()

    def close(self) -> None:
        """Close every connection; calls blocked on an answer return at once (the client is
        closed)."""
        self._closed = True
        self._drop_all()
        with self._lock:
            busy = list(self._open)
        for s in busy:  # in use by another thread: wake it (it closes the socket itself)
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._etcd is not None:
            self._etcd.close()
            self._etcd = None
