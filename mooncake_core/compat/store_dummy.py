"""``setup_dummy`` / ``alloc_from_mem_pool``: a store that works through a standalone client.

The published store can run as a *dummy*: ``setup_dummy(mem_pool_size, local_buffer_size,
server_address)`` attaches to a ``mooncake_client`` process on this host (which holds
the real client, its segment and its transfer engine) and every call goes through it.
Ours attaches to ``mooncake-core client`` (:mod:`mooncake_core.store.standalone_client`)
the same way, with our own protocol over its Unix socket:

- ``setup_dummy`` returns 0, or -1 with one log line when no service answers at
  ``server_address`` (``host:port``; the port names the service's socket) within
  :data:`CONNECT_WAIT_S` seconds, or when the address is malformed. Wrong argument types
  or negative sizes raise ``TypeError``, as published. Calling it again re-attaches.
- ``local_buffer_size`` bytes of shared memory stage the bytes calls (``put``, ``get``,
  ``put_batch``, ``get_batch``, ...): a value or batch larger than it is refused with
  -600, and with 0 every bytes call is refused (-600 / ``b""``), as published.
- ``alloc_from_mem_pool(size)`` maps ``size`` bytes of new shared memory (a memfd) and
  returns its address (0 and one log line for size 0, or when not attached). As
  observed on the published 0.3.13 client, each call is its own mapping and
  ``mem_pool_size`` does not bound them. ``register_buffer(addr, size)`` with exactly
  such an allocation passes its fd to the service, which maps and registers it; then
  ``put_from`` / ``get_into`` / ``batch_*`` on addresses inside it move bytes between the
  pool and that memory with no copy in this process. Other addresses answer -600 and
  other registrations -1, as published.
- ``is_exist``, ``get_size``, ``remove*``, ``batch_is_exist`` go through the service;
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` gather and scatter
  parts in registered pool memory by copy through the local buffer. Calls the service
  does not forward (replica and task calls, segments) answer -1. ``get_hostname()`` is
  ``""``, as published.
- When the service is gone every call answers -900 (``get`` ``b""``, ``health_check``
  2) at once; nothing waits. A call gives up after :data:`CALL_TIMEOUT_S` seconds.
- When the service comes back (restarted at the same address), the next call re-attaches
  before it runs: it connects, passes the local buffer and every registered
  ``alloc_from_mem_pool`` buffer again (same addresses here), then sends the call. Each
  call makes at most one attempt, bounded by :data:`REATTACH_WAIT_S`; while nothing
  listens it costs one refused connect and answers -900. A call is never sent twice: one
  that was in flight when the service died answers -900. Objects the old service held
  in its segment are gone with it. (The published dummy pings its service from a thread
  and re-registers its memory the same way; right after a restart its calls answer -600
  until that thread has reconnected, ours re-attach on the call itself.)
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from mooncake_core.errors import MasterUnavailable, MooncakeError, StoreError
from mooncake_core.store.protocol import InvalidArgument
from mooncake_core.store.standalone_client import (
    PROTOCOL_VERSION,
    SharedMemory,
    decode_result,
    ipc_address,
    make_error,
    recv_msg,
    send_msg,
)

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["DummyMethods", "DummyClient", "CONNECT_WAIT_S", "CALL_TIMEOUT_S", "REATTACH_WAIT_S"]

logger = logging.getLogger("mooncake_core.compat.store")

#: How long setup_dummy keeps trying to reach the service (the published client: ~4 s).
CONNECT_WAIT_S = 4.0
#: The longest one call through the service may take before it fails (-900).
CALL_TIMEOUT_S = 120.0
#: The longest a call may spend re-attaching to a restarted service (hello, memory).
REATTACH_WAIT_S = 5.0
_STAGING = 0  # the id of the local buffer's shared memory
_ALIGN = 64


class DummyUnsupported(StoreError, AttributeError):
    """A client call the service does not forward (answers -1)."""


def _bad(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 0


def _view(value: Any) -> memoryview:
    try:
        mv = memoryview(value)
    except TypeError:
        raise InvalidArgument(f"expected a bytes-like value, got {type(value).__name__}") from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class _PoolRegion:
    kind = "host"


class _PoolSegments:
    """``engine.segments.find`` over a dummy's registered pool memory: the compat store's
    multi-buffer calls gather from and scatter to it (mapped in this process too)."""

    def __init__(self, dummy: DummyClient) -> None:
        self._dummy = dummy

    def find(self, addr: int, length: int) -> _PoolRegion:
        self._dummy._locate(int(addr), int(length))  # InvalidArgument (-600) outside it
        return _PoolRegion()


class _PoolEngine:
    def __init__(self, dummy: DummyClient) -> None:
        self.segments = _PoolSegments(dummy)


class DummyClient:
    """The part of :class:`StoreClient` the compat store uses, served by a standalone
    client service over its Unix socket (see the module doc)."""

    hostname = ""  # as published: a dummy has no segment of its own

    def __init__(self, sock: socket.socket, where: str, port: int, local_buffer_size: int) -> None:
        self._sock: socket.socket | None = None
        self._where = where
        self._port = port
        self._closed = False
        self._lock = threading.RLock()
        self._mem: dict[int, SharedMemory] = {}  # id -> shared memory (0: the local buffer)
        self._registered: set[int] = set()
        self._next = 1
        self.engine = _PoolEngine(self)
        self.tenant: str | None = None
        self.service_pid = 0
        try:
            if local_buffer_size:
                staging = SharedMemory(local_buffer_size, name="mooncake-core-staging")
                self._mem[_STAGING] = staging
                self._registered.add(_STAGING)
            self._attach(sock)
        except BaseException:
            sock.close()
            self.close()
            raise

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise DummyUnsupported(
            f"{name} is not available on a dummy client (setup_dummy); "
            "use a store set up with setup()"
        )

    # ------------------------------------------------------------------ transport
    def _request(self, req: dict[str, Any], fds: Sequence[int] = ()) -> Any:
        with self._lock:
            sock = self._live()
            try:
                answer = _exchange(sock, req, fds)
            except (OSError, EOFError, ValueError) as exc:
                self._drop(exc)
                raise MasterUnavailable(
                    f"the standalone client service at {self._where} is gone ({exc})"
                ) from None
        return _value(answer)

    def _attach(self, sock: socket.socket) -> None:
        """Say hello on ``sock`` and pass every registered shared memory; then use it.

        Raises what the service answers (an error class), or OSError / EOFError /
        ValueError when the connection fails or :data:`REATTACH_WAIT_S` passes.
        """
        sock.settimeout(REATTACH_WAIT_S)
        hello = _value(_exchange(sock, {"op": "hello", "version": PROTOCOL_VERSION}))
        for ident in sorted(self._registered):
            shm = self._mem[ident]
            _value(_exchange(sock, {"op": "map", "id": ident, "size": shm.size}, [shm.fd]))
        sock.settimeout(CALL_TIMEOUT_S)
        self._sock = sock
        self.tenant = hello.get("tenant") or None
        self.service_pid = int(hello.get("pid") or 0)

    def _live(self) -> socket.socket:
        """The connection to the service; re-attached first when the service closed it
        (it exited, or was restarted). MasterUnavailable (-900) when none answers."""
        sock = self._sock
        if sock is not None and _hung_up(sock):
            self._drop(EOFError("the service closed the connection"))
            sock = None
        if sock is not None:
            return sock
        gone = f"the standalone client service at {self._where} is gone"
        if self._closed:
            raise MasterUnavailable(f"{gone} (the store is closed)")
        try:
            sock = _dial(self._port)
        except OSError as exc:
            raise MasterUnavailable(f"{gone} ({exc})") from None
        if sock is None:
            raise MasterUnavailable(f"{gone} (nothing listens there)")
        try:
            self._attach(sock)
        except (MooncakeError, OSError, EOFError, ValueError) as exc:
            sock.close()
            raise MasterUnavailable(f"{gone}: re-attaching failed ({exc})") from None
        logger.warning(
            "re-attached to the client service at %s (pid %d; %d shared buffers passed again)",
            self._where,
            self.service_pid,
            len(self._registered),
        )
        return sock

    def _drop(self, why: BaseException) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            logger.error("the standalone client service at %s is gone: %s", self._where, why)
            sock.close()

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            for shm in self._mem.values():
                shm.close()
            self._mem.clear()
            self._registered.clear()

    # ------------------------------------------------------------------ shared memory
    def allocate(self, size: int) -> int:
        """New shared memory of ``size`` bytes (not yet registered); its address."""
        n = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        shm = SharedMemory(n)
        with self._lock:
            ident, self._next = self._next, self._next + 1
            self._mem[ident] = shm
        return shm.addr

    def _find(self, addr: int) -> int | None:
        for ident, shm in self._mem.items():
            if ident != _STAGING and shm.addr == addr:
                return ident
        return None

    def register_buffer(self, buf: Any, size: int | None = None) -> None:
        """Register exactly one allocation of :meth:`allocate` with the service."""
        ident = self._find(int(buf)) if isinstance(buf, int) else None
        if ident is None:
            raise StoreError(
                f"register_buffer: {buf!r} is not the start of a buffer from alloc_from_mem_pool"
            )
        shm = self._mem[ident]
        if size is not None and int(size) > shm.size:
            raise StoreError(
                f"register_buffer: {size} bytes, but the buffer at 0x{shm.addr:x} has {shm.size}"
            )
        with self._lock:
            if ident in self._registered:
                return
            self._request({"op": "map", "id": ident, "size": shm.size}, [shm.fd])
            self._registered.add(ident)

    def unregister_buffer(self, buf: Any) -> None:
        ident = self._find(int(buf)) if isinstance(buf, int) else None
        with self._lock:
            if ident is None or ident not in self._registered:
                raise StoreError(f"unregister_buffer: {buf!r} is not registered")
            self._live()  # a re-attach passes it again; then unmap it there
            self._registered.discard(ident)
            self._request({"op": "unmap", "id": ident})

    def _locate(self, addr: Any, n: int) -> list[int]:
        """``[id, offset, n]`` of ``[addr, addr+n)`` inside registered shared memory."""
        if not isinstance(addr, int) or isinstance(addr, bool):
            raise InvalidArgument(
                "a dummy client moves bytes through shared memory: pass an address "
                "from alloc_from_mem_pool"
            )
        for ident in self._registered:
            shm = self._mem[ident]
            if ident != _STAGING and shm.addr <= addr and addr + n <= shm.addr + shm.size:
                return [ident, addr - shm.addr, n]
        raise InvalidArgument(
            f"0x{addr:x} (+{n}) is not in registered memory from alloc_from_mem_pool"
        )

    def _staging(self, total: int) -> SharedMemory:
        shm = self._mem.get(_STAGING)
        if shm is None:
            raise InvalidArgument("the store was attached with local_buffer_size=0")
        if total > shm.size:
            raise InvalidArgument(
                f"{total} bytes do not fit in the {shm.size}-byte local buffer (local_buffer_size)"
            )
        return shm

    # ------------------------------------------------------------------ bytes (staged)
    def put(self, key: str, value: Any, **kw: Any) -> None:
        mv = _view(value)
        if not mv.nbytes:
            raise InvalidArgument(f"put {key!r}: the value is empty")
        with self._lock:
            shm = self._staging(mv.nbytes)
            shm.view(0, mv.nbytes)[:] = mv
            self._request(
                {"op": "put_from", "key": key, "id": _STAGING, "off": 0, "n": mv.nbytes, "kw": kw}
            )

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], **kw: Any
    ) -> list[BaseException | None]:
        views = [_view(v) for v in values]
        if len(views) != len(keys):
            raise InvalidArgument("keys and values must have the same length")
        if any(not v.nbytes for v in views):
            raise InvalidArgument("put_batch: a value is empty")
        offsets, total = [], 0
        for v in views:
            offsets.append(total)
            total += -(-v.nbytes // _ALIGN) * _ALIGN
        with self._lock:
            shm = self._staging(total)
            for v, off in zip(views, offsets, strict=True):
                shm.view(off, v.nbytes)[:] = v
            bufs = [[_STAGING, off, v.nbytes] for v, off in zip(views, offsets, strict=True)]
            res = self._request(
                {"op": "batch_put_from", "keys": list(keys), "bufs": bufs, "kw": kw}
            )
        return cast("list[BaseException | None]", res)

    def get(self, key: str) -> bytes:
        with self._lock:
            shm = self._staging(0)
            n = int(
                self._request(
                    {"op": "get_into", "key": key, "id": _STAGING, "off": 0, "n": shm.size}
                )
            )
            return bytes(shm.view(0, n))

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._lock:
            shm = self._staging(0)
            res = self._request({"op": "get_batch", "keys": list(keys), "id": _STAGING})
            return [
                bytes(shm.view(int(r[0]), int(r[1]))) if isinstance(r, list) else None for r in res
            ]

    # ------------------------------------------------------------------ zero-copy
    def put_from(self, key: str, buf: Any, size: int | None = None, **kw: Any) -> None:
        loc = self._locate(buf, int(size or 0))
        self._request(
            {"op": "put_from", "key": key, "id": loc[0], "off": loc[1], "n": loc[2], "kw": kw}
        )

    def get_into(self, key: str, buf: Any, size: int | None = None) -> int:
        loc = self._locate(buf, int(size or 0))
        return int(
            self._request({"op": "get_into", "key": key, "id": loc[0], "off": loc[1], "n": loc[2]})
        )

    def batch_put_from(
        self,
        keys: Sequence[str],
        bufs: Sequence[Any],
        sizes: Sequence[int] | None = None,
        **kw: Any,
    ) -> list[BaseException | None]:
        out: list[BaseException | None] = [None] * len(keys)
        self._batch("batch_put_from", keys, bufs, sizes, out, {"kw": kw})
        return out

    def batch_get_into(
        self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None = None
    ) -> list[int | BaseException]:
        out: list[int | BaseException] = [0] * len(keys)
        self._batch("batch_get_into", keys, bufs, sizes, out, {})
        return out

    def _batch(
        self,
        op: str,
        keys: Sequence[str],
        bufs: Sequence[Any],
        sizes: Sequence[int] | None,
        out: list[Any],
        extra: dict[str, Any],
    ) -> None:
        """One ``op`` request for the keys whose buffers lie in registered pool memory; a
        buffer outside it gets its InvalidArgument in ``out`` and is not sent."""
        if sizes is None or not len(keys) == len(bufs) == len(sizes):
            raise InvalidArgument("keys, buffers and sizes must have the same length")
        todo: list[int] = []
        locs: list[list[int]] = []
        for i, (b, n) in enumerate(zip(bufs, sizes, strict=True)):
            try:
                locs.append(self._locate(b, int(n)))
                todo.append(i)
            except InvalidArgument as exc:
                out[i] = exc
        if todo:
            res = self._request({"op": op, "keys": [keys[i] for i in todo], "bufs": locs, **extra})
            for i, r in zip(todo, res, strict=True):
                out[i] = r

    # ------------------------------------------------------------------ metadata
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._request({"op": "call", "name": name, "args": list(args), "kwargs": kwargs})

    def exists(self, key: str) -> bool:
        return bool(self._call("exists", key))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._call("batch_exists", list(keys))]

    def get_size(self, key: str) -> int:
        return int(self._call("get_size", key))

    def remove(self, key: str, *, force: bool = False) -> None:
        self._call("remove", key, force=bool(force))

    def batch_remove(
        self, keys: Sequence[str], *, force: bool = False
    ) -> list[BaseException | None]:
        return cast(
            "list[BaseException | None]", self._call("batch_remove", list(keys), force=bool(force))
        )

    def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        return int(self._call("remove_by_regex", pattern, force=bool(force)))

    def remove_all(self, *, force: bool = False) -> int:
        return int(self._call("remove_all", force=bool(force)))

    def keys_by_regex(self, pattern: str) -> list[str]:
        return [str(k) for k in self._call("keys_by_regex", pattern)]

    def query(self, key: str) -> dict[str, Any]:
        return dict(self._call("query", key))

    def stats(self) -> dict[str, Any]:
        return dict(self._call("stats"))


def _exchange(sock: socket.socket, req: dict[str, Any], fds: Sequence[int] = ()) -> Any:
    """Send one request and return the service's answer (the raw message)."""
    send_msg(sock, req, fds)
    answer, extra = recv_msg(sock)
    for fd in extra:  # the service passes none; never leak one
        os.close(fd)
    return answer


def _value(answer: Any) -> Any:
    """The value of an answer, or its error raised."""
    if not isinstance(answer, dict):
        raise StoreError(f"unexpected answer from the service: {answer!r}")
    if not answer.get("ok"):
        name, message = answer.get("error") or ["StoreError", "?"]
        raise make_error(str(name), str(message))
    return decode_result(answer.get("value"))


def _hung_up(sock: socket.socket) -> bool:
    """Whether the service closed this idle connection (it never writes unasked, so
    anything to read between calls is its end of file)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP)
    return bool(poller.poll(0))


def _dial(port: int) -> socket.socket | None:
    """One connect to the service's socket: None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(ipc_address(port))
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
            return None
        raise
    return sock


def _connect(where: str, port: int, wait_s: float) -> socket.socket | None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = _dial(port)
        except OSError as exc:
            logger.error("setup_dummy: cannot reach the client service at %s: %s", where, exc)
            return None
        if sock is not None:
            sock.settimeout(CALL_TIMEOUT_S)
            return sock
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


class DummyMethods:
    """``setup_dummy`` and ``alloc_from_mem_pool``, mixed into the store."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore
        _client: StoreClient | None
        _closed: bool
        _local_buffer_size: int

        def close(self) -> int: ...

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attach to the standalone client service (``mooncake-core client``) at
        ``server_address`` (``host:port`` on this host). 0, or -1 (one log line) when no
        service answers there within :data:`CONNECT_WAIT_S` seconds."""
        for name, value in (
            ("mem_pool_size", mem_pool_size),
            ("local_buffer_size", local_buffer_size),
        ):
            if _bad(value):
                raise TypeError(f"setup_dummy(): {name} must be a non-negative int, got {value!r}")
        if isinstance(server_address, bytes):
            server_address = server_address.decode(errors="replace")
        if not isinstance(server_address, str):
            raise TypeError(f"setup_dummy(): server_address must be str, got {server_address!r}")
        if self._client is not None:
            if not isinstance(self._client, DummyClient):
                logger.error("setup_dummy: this store is already set up with setup()")
                return -600
            self.close()  # attach again, as the published store does
        host, sep, port = server_address.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            logger.error(
                "setup_dummy: server_address %r is not HOST:PORT of a client service",
                server_address,
            )
            return -1
        sock = _connect(server_address, int(port), CONNECT_WAIT_S)
        if sock is None:
            logger.error(
                "setup_dummy: no client service answers at %s after %.0fs "
                "(start one: mooncake-core client --port %s ...)",
                server_address,
                CONNECT_WAIT_S,
                port,
            )
            return -1
        try:
            dummy = DummyClient(sock, server_address, int(port), local_buffer_size)
        except (MooncakeError, OSError, EOFError, ValueError) as exc:
            sock.close()
            logger.error("setup_dummy: attaching to %s failed: %s", server_address, exc)
            return -1
        # The compat store runs every call through self._client; a DummyClient provides the
        # StoreClient calls it uses and answers the others with DummyUnsupported (-1).
        self._client = cast("StoreClient", dummy)
        self._closed = False
        self._local_buffer_size = local_buffer_size
        logger.info(
            "attached to the client service at %s (pid %d)", server_address, dummy.service_pid
        )
        return 0

    def alloc_from_mem_pool(self, size: int, /) -> int:
        """``size`` bytes of shared memory the client service can read and write in place
        (after ``register_buffer``); its address, or 0 (one log line)."""
        if _bad(size):
            raise TypeError(f"alloc_from_mem_pool(): size must be a non-negative int, got {size!r}")
        client = self._client
        if not isinstance(client, DummyClient):
            logger.error("alloc_from_mem_pool: the store is not attached with setup_dummy()")
            return 0
        if size == 0:
            logger.error("alloc_from_mem_pool: size is 0")
            return 0
        try:
            return client.allocate(size)
        except (StoreError, OSError) as exc:
            logger.error("alloc_from_mem_pool(%d): %s", size, exc)
            return 0
