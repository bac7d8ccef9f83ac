"""A standalone store client service that processes on the same host attach to.

``mooncake-core client`` runs one :class:`StandaloneClientService`: it holds a real
:class:`~mooncake_core.store.client.StoreClient` (its segment in the pool, its transfer
engine) and serves other processes on this host over a Unix socket in the abstract
namespace, ``\\0mooncake_core_client_<port>.sock``, where ``<port>`` is the TCP port the
service also listens on (that listener only answers one JSON line naming the socket; it
reserves the port and lets a caller check who is there). This is the published store's
dummy/real client split (``mooncake_client`` + ``setup_dummy``), with our own protocol;
``mooncake_core.compat.store_dummy`` is the attaching side.

Memory is shared, never copied over the socket: the attaching process creates memfds
(its staging buffer for bytes calls and the buffers it allocates) and passes them with
``SCM_RIGHTS``; the service maps each one, registers the mapping with its transfer
engine and moves object bytes between the pool and that mapping directly (``put_from`` /
``get_into`` on the service's addresses). A connection that ends (its process exited or
died) has its mappings unregistered and unmapped at once; the service keeps serving
the others.

Wire format (ours): each message is a 4-byte little-endian length and a JSON object;
fds ride on the first bytes of a request as ``SCM_RIGHTS`` ancillary data. A request
is ``{"op": NAME, ...}``; the answer is ``{"ok": true, "value": ...}`` or
``{"ok": false, "error": [CLASS, MESSAGE]}`` where CLASS names one of our error
classes (:data:`ERRORS`). Exceptions inside result lists are encoded the same way.
Peers with another user id than the service's are refused (root may attach to any).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_core.errors import (
    LeaseExpired,
    MasterUnavailable,
    MooncakeError,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    SegmentError,
    StoreError,
    TransportError,
)
from mooncake_core.store.client import StoreClient
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy
from mooncake_core.transfer.memory import host_view, map_memory, unmap_memory

__all__ = [
    "StandaloneClientService",
    "SharedMemory",
    "ipc_address",
    "send_msg",
    "recv_msg",
    "encode_result",
    "decode_result",
    "ERRORS",
    "PROTOCOL_VERSION",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE = 64 << 20  # a request or answer larger than this is refused
MAX_FDS = 4
_LEN = struct.Struct("<I")

#: Error classes an answer may name (anything else arrives as StoreError).
ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (
        ObjectNotFound,
        ObjectExists,
        ObjectBusy,
        NoSpace,
        LeaseExpired,
        MasterUnavailable,
        InvalidArgument,
        SegmentError,
        TransportError,
        StoreError,
        MooncakeError,
    )
}

# Read-only or metadata calls forwarded as they are: name -> keyword arguments allowed.
_CALLS: dict[str, frozenset[str]] = {
    "exists": frozenset(),
    "batch_exists": frozenset(),
    "get_size": frozenset(),
    "remove": frozenset({"force"}),
    "batch_remove": frozenset({"force"}),
    "remove_by_regex": frozenset({"force"}),
    "remove_all": frozenset({"force"}),
    "keys_by_regex": frozenset(),
    "query": frozenset(),
    "stats": frozenset(),
}
_PUT_KW = frozenset({"replica_num", "preferred_segment", "hard_pin", "soft_pin_ttl_s", "strategy"})


def ipc_address(port: int) -> str:
    """The abstract Unix socket name of the service listening on TCP ``port``."""
    return f"\0mooncake_core_client_{int(port)}.sock"


class SharedMemory:
    """``size`` bytes of a memfd mapped shared at :attr:`addr` (created, or from an fd).

    The fd is kept open until :meth:`close` (it is what gets passed to the service).
    """

    def __init__(self, size: int, fd: int | None = None, name: str = "mooncake-core-dummy") -> None:
        if size <= 0:
            raise InvalidArgument(f"shared memory needs a positive size, got {size}")
        own = fd is None
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC) if fd is None else fd
        self.size = size
        try:
            if own:
                os.ftruncate(self.fd, size)
            elif os.fstat(self.fd).st_size < size:
                raise InvalidArgument(f"the shared memory passed is smaller than {size} bytes")
            try:
                addr = map_memory(size, mmap.MAP_SHARED, self.fd)
            except OSError as exc:
                raise SegmentError(
                    f"cannot map {size} bytes of shared memory: {os.strerror(exc.errno or 0)}"
                ) from None
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        self.addr = int(addr)

    def view(self, off: int = 0, n: int | None = None) -> memoryview:
        return host_view(self.addr + off, self.size - off if n is None else n)

    def close(self) -> None:
        if self.fd < 0:
            return
        unmap_memory(self.addr, self.size)
        os.close(self.fd)
        self.fd = -1


# ---------------------------------------------------------------------- framing
def send_msg(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    frame = _LEN.pack(len(data)) + data
    if fds:
        sent = sock.sendmsg(
            [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, into: bytearray) -> None:
    while len(into) < n:
        chunk = sock.recv(n - len(into))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        into += chunk


def recv_msg(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the fds that came with it; ``EOFError`` on a clean close."""
    head = bytearray()
    fds: list[int] = []
    msg, anc, _flags, _addr = sock.recvmsg(_LEN.size, socket.CMSG_SPACE(MAX_FDS * 4))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % 4])
            fds.extend(got)
    if not msg:
        for fd in fds:
            os.close(fd)
        raise EOFError("connection closed")
    head += msg
    try:
        _recv_exact(sock, _LEN.size, head)
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise InvalidArgument(f"message of {n} bytes exceeds {MAX_MESSAGE}")
        body = bytearray()
        _recv_exact(sock, n, body)
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def encode_result(value: Any) -> Any:
    """JSON-able form of a call's result (exceptions become ``{"__error__": [cls, msg]}``)."""
    if isinstance(value, BaseException):
        return {"__error__": [_error_name(value), str(value)]}
    if isinstance(value, (list, tuple)):
        return [encode_result(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_result(v) for k, v in value.items()}
    return value


def decode_result(value: Any) -> Any:
    """The inverse of :func:`encode_result` (errors come back as exception objects)."""
    if isinstance(value, dict):
        err = value.get("__error__")
        if isinstance(err, list) and len(err) == 2 and len(value) == 1:
            return make_error(str(err[0]), str(err[1]))
        return {k: decode_result(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_result(v) for v in value]
    return value


def make_error(name: str, message: str) -> BaseException:
    cls = ERRORS.get(name, StoreError)
    return cls(message)


def _error_name(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS:
            return cls.__name__
    if isinstance(exc, ValueError):
        return "InvalidArgument"
    if isinstance(exc, OSError):
        return "MasterUnavailable"
    return "StoreError"


# ---------------------------------------------------------------------- the service
class _Session:
    """One attached process: its shared memory, mapped here and registered."""

    def __init__(self, service: StandaloneClientService, sock: socket.socket, peer: str) -> None:
        self.service = service
        self.sock = sock
        self.peer = peer
        self.maps: dict[int, SharedMemory] = {}

    @property
    def client(self) -> StoreClient:
        return self.service.client

    def serve(self) -> None:
        try:
            while True:
                try:
                    req, fds = recv_msg(self.sock)
                except (EOFError, ConnectionError, OSError):
                    return
                except (InvalidArgument, ValueError) as exc:
                    logger.warning("client %s: bad message (%s); closing", self.peer, exc)
                    return
                try:
                    value = self.handle(req, fds)
                    answer: dict[str, Any] = {"ok": True, "value": encode_result(value)}
                except (MooncakeError, OSError, ValueError, KeyError, TypeError) as exc:
                    answer = {"ok": False, "error": [_error_name(exc), str(exc)]}
                try:
                    send_msg(self.sock, answer)
                except OSError:
                    return
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        for ident in list(self.maps):
            self._unmap(ident)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.service._forget(self)
        logger.info("client %s detached", self.peer)

    def _unmap(self, ident: int) -> None:
        shm = self.maps.pop(ident, None)
        if shm is None:
            raise InvalidArgument(f"no shared memory {ident} is mapped for this client")
        with contextlib.suppress(MooncakeError, KeyError):
            self.client.unregister_buffer(shm.addr)
        shm.close()

    def _addr(self, ident: int, off: int, n: int) -> int:
        shm = self.maps.get(int(ident))
        if shm is None:
            raise InvalidArgument(f"shared memory {ident} is not registered with the service")
        off, n = int(off), int(n)
        if off < 0 or n <= 0 or off + n > shm.size:
            raise InvalidArgument(f"[{off}, {off + n}) is outside the {shm.size}-byte buffer")
        return shm.addr + off

    def handle(self, req: dict[str, Any], fds: list[int]) -> Any:
        """Run one request; ``fds`` are the handler's to keep or close."""
        op = req.get("op") if isinstance(req, dict) else None
        if op != "map":
            for fd in fds:
                os.close(fd)
        handler: Callable[[dict[str, Any], list[int]], Any] | None = getattr(self, f"op_{op}", None)
        if not isinstance(op, str) or handler is None:
            raise InvalidArgument(f"unknown request {op!r}")
        if fds and op != "map":
            raise InvalidArgument(f"request {op!r} takes no file descriptors")
        return handler(req, fds)

    # --- requests
    def op_hello(self, req: dict[str, Any], fds: list[int]) -> Any:
        if req.get("version") != PROTOCOL_VERSION:
            raise InvalidArgument(
                f"protocol version {req.get('version')!r}; this service speaks {PROTOCOL_VERSION}"
            )
        return {"hostname": self.client.hostname, "tenant": self.client.tenant, "pid": os.getpid()}

    def op_map(self, req: dict[str, Any], fds: list[int]) -> Any:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise InvalidArgument("map needs exactly one file descriptor")
        try:
            ident, size = int(req["id"]), int(req["size"])
            if ident in self.maps:
                raise InvalidArgument(f"shared memory {ident} is already mapped")
        except BaseException:
            os.close(fds[0])
            raise
        shm = SharedMemory(size, fd=fds[0])  # owns the fd from here (closes it on failure)
        try:
            self.client.register_buffer(shm.addr, size)
        except BaseException:
            shm.close()
            raise
        self.maps[ident] = shm
        return 0

    def op_unmap(self, req: dict[str, Any], fds: list[int]) -> Any:
        self._unmap(int(req["id"]))
        return 0

    def _kw(self, req: dict[str, Any]) -> dict[str, Any]:
        kw = dict(req.get("kw") or {})
        bad = set(kw) - _PUT_KW
        if bad:
            raise InvalidArgument(f"unknown put option(s) {sorted(bad)}")
        return kw

    def op_put_from(self, req: dict[str, Any], fds: list[int]) -> Any:
        addr = self._addr(req["id"], req["off"], req["n"])
        self.client.put_from(str(req["key"]), addr, int(req["n"]), **self._kw(req))
        return 0

    def op_get_into(self, req: dict[str, Any], fds: list[int]) -> Any:
        addr = self._addr(req["id"], req["off"], req["n"])
        return self.client.get_into(str(req["key"]), addr, int(req["n"]))

    def op_batch_put_from(self, req: dict[str, Any], fds: list[int]) -> Any:
        keys = [str(k) for k in req["keys"]]
        bufs = [tuple(b) for b in req["bufs"]]
        addrs = [self._addr(i, o, n) for i, o, n in bufs]
        return self.client.batch_put_from(keys, addrs, [int(b[2]) for b in bufs], **self._kw(req))

    def op_batch_get_into(self, req: dict[str, Any], fds: list[int]) -> Any:
        keys = [str(k) for k in req["keys"]]
        bufs = [tuple(b) for b in req["bufs"]]
        addrs = [self._addr(i, o, n) for i, o, n in bufs]
        return self.client.batch_get_into(keys, addrs, [int(b[2]) for b in bufs])

    def op_get_batch(self, req: dict[str, Any], fds: list[int]) -> Any:
        """Read ``keys`` into the buffer ``id`` one after the other: per key ``[off, n]``,
        None when missing, or an error (the buffer is full)."""
        ident = int(req["id"])
        shm = self.maps.get(ident)
        if shm is None:
            raise InvalidArgument(f"shared memory {ident} is not registered with the service")
        values = self.client.get_batch([str(k) for k in req["keys"]])
        out: list[Any] = []
        off = 0
        for value in values:
            if value is None:
                out.append(None)
            elif off + len(value) > shm.size:
                out.append(
                    InvalidArgument(
                        f"{len(value)} bytes do not fit in the {shm.size}-byte local buffer"
                    )
                )
            else:
                shm.view(off, len(value))[:] = value
                out.append([off, len(value)])
                off += len(value)
        return out

    def op_call(self, req: dict[str, Any], fds: list[int]) -> Any:
        name = req.get("name")
        allowed = _CALLS.get(name) if isinstance(name, str) else None
        if allowed is None:
            raise InvalidArgument(f"the service does not forward {name!r}")
        kwargs = dict(req.get("kwargs") or {})
        if set(kwargs) - allowed:
            raise InvalidArgument(f"{name}: unexpected keyword(s) {sorted(set(kwargs) - allowed)}")
        return getattr(self.client, str(name))(*list(req.get("args") or []), **kwargs)


class StandaloneClientService:
    """Serve a store client to processes on this host (see the module doc).

    The constructor binds (so a port in use fails before anything starts);
    :meth:`start` serves ``client``, a started :class:`StoreClient` the service does not
    close.

    Args:
        host: the TCP listener's address (loopback by default).
        port: its port (0: a free one; the Unix socket is named after the port).
    """

    client: StoreClient

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._tcp = socket.create_server((host, port), reuse_port=False)
        self.host = host
        self.port = int(self._tcp.getsockname()[1])
        self.ipc = ipc_address(self.port)
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._unix.bind(self.ipc)
        except OSError:
            self._unix.close()
            self._tcp.close()
            raise
        self._sessions: set[_Session] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, client: StoreClient) -> StandaloneClientService:
        self.client = client
        # listen only now: until then a dummy's (re-)attach is refused at once, not left
        # waiting while the client starts
        self._unix.listen(64)
        for target, name in ((self._accept_unix, "ipc"), (self._accept_tcp, "tcp")):
            t = threading.Thread(target=target, name=f"mc-client-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info(
            "standalone client %s serving on %s:%d (IPC socket @%s)",
            self.client.hostname,
            self.host,
            self.port,
            self.ipc[1:],
        )
        return self

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _accept_tcp(self) -> None:
        hello = json.dumps({"service": "mooncake-core client", "ipc": "@" + self.ipc[1:]}) + "\n"
        while not self._stopped.is_set():
            try:
                conn, _ = self._tcp.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), conn:
                conn.settimeout(1.0)
                conn.sendall(hello.encode())

    def _accept_unix(self) -> None:
        me = os.getuid()
        while not self._stopped.is_set():
            try:
                conn, _ = self._unix.accept()
            except OSError:
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
            if uid != me and me != 0:
                logger.warning("refused pid %d: user %d is not the service's user %d", pid, uid, me)
                conn.close()
                continue
            session = _Session(self, conn, f"pid {pid}")
            with self._lock:
                self._sessions.add(session)
            logger.info("client pid %d attached", pid)
            t = threading.Thread(target=session.serve, name=f"mc-client-pid{pid}", daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _forget(self, session: _Session) -> None:
        with self._lock:
            self._sessions.discard(session)

    def stop(self) -> None:
        """Stop accepting and drop every attached process (their calls then fail)."""
        self._stopped.set()
        for s in (self._tcp, self._unix):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        with self._lock:
            sessions = list(self._sessions)
            threads = list(self._threads)
        for session in sessions:
            with contextlib.suppress(OSError):
                session.sock.shutdown(socket.SHUT_RDWR)
        for t in threads:  # the sessions unmap their memory before the client closes
            if t is not threading.current_thread():
                t.join(timeout=2.0)

    def __enter__(self) -> StandaloneClientService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
