"""The master's RPC connections, and which requests wait on early commits.

:class:`Conn` reads length-prefixed request frames (:mod:`mooncake_core.store.protocol`)
and hands each to its owner, the :class:`~mooncake_core.store.master.MasterServer`; a
malformed or oversized frame closes that connection only. A client that stops reading its
answers is paused (bounded memory). Requests naming a key whose put was committed early but
not yet confirmed are parked (:data:`PARKED_ON_KEYS`, :func:`early_key`) until the confirm
(:data:`CONFIRMS`) or the connection's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from mooncake_core.store import protocol as P
from mooncake_core.store.metrics import Metrics

__all__ = [
    "CONFIRMS",
    "PARKED_ON_KEYS",
    "Conn",
    "ConnOwner",
    "Handler",
    "early_key",
    "install_uvloop",
]

logger = logging.getLogger("mooncake_core.store.master")


def install_uvloop() -> bool:
    """Use uvloop for new event loops when it is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class ConnOwner(Protocol):
    """What a connection needs of the master that accepted it."""

    metrics: Metrics

    def handle(self, conn: Conn, req: P.Request) -> None: ...

    def revoke_early(self, conn: Conn) -> None: ...

    def heartbeat_lost(self, client_id: str) -> None: ...


class Conn(asyncio.Protocol):
    """One client's RPC connection: frames in, requests handed to the master, answers out."""

    def __init__(self, server: ConnOwner) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: Any = None
        self.early: dict[
            str, int
        ] = {}  # early commits made on this connection and not yet confirmed
        self.poller: str | None = None  # the client whose heartbeat polls came on it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.early:
            self.server.revoke_early(self)
        if self.poller is not None:
            self.server.heartbeat_lost(self.poller)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = P.HEADER.unpack_from(buf, pos)
            if length > P.MAX_FRAME:
                self._bad(f"frame of {length} bytes exceeds {P.MAX_FRAME}")
                return
            if n - pos - 4 < length:
                break
            frame = bytes(buf[pos + 4 : pos + 4 + length])
            pos += 4 + length
            try:
                req = P.decode_request(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._bad(f"malformed request frame: {exc}")
                return
            self.server.handle(self, req)
        if pos:
            del buf[:pos]

    def pause_writing(self) -> None:
        # the peer is not reading its answers: stop reading its requests (bounded memory)
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _bad(self, why: str) -> None:
        self.server.metrics.bad_frames += 1
        peer = self.transport.get_extra_info("peername") if self.transport else None
        logger.warning("closing RPC connection from %s: %s", peer, why)
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


Handler = Callable[[Any, float], Any]

# requests on these keys wait while a put of one of them is committed early but not yet confirmed
PARKED_ON_KEYS = frozenset(
    {
        "get_replica_list",
        "exists",
        "get_size",
        "remove",
        "query_key",
        "put_start",
        "put_commit",
        "batch_get_replica_list",
        "batch_exists",
        "batch_remove",
        "batch_put_start",
        "batch_put_commit",
        "create_replica_task",
        "drop_replicas",
    }
)
CONFIRMS = frozenset({"put_confirm", "batch_put_confirm"})


def early_key(method: str, args: Any, early: dict[str, int]) -> str | None:
    """The first key of ``args`` with an unconfirmed early commit (None if none)."""
    if method.startswith("batch_"):
        return next((k for k in args.keys if k in early), None)
    key = args.key
    return key if key in early else None
