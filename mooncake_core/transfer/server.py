"""The engine's TCP listener: serves peers' reads, writes, descriptors and tensors.

One thread per connection (blocking sockets; ``recv_into`` straight into registered
memory, ``sendmsg`` straight out of it). Every address range is checked against the
segment table before a byte moves. Malformed input closes that connection only.

The listener sees its engine only through :class:`~mooncake_core.transfer.types.ListenerHost`
(registered memory, descriptor, control inbox, RDMA queue-pair acceptance).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
from typing import Any

from mooncake_core.errors import InvalidRequest, MooncakeError, TransportError
from mooncake_core.transfer.net import recv_exact, send_parts, tune_socket
from mooncake_core.transfer.protocol import (
    FLAG_SECRET_REQUIRED,
    GREETING,
    MAGIC,
    MAX_CONTROL_PAYLOAD,
    MAX_READV_BYTES,
    MAX_READV_RANGES,
    RANGE,
    REQ,
    RESP,
    VERSION,
    Op,
    Status,
    auth_digest,
)
from mooncake_core.transfer.types import ListenerHost

__all__ = ["TransferServer"]

logger = logging.getLogger(__name__)


class _Close(TransportError):
    """Close this connection (protocol violation or auth failure); never leaves the listener."""


class TransferServer:
    """Accepts peers on ``(host, port)`` and serves them until :meth:`close`."""

    def __init__(self, engine: ListenerHost, hosts: list[str], port: int, secret: str) -> None:
        self.engine = engine
        self.secret = secret
        self._socks: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.port = port
        for host in hosts:
            s = socket.socket(
                socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
            )
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, self.port))
            except OSError as exc:
                s.close()
                for o in self._socks:
                    o.close()
                raise OSError(
                    exc.errno, f"cannot listen on {host}:{self.port}: {exc.strerror}"
                ) from exc
            s.listen(128)
            self.port = s.getsockname()[1]
            self._socks.append(s)
        self._threads = [
            threading.Thread(
                target=self._accept_loop, args=(s,), name=f"mc-accept-{self.port}", daemon=True
            )
            for s in self._socks
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._closed = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self, lsock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, addr = lsock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            tune_socket(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, addr), name="mc-conn", daemon=True
            ).start()

    # ------------------------------------------------------------------ per connection
    def _serve(self, conn: socket.socket, addr: Any) -> None:
        try:
            self._serve_loop(conn)
        except _Close as exc:
            logger.debug("closing connection from %s: %s", addr, exc)
        except (ConnectionError, OSError) as exc:
            logger.debug("connection from %s ended: %s", addr, exc)
        except Exception:  # a bug must not take the listener down
            logger.exception("unexpected error serving %s", addr)
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    @staticmethod
    def _reply(
        conn: socket.socket, status: int, req_id: int, payload: memoryview | bytes | None = None
    ) -> None:
        n = len(payload) if payload is not None else 0
        head = RESP.pack(MAGIC, status, req_id, 0, n)
        if payload is None:
            conn.sendall(head)
        else:
            send_parts(conn, [head, payload])

    def _serve_loop(self, conn: socket.socket) -> None:
        nonce = os.urandom(16)
        flags = FLAG_SECRET_REQUIRED if self.secret else 0
        conn.sendall(GREETING.pack(MAGIC, VERSION, flags, nonce))
        expected = auth_digest(self.secret, nonce)
        authed = False
        hdr = bytearray(REQ.size)
        hview = memoryview(hdr)
        segments = self.engine.segments
        inbox = self.engine.inbox
        while True:
            if not recv_exact(conn, hview):
                return
            magic, op, _fl, _pad, req_id, aux, addr, length = REQ.unpack(hdr)
            if magic != MAGIC:
                raise _Close("bad magic (not a mooncake-core peer)")
            if not authed and op != Op.HELLO:
                self._reply(conn, Status.NOT_AUTHENTICATED, req_id)
                raise _Close("request before HELLO")
            if op == Op.WRITE:
                try:
                    region = segments.find(addr, length)
                except InvalidRequest as exc:
                    self._reply(conn, Status.OUT_OF_BOUNDS, req_id, str(exc).encode()[:1024])
                    raise _Close(f"write refused: {exc}") from None
                if region.kind == "host":
                    if not recv_exact(conn, region.view(addr, length)):
                        raise _Close("eof in write payload")
                else:
                    tmp = memoryview(bytearray(length))
                    if not recv_exact(conn, tmp):
                        raise _Close("eof in write payload")
                    region.copy_in(addr, tmp)
                self._reply(conn, Status.OK, req_id)
            elif op == Op.READ:
                try:
                    region = segments.find(addr, length)
                except InvalidRequest as exc:
                    self._reply(conn, Status.OUT_OF_BOUNDS, req_id, str(exc).encode()[:1024])
                    continue
                self._reply(conn, Status.OK, req_id, region.copy_out(addr, length))
            elif op == Op.READV:
                self._readv(conn, req_id, aux, length)
            elif op == Op.HELLO:
                body = self._recv_control(conn, length, req_id)
                if not hmac.compare_digest(bytes(body[:32]), expected):
                    self._reply(conn, Status.AUTH_FAILED, req_id)
                    logger.warning("peer failed authentication (wrong or missing shared secret)")
                    raise _Close("authentication failed")
                authed = True
                self._reply(conn, Status.OK, req_id)
            elif op == Op.DESC:
                self._reply(conn, Status.OK, req_id, json.dumps(self.engine.describe()).encode())
            elif op == Op.PING:
                self._reply(conn, Status.OK, req_id)
            elif op == Op.RDMA_CONNECT:
                body = self._recv_control(conn, length, req_id)
                try:
                    answer = self.engine.accept_rdma(json.loads(bytes(body)))
                except (ValueError, TypeError, KeyError, MooncakeError) as exc:
                    self._reply(conn, Status.BAD_REQUEST, req_id, str(exc).encode()[:1024])
                    continue
                self._reply(conn, Status.OK, req_id, json.dumps(answer).encode())
            elif op == Op.NOTIFY:
                body = self._recv_control(conn, length, req_id)
                try:
                    msg = json.loads(bytes(body))
                    inbox.deliver_notify(str(msg["name"]), str(msg["msg"]))
                except (ValueError, KeyError, TypeError):
                    self._reply(conn, Status.BAD_REQUEST, req_id)
                    continue
                self._reply(conn, Status.OK, req_id)
            elif op == Op.TENSOR:
                if aux > MAX_CONTROL_PAYLOAD or aux > length:
                    self._reply(conn, Status.TOO_LARGE, req_id)
                    raise _Close("tensor metadata too large")
                meta_buf = memoryview(bytearray(aux))
                if not recv_exact(conn, meta_buf):
                    raise _Close("eof in tensor metadata")
                data = inbox.tensors.alloc(length - aux)
                if length - aux and not recv_exact(conn, data.view):
                    raise _Close("eof in tensor payload")
                try:
                    inbox.tensors.deliver(json.loads(bytes(meta_buf)), data)
                except (ValueError, KeyError, TypeError) as exc:
                    self._reply(conn, Status.BAD_REQUEST, req_id, str(exc).encode()[:1024])
                    continue
                self._reply(conn, Status.OK, req_id)
            else:
                self._reply(conn, Status.BAD_REQUEST, req_id)
                raise _Close(f"unknown op {op}")

    def _readv(self, conn: socket.socket, req_id: int, count: int, length: int) -> None:
        """Answer a READV: every range's bytes back to back, or one refusal."""
        if not 0 < count <= MAX_READV_RANGES or length != count * RANGE.size:
            self._reply(conn, Status.BAD_REQUEST, req_id)
            raise _Close(f"READV of {count} ranges with a {length}-byte descriptor")
        desc = memoryview(bytearray(length))
        if not recv_exact(conn, desc):
            raise _Close("eof in READV ranges")
        parts: list[memoryview | bytes] = []
        total = 0
        find = self.engine.segments.find
        for i in range(count):
            addr, n = RANGE.unpack_from(desc, i * RANGE.size)
            try:
                parts.append(find(addr, n).copy_out(addr, n))
            except InvalidRequest as exc:  # the refused range's index goes in the pad field
                msg = str(exc).encode()[:1024]
                send_parts(conn, [RESP.pack(MAGIC, Status.OUT_OF_BOUNDS, req_id, i, len(msg)), msg])
                return
            total += n
            if total > MAX_READV_BYTES:
                self._reply(conn, Status.TOO_LARGE, req_id)
                return
        send_parts(conn, [RESP.pack(MAGIC, Status.OK, req_id, 0, total), *parts])

    def _recv_control(self, conn: socket.socket, length: int, req_id: int) -> memoryview:
        if length > MAX_CONTROL_PAYLOAD:
            self._reply(conn, Status.TOO_LARGE, req_id)
            raise _Close(f"control payload of {length} bytes is too large")
        body = memoryview(bytearray(length))
        if length and not recv_exact(conn, body):
            raise _Close("eof in control payload")
        return body
