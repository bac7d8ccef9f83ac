"""Small socket helpers shared by the TCP transport and the listener (zero-copy I/O)."""

from __future__ import annotations

import socket

__all__ = ["recv_exact", "recv_views", "send_parts", "tune_socket"]

_SOCK_BUF = 4 << 20


def tune_socket(sock: socket.socket) -> None:
    """Disable Nagle and enlarge kernel buffers (best effort)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock`` with ``recv_into``; no intermediate bytes objects.

    Returns False on a clean EOF before the first byte; raises ConnectionError on an EOF
    in the middle.
    """
    n = len(view)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


def _advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (moved by one ``sendmsg``/``recvmsg_into``): the
    buffers they fill whole, and the front of the next one."""
    done = 0
    while n and n >= len(bufs[done]):
        n -= len(bufs[done])
        done += 1
    del bufs[:done]
    if n:
        bufs[0] = bufs[0][n:]


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view of ``views`` in order from ``sock`` (scatter ``recvmsg_into``, at most
    1024 buffers a call); raises ConnectionError on an EOF before all are full."""
    bufs = [v for v in views if len(v)]
    want = sum(len(v) for v in bufs)
    got = 0
    while bufs:
        k = sock.recvmsg_into(bufs[:1024])[0]
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {want} bytes")
        got += k
        _advance(bufs, k)


def send_parts(sock: socket.socket, parts: list[memoryview | bytes]) -> None:
    """Send all ``parts`` with ``sendmsg`` (scatter-gather; handles partial sends)."""
    bufs = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
    bufs = [b for b in bufs if len(b)]
    while bufs:
        _advance(bufs, sock.sendmsg(bufs[:64]))
