"""The raw-TCP reference of the benchmarks: plain Python sockets, no engine.

Protocol on one connection: a 9-byte header ``<BQ`` (op, n); op 1 = the client writes
``n`` bytes into the server's buffer and waits for a 1-byte ack; op 2 = the client reads
``n`` bytes from it. :func:`start_server` serves every connection on its own thread;
:class:`RawClient` is the measuring side. Used by ``bench transfer`` and ``bench store``.
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["RawClient", "start_server"]

_HDR = struct.Struct("<BQ")


def start_server(buf: memoryview) -> int:
    """Listen on 127.0.0.1 (any port) in a daemon thread, serving ``buf``; returns the port."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    threading.Thread(target=_accept, args=(lsock, buf), daemon=True).start()
    return int(lsock.getsockname()[1])


def _accept(sock: socket.socket, mv: memoryview) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=_serve, args=(conn, mv), daemon=True).start()


def _serve(conn: socket.socket, mv: memoryview) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(_HDR.size)
    try:
        while True:
            got = 0
            while got < _HDR.size:
                k = conn.recv_into(memoryview(hdr)[got:])
                if not k:
                    return
                got += k
            op, n = _HDR.unpack(hdr)
            if op == 1:
                got = 0
                while got < n:
                    k = conn.recv_into(mv[got:n], n - got)
                    if not k:
                        return
                    got += k
                conn.sendall(b"k")
            else:
                conn.sendall(mv[:n])
    except OSError:
        return
    finally:
        conn.close()


class RawClient:
    """One connection to a :func:`start_server` server."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(1)

    def write(self, mv: memoryview) -> None:
        self.sock.sendall(_HDR.pack(1, len(mv)))
        self.sock.sendall(mv)
        self.sock.recv_into(self.ack, 1)

    def read(self, mv: memoryview) -> None:
        self.sock.sendall(_HDR.pack(2, len(mv)))
        got, n = 0, len(mv)
        while got < n:
            got += self.sock.recv_into(mv[got:], n - got)

    def close(self) -> None:
        self.sock.close()
