"""READV: runs of small TCP reads to one peer go out as one request (protocol version 2)."""

from __future__ import annotations

import hashlib
import random
import socket
from typing import Any

import numpy as np
import pytest

from mooncake_core.errors import InvalidRequest
from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_core.transfer.memory import host_view
from mooncake_core.transfer.transports.tcp import TCPConnection
from mooncake_core.transfer.types import READ, WorkItem

pytestmark = pytest.mark.timeout(60)


def test_a_batch_of_small_reads_goes_as_readv_requests_and_lands_byte_exact(
    spawn_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 scattered reads of 3-9 KB (LMDeploy's per-layer block segments, scaled down)
    travel as a few READV requests and each lands at its own local place; bytes between
    them stay untouched."""
    peer = spawn_peer()
    size = 1 << 20
    raddr = peer.call("alloc", size=size)["addr"]
    peer.call("fill", addr=raddr, length=size, seed=7)
    eng = TransferEngine(
        transfer={
            "slice_size": 64 << 10,
            "connections_per_peer": 2,
            "timeout_s": 10,
            "shm": False,
        }
    ).start()
    try:
        units: list[int] = []
        orig = TCPConnection._units

        def spy(self: TCPConnection, items: list[WorkItem]) -> list[list[WorkItem]]:
            out = orig(self, items)
            units.extend(len(u) for u in out)
            return out

        monkeypatch.setattr(TCPConnection, "_units", spy)
        local = eng.allocate(size)
        host_view(local.addr, size)[:] = b"\xee" * size
        rng = random.Random(3)
        slots = rng.sample(range(size // 10_000), 40)
        reqs, want = [], []
        for i, slot in enumerate(slots):
            n = rng.randrange(3000, 9000)
            src = raddr + slot * 10_000
            reqs.append(TransferRequest("read", peer.name, local.addr + i * 10_000, n, src))
            want.append((i * 10_000, n, src - raddr))
        batch = eng.transfer(reqs)
        assert all(st.state == "completed" for st in batch.statuses)
        assert max(units) > 1 and len(units) < len(reqs), units
        got = bytes(host_view(local.addr, size))
        rem = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
        for off, n, roff in want:
            assert got[off : off + n] == rem[roff : roff + n]
            assert got[off + n : off + n + 1] == b"\xee"  # nothing past the read
    finally:
        eng.close()


def _items(addrs: list[tuple[int, int]], buf: bytearray) -> list[WorkItem]:
    mv = memoryview(buf)
    out, off = [], 0
    for raddr, n in addrs:
        out.append(WorkItem(0, READ, 0, mv[off : off + n], raddr, n))
        off += n
    return out


def test_the_peer_refuses_only_the_bad_range_of_a_readv_and_a_malformed_one_closes(
    spawn_peer: Any,
) -> None:
    """A client that skips our bounds checks: the peer names the one range outside its
    memory (it fails, the others stay pending for a retry), serves the next READV on the
    same connection, and closes a connection whose READV is malformed."""
    from mooncake_core.transfer.protocol import MAGIC, REQ, RESP, Op, Status

    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 16)["addr"]
    peer.call("fill", addr=raddr, length=1 << 16, seed=1)
    host, port = peer.name.rsplit(":", 1)
    conn = TCPConnection(host, int(port), secret="", timeout=5, peer=peer.name)
    try:
        assert conn.peer_version >= 2
        conn.readv_bytes = 1 << 16
        buf = bytearray(3000)
        items = _items([(raddr, 1000), (raddr - 8192, 1000), (raddr + 5000, 1000)], buf)
        conn.run(items)
        assert isinstance(items[1].error, InvalidRequest)
        assert "not inside any registered memory" in str(items[1].error)
        assert not items[0].done and items[0].error is None
        assert not items[2].done and items[2].error is None
        items = _items(
            [(raddr, 1000), (raddr + 5000, 1000), (raddr + 60000, 3000)], buf := bytearray(5000)
        )
        conn.run(items)
        assert all(it.done for it in items)
        data = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
        assert bytes(buf) == data[:1000] + data[5000:6000] + data[60000:63000]
        conn.sock.sendall(REQ.pack(MAGIC, Op.READV, 0, 0, 9, 0, 0, 0))  # no ranges
        head = conn.sock.recv(RESP.size, socket.MSG_WAITALL)
        assert RESP.unpack(head)[1] == Status.BAD_REQUEST
        assert conn.sock.recv(1) == b""  # closed
    finally:
        conn.close()
    # the peer still serves everyone else
    eng = TransferEngine(transfer={"shm": False}).start()
    try:
        out = bytearray(100)
        eng.read(peer.name, out, raddr + 10)
        want = hashlib.sha256(
            np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()[10:110]
        )
        assert hashlib.sha256(out).hexdigest() == want.hexdigest()
    finally:
        eng.close()
