"""``mooncake.engine``'s RPC channel: ``RpcInterface`` (``CoroRPCInterface``), ``ReceivedData``,
``ReceivedTensor``, ``create_rpc_client``, ``create_rpc_server``.

The published wheel (0.3.13) sends bytes and tensors to a ``"host:port"`` over coro_rpc; we
send them over plain TCP with our own framing (the two do not talk to each other). What a
caller sees follows the wheel, as measured by running it (docs/compat.md, "RPC channel"):

- ``initialize_server(addr)`` / ``initialize(addr)`` / ``initialize_client()`` only record the
  configuration and return True; ``start_server_async()`` binds (port 0: any free port) and
  returns False when there is no address, the address is bad or taken, or it already runs.
- ``send_data(target, data)`` takes ``bytes`` only (other types: ``TypeError``), waits until the
  server's callback has returned, and gives 0, or -1 when the target cannot be reached.
- The data callback receives a dict ``{"source": ..., "data": bytes}`` (ours is a
  :class:`ReceivedData`, a dict that also has the published attributes). ``send_tensor`` sends a
  CPU tensor's bytes; without a tensor callback they reach the data callback as raw bytes, as
  in the wheel; with one, it receives a :class:`ReceivedTensor` (shape, dtype, bytes).
- At most ``thread_count`` callbacks run at once; a callback that raises is logged, and the
  sender still gets 0.

Differences (the wheel's behaviour there is a defect): ``start_server()`` blocks until
``stop_server()`` (the wheel's holds the GIL forever); ``send_*_async`` return an asyncio
future (the wheel's raise a pybind11 GIL ``RuntimeError``); a send to a server that closes
the connection gives -1 (the wheel's gives 0); a non-contiguous tensor is sent contiguous
(the wheel sends the raw memory behind ``data_ptr()``); ``create_rpc_server()`` listens on
127.0.0.1:8080, not 0.0.0.0:8080; ``source`` is the sender's ``"ip:port"`` (the wheel's is "").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "RpcInterface",
    "CoroRPCInterface",
    "ReceivedData",
    "ReceivedTensor",
    "create_rpc_client",
    "create_rpc_server",
]

logger = logging.getLogger(__name__)

_MAGIC = b"MCR1"
#: magic, kind (0 data, 1 tensor), metadata length, payload length
_HEAD = struct.Struct("!4sBIQ")
_REPLY = struct.Struct("!i")
_DATA, _TENSOR = 0, 1
_MAX_META = 1 << 20
#: where ``create_rpc_server()`` listens (the wheel: 0.0.0.0:8080; we default to loopback)
DEFAULT_SERVER_ADDRESS = "127.0.0.1:8080"
_NO_CTOR = object()


def _split(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ValueError naming the address when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"bad address {address!r} (want host:port)")
    return host.strip("[]") or "localhost", int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf


class ReceivedData(dict):  # type: ignore[type-arg]
    """What the data callback receives: the published dict ``{"source", "data"}``, with the
    published ``ReceivedData`` attributes as well. Not constructible from Python."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args or args[0] is not _NO_CTOR:
            raise TypeError("mooncake.engine.ReceivedData: No constructor defined!")
        super().__init__(source=args[1], data=args[2])

    @property
    def source_address(self) -> str:
        """The sender's ``"ip:port"``."""
        return str(self["source"])

    @property
    def data_size(self) -> int:
        return len(self["data"])

    def get_bytes(self) -> bytes:
        return bytes(self["data"])

    def get_memory_view(self) -> memoryview:
        return memoryview(self["data"])


class ReceivedTensor:
    """What the tensor callback receives: the tensor's bytes with its shape and dtype
    (``torch.frombuffer(t.get_memory_view(), dtype=...).reshape(t.shape)`` rebuilds it).
    Not constructible from Python."""

    def __init__(self, *args: Any) -> None:
        if not args or args[0] is not _NO_CTOR:
            raise TypeError("mooncake.engine.ReceivedTensor: No constructor defined!")
        _, source, data, shape, dtype = args
        self._data: bytearray = data
        self._source: str = source
        self._shape: list[int] = [int(x) for x in shape]
        self._dtype: str = str(dtype)

    @property
    def source_address(self) -> str:
        """The sender's ``"ip:port"``."""
        return self._source

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def dtype(self) -> str:
        """``str(tensor.dtype)`` on the sender, e.g. ``"torch.float32"``."""
        return self._dtype

    @property
    def total_bytes(self) -> int:
        return len(self._data)

    def get_data_size(self) -> int:
        return len(self._data)

    def get_data_as_bytes(self) -> bytes:
        return bytes(self._data)

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)

    def __repr__(self) -> str:
        return f"ReceivedTensor(shape={self.shape}, dtype={self.dtype}, {self.total_bytes} bytes)"


def _tensor_payload(tensor: Any) -> tuple[memoryview, dict[str, Any], Any] | None:
    """(bytes view, metadata, the object keeping the memory alive) of a CPU tensor, or None."""
    needed = ("data_ptr", "numel", "element_size", "shape", "dtype")
    if not all(hasattr(tensor, a) for a in needed):
        logger.error("send_tensor: not a tensor (needs %s): %s", ", ".join(needed), type(tensor))
        return None
    device = getattr(tensor, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        logger.error("send_tensor: only CPU tensors are supported here, not %s", device)
        return None
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        tensor = tensor.contiguous()
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    meta = {"shape": [int(x) for x in tensor.shape], "dtype": str(tensor.dtype)}
    if nbytes == 0:
        return memoryview(b""), meta, tensor
    raw = (ctypes.c_ubyte * nbytes).from_address(int(tensor.data_ptr()))
    return memoryview(raw).cast("B"), meta, tensor


class RpcInterface:
    """The published ``mooncake.engine.RpcInterface``: a server that hands received bytes and
    tensors to callbacks, and a client with a pool of connections per target."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._address = ""
        self._threads = 8
        self._timeout = 30.0
        self._pool_size = 100
        self._client_ready = False
        self._data_cb: Callable[[Any], Any] | None = None
        self._tensor_cb: Callable[[Any], Any] | None = None
        self._idle: dict[str, list[socket.socket]] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._slots = threading.Semaphore(8)
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ configuration
    def initialize(
        self,
        listen_address: str = "",
        thread_count: int = 0,
        timeout_seconds: int = 30,
        pool_size: int = 100,
    ) -> bool:
        """Client, and server on ``listen_address`` when one is given. Returns True."""
        self.initialize_client(pool_size, timeout_seconds)
        if listen_address:
            self.initialize_server(listen_address, thread_count or 8, timeout_seconds)
        return True

    def initialize_client(self, pool_size: int = 100, timeout_seconds: int = 30) -> bool:
        """Up to ``pool_size`` idle connections kept per target; ``timeout_seconds`` for a
        connect and for the reply. Returns True."""
        self._pool_size = max(1, int(pool_size))
        self._timeout = float(timeout_seconds) if timeout_seconds > 0 else 30.0
        self._client_ready = True
        return True

    def initialize_server(
        self, listen_address: str, thread_count: int = 8, timeout_seconds: int = 30
    ) -> bool:
        """Record where ``start_server*`` listens (``host:port``; port 0: any free port) and how
        many callbacks may run at once. Returns True (a bad address fails at start)."""
        self._address = str(listen_address)
        self._threads = max(1, int(thread_count) or 8)
        self._slots = threading.Semaphore(self._threads)
        self._timeout = float(timeout_seconds) if timeout_seconds > 0 else 30.0
        self._client_ready = True
        return True

    def set_data_receive_callback(self, callback: Callable[[Any], Any], /) -> None:
        """``callback(received)`` for each ``send_data`` (and ``send_tensor`` without a tensor
        callback); ``received`` is a dict ``{"source", "data"}`` (a :class:`ReceivedData`)."""
        self._data_cb = callback

    def set_tensor_receive_callback(self, callback: Callable[[Any], Any], /) -> None:
        """``callback(tensor)`` with a :class:`ReceivedTensor` for each ``send_tensor``."""
        self._tensor_cb = callback

    # ------------------------------------------------------------------ server
    def start_server_async(self) -> bool:
        """Listen and serve on background threads. False when no address was configured,
        the address is bad or in use, or the server already runs."""
        with self._lock:
            if self._listener is not None or not self._address:
                return False
            try:
                host, port = _split(self._address)
                listener = socket.create_server((host, port), backlog=128)
            except (OSError, ValueError) as exc:
                logger.error("RPC server on %r cannot start: %s", self._address, exc)
                return False
            listener.settimeout(0.2)
            self._listener = listener
            self._stopped.clear()
            self._accept_thread = threading.Thread(
                target=self._accept_loop, args=(listener,), name="mc-rpc-accept", daemon=True
            )
            self._accept_thread.start()
        logger.info("RPC server listening on %s:%d", *listener.getsockname()[:2])
        return True

    def start_server(self) -> bool:
        """Start, then block until :meth:`stop_server` (from another thread or a callback).
        False when the server cannot start."""
        if not self.start_server_async():
            return False
        self._stopped.wait()
        return True

    def stop_server(self) -> None:
        """Stop listening and close this end's connections. Idempotent."""
        with self._lock:
            listener, self._listener = self._listener, None
            thread, self._accept_thread = self._accept_thread, None
            conns, self._conns = set(self._conns), set()
            idle, self._idle = self._idle, {}
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for socks in idle.values():
            for s in socks:
                s.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        self._stopped.set()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop_server
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._listener is not listener:
                    conn.close()
                    return
                self._conns.add(conn)
            source = f"{peer[0]}:{peer[1]}"
            threading.Thread(
                target=self._serve, args=(conn, source), name="mc-rpc-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, source: str) -> None:
        try:
            while True:
                try:
                    head = _recv_exact(conn, _HEAD.size)
                except (ConnectionError, OSError):
                    return
                magic, kind, meta_len, size = _HEAD.unpack(head)
                if magic != _MAGIC or kind not in (_DATA, _TENSOR) or meta_len > _MAX_META:
                    logger.warning("RPC server: a bad frame from %s; closing it", source)
                    return
                meta = json.loads(bytes(_recv_exact(conn, meta_len))) if meta_len else {}
                payload = _recv_exact(conn, size)
                self._deliver(kind, source, payload, meta)
                conn.sendall(_REPLY.pack(0))
        except (ConnectionError, OSError, ValueError) as exc:
            logger.debug("RPC connection from %s: %s", source, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _deliver(self, kind: int, source: str, payload: bytearray, meta: dict[str, Any]) -> None:
        item: Any
        if kind == _TENSOR and self._tensor_cb is not None:
            cb: Callable[[Any], Any] | None = self._tensor_cb
            item = ReceivedTensor(_NO_CTOR, source, payload, meta["shape"], meta["dtype"])
        else:
            cb = self._data_cb
            item = ReceivedData(_NO_CTOR, source, bytes(payload))
        if cb is None:
            logger.warning("RPC server: no receive callback set; %d bytes dropped", len(payload))
            return
        with self._slots:
            try:
                cb(item)
            except Exception:
                logger.exception("RPC server: the receive callback raised")

    # ------------------------------------------------------------------ client
    def send_data(self, target_address: str, data: object) -> int:
        """Send ``data`` (bytes) to the server at ``target_address``; 0 once its callback
        returned, -1 when it cannot be reached."""
        if not isinstance(data, bytes):
            raise TypeError(f"Object of type '{type(data).__name__}' is not an instance of 'bytes'")
        return self._send(target_address, _DATA, b"", memoryview(data))

    def send_tensor(self, target_address: str, tensor: object) -> int:
        """Send a CPU tensor's bytes, shape and dtype; 0, or -1 (not a tensor, unreachable)."""
        got = _tensor_payload(tensor)
        if got is None:
            return -1
        view, meta, keep = got
        try:
            return self._send(target_address, _TENSOR, json.dumps(meta).encode(), view)
        finally:
            del keep

    def send_data_async(self, target_address: str, data: object, loop: object) -> object:
        """:meth:`send_data` on a worker thread; an :class:`asyncio.Future` of ``loop`` that
        gives its int."""
        if not isinstance(data, bytes):
            raise TypeError(f"Object of type '{type(data).__name__}' is not an instance of 'bytes'")
        return self._in_thread(loop, lambda: self.send_data(target_address, data))

    def send_tensor_async(self, target_address: str, tensor: object, loop: object) -> object:
        """:meth:`send_tensor` on a worker thread; an :class:`asyncio.Future` of ``loop``."""
        return self._in_thread(loop, lambda: self.send_tensor(target_address, tensor))

    def _in_thread(self, loop: object, fn: Callable[[], int]) -> asyncio.Future[int]:
        ev = loop if isinstance(loop, asyncio.AbstractEventLoop) else asyncio.get_running_loop()
        fut: asyncio.Future[int] = ev.create_future()

        def settle(rc: int | None, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(int(rc or 0))

        def run() -> None:
            try:
                rc = fn()
            except Exception as exc:  # handed to the awaiting coroutine
                ev.call_soon_threadsafe(settle, None, exc)
                return
            ev.call_soon_threadsafe(settle, rc, None)

        threading.Thread(target=run, name="mc-rpc-send", daemon=True).start()
        return fut

    def _send(self, target: str, kind: int, meta: bytes, payload: memoryview) -> int:
        if not self._client_ready:
            logger.error("RPC send to %r: the client is not initialized", target)
            return -1
        try:
            host, port = _split(str(target))
        except ValueError as exc:
            logger.error("RPC send failed: %s", exc)
            return -1
        head = _HEAD.pack(_MAGIC, kind, len(meta), payload.nbytes)
        for attempt in range(2):
            sock, reused = self._checkout(target, host, port)
            if sock is None:
                return -1
            try:
                sock.sendall(head + meta)
                if payload.nbytes:
                    sock.sendall(payload)
                (rc,) = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
            except (ConnectionError, OSError) as exc:
                sock.close()
                if reused and attempt == 0:
                    continue  # an idle connection the server had closed: one fresh try
                logger.error("RPC send to %s failed: %s", target, exc)
                return -1
            self._checkin(target, sock)
            return int(rc)
        return -1

    def _checkout(self, target: str, host: str, port: int) -> tuple[socket.socket | None, bool]:
        with self._lock:
            idle = self._idle.get(target)
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection((host, port), timeout=self._timeout)
        except OSError as exc:
            logger.error("RPC send to %s failed: cannot connect: %s", target, exc)
            return None, False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _checkin(self, target: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(target, [])
            if len(idle) < self._pool_size:
                idle.append(sock)
                return
        sock.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_server()


#: the published name of the same class
CoroRPCInterface = RpcInterface


def create_rpc_client(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """An initialized client (10 idle connections per target, as the wheel's). ``local_rank``
    and ``world_size`` are accepted and, as in the wheel, change nothing."""
    rpc = RpcInterface()
    rpc.initialize_client(pool_size=10)
    return rpc


def create_rpc_server(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """A client that also serves on :data:`DEFAULT_SERVER_ADDRESS` once started (the wheel:
    0.0.0.0:8080 whatever the rank); call ``initialize_server(addr)`` to pick another."""
    rpc = RpcInterface()
    rpc.initialize_client(pool_size=10)
    rpc.initialize_server(DEFAULT_SERVER_ADDRESS)
    return rpc
