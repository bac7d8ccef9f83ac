"""Transfer engine between real processes over TCP and shared memory."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from mooncake_core.errors import AuthError, InvalidRequest, PeerUnreachable, TransportError
from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_core.transfer.transports.tcp import TCPTransport

pytestmark = pytest.mark.timeout(120)


def sha(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


@pytest.fixture()
def engine() -> Any:
    eng = TransferEngine(
        transfer={"slice_size": 64 << 10, "connections_per_peer": 3, "timeout_s": 10}
    ).start()
    yield eng
    eng.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("remote_kind", ["alloc", "register_numpy"])
def test_round_trip_byte_exact(
    engine: TransferEngine, spawn_peer: Any, transport: str, remote_kind: str
) -> None:
    peer = spawn_peer()
    size = 3 << 20
    raddr = peer.call(remote_kind, size=size)["addr"]
    rng = np.random.default_rng(1)
    local = engine.allocate(size)
    # sizes that are not multiples of the 64 KiB slice, unaligned offsets on both ends
    for length, loff, roff in [
        (1, 0, 0),
        (65535, 3, 7),
        (65537, 1, 12345),
        (1_000_003, 17, 999),
        (2_500_001, 5, 11),
    ]:
        data = rng.integers(0, 256, length, dtype=np.uint8)
        local.view[loff : loff + length] = data.tobytes()
        engine.write(peer.name, local.addr + loff, raddr + roff, length, transport=transport)
        assert peer.call("digest", addr=raddr + roff, length=length)["sha"] == sha(data)
        back = np.zeros(length + 2, dtype=np.uint8)
        engine.read(peer.name, back[1:-1], raddr + roff, transport=transport)
        assert sha(back[1:-1]) == sha(data)
        assert back[0] == 0 and back[-1] == 0  # nothing written outside the target


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_many_batches_in_flight(engine: TransferEngine, spawn_peer: Any, transport: str) -> None:
    peer = spawn_peer()
    n, each = 24, 200_003
    raddr = peer.call("alloc", size=n * each)["addr"]
    peer.call("fill", addr=raddr, length=n * each, seed=7)
    expected = np.random.default_rng(7).integers(0, 256, n * each, dtype=np.uint8)
    dests = [np.zeros(each, dtype=np.uint8) for _ in range(n)]
    batches = [
        engine.submit(
            [
                TransferRequest(
                    "read", peer.name, dests[i], None, raddr + i * each, transport=transport
                )
            ]
        )
        for i in range(n)
    ]
    for b in batches:
        b.wait(30)
        assert [s.state for s in b.statuses] == ["completed"]
    assert sha(np.concatenate(dests)) == sha(expected)
    # one batch with many requests, mixed reads and writes to distinct ranges
    src = np.random.default_rng(8).integers(0, 256, n * each, dtype=np.uint8)
    reqs = [
        TransferRequest(
            "write",
            peer.name,
            src[i * each : (i + 1) * each],
            None,
            raddr + i * each,
            transport=transport,
        )
        for i in range(n)
    ]
    b = engine.submit(reqs)
    b.wait(30)
    assert all(s.state == "completed" and s.transferred == each for s in b.statuses)
    assert peer.call("digest", addr=raddr, length=n * each)["sha"] == sha(src)


def test_shm_is_chosen_on_same_host_and_tcp_when_forced(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    info = engine.peer(peer.name)
    assert [t.name for t in engine._choose(info, None)][0] == "shm"
    tcp = engine.transports["tcp"]
    assert isinstance(tcp, TCPTransport)
    engine.write(peer.name, bytearray(b"x" * 1000), raddr)
    assert tcp._pools.get(peer.name) is None or all(
        c is None for c in tcp._pools[peer.name].conns[1:]
    )
    engine.write(peer.name, bytearray(b"y" * 1000), raddr, transport="tcp")
    assert peer.call("digest", addr=raddr, length=1000)["sha"] == sha(b"y" * 1000)


def test_peer_killed_mid_transfer_gives_clear_error_and_engine_serves_others(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    victim, other = spawn_peer(), spawn_peer()
    size = 64 << 20
    vaddr = victim.call("alloc", size=size)["addr"]
    oaddr = other.call("alloc", size=1 << 20)["addr"]
    src = np.ones(size, dtype=np.uint8)
    errors: list[BaseException] = []
    started = threading.Event()

    def pump() -> None:
        try:
            for _ in range(200):
                engine.write(victim.name, src, vaddr, transport="tcp")
                started.set()
        except TransportError as exc:
            errors.append(exc)
        started.set()

    t = threading.Thread(target=pump)
    t.start()
    assert started.wait(30)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(20)
    assert not t.is_alive(), "transfer to a killed peer hung"
    assert time.monotonic() - t0 < 12  # within the 10 s transfer timeout (+ slack)
    assert errors, "writes to a killed peer reported success"
    assert victim.name in str(errors[0])
    # the engine still serves its other peers
    data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
    engine.write(other.name, data, oaddr, transport="tcp")
    assert other.call("digest", addr=oaddr, length=1 << 20)["sha"] == sha(data)


def test_killed_peer_over_shm_is_reported(engine: TransferEngine, spawn_peer: Any) -> None:
    victim = spawn_peer()
    vaddr = victim.call("alloc", size=1 << 20)["addr"]
    engine.write(victim.name, bytearray(1000), vaddr)
    victim.kill()
    with pytest.raises(TransportError, match=victim.name.split(":")[0]):
        engine.write(victim.name, bytearray(1000), vaddr)


def test_a_dead_peers_mapping_is_unmapped_only_when_no_copy_runs(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    """Copies from a peer's mapping run in several threads. When one of them finds the peer
    dead, the mapping must stay until the others are done: unmapping under a running
    ``memmove`` would crash the process."""
    victim = spawn_peer()
    size = 64 << 20
    vaddr = victim.call("alloc", size=size)["addr"]
    engine.read(victim.name, np.zeros(1000, dtype=np.uint8), vaddr, transport="shm")  # mapped now
    shm = engine.transports["shm"]
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:  # large copies, split over threads, again and again
        dst = np.zeros(size, dtype=np.uint8)
        while not stop.is_set():
            try:
                engine.read(victim.name, dst, vaddr, transport="shm")
            except TransportError as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    victim.kill()
    with pytest.raises(TransportError):  # this one notices the death and drops the mapping
        engine.write(victim.name, bytearray(1000), vaddr, transport="shm")
    stop.set()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert all(victim.name in str(e) for e in errors), errors
    assert not shm._maps and not shm._retired and not shm._inflight  # type: ignore[attr-defined]
    # the rule itself: while a copy with that peer is in flight, a forgotten mapping is only
    # retired; copies with other peers do not hold it up
    other = spawn_peer()
    oaddr = other.call("alloc", size=1 << 20)["addr"]
    engine.read(other.name, bytearray(1000), oaddr, transport="shm")
    ((mm, _base),) = [v for k, v in shm._maps.items() if k[0] == other.pid]  # type: ignore[attr-defined]
    with shm._lock:  # type: ignore[attr-defined]
        shm._inflight[other.pid] = 1  # type: ignore[attr-defined]
        shm._inflight[-1] = 1  # type: ignore[attr-defined]  # another peer's copy
    shm.forget(other.pid)  # type: ignore[attr-defined]
    assert not mm.closed and shm._retired == [(other.pid, mm)]  # type: ignore[attr-defined]
    with shm._lock:  # type: ignore[attr-defined]
        del shm._inflight[other.pid]  # type: ignore[attr-defined]
    shm._close_retired()  # type: ignore[attr-defined]
    assert mm.closed and not shm._retired  # type: ignore[attr-defined]
    with shm._lock:  # type: ignore[attr-defined]
        del shm._inflight[-1]  # type: ignore[attr-defined]


def test_a_peer_that_exits_is_unmapped_though_nothing_is_sent_to_it_again(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    """A store client reads from a peer's segment, the peer dies, the master drops its
    segment, and no transfer goes to it again: the mapping (the dead peer's whole segment,
    kept alive by us) must still go, found by the sweep that transfers to other peers run."""
    from mooncake_core.bench.soak_procs import mapped_engine_memory
    from mooncake_core.transfer.transports import shm as shm_mod

    victim, other = spawn_peer(), spawn_peer()
    vaddr = victim.call("alloc", size=8 << 20)["addr"]
    oaddr = other.call("alloc", size=1 << 20)["addr"]
    shm = engine.transports["shm"]
    engine.read(victim.name, bytearray(1000), vaddr, transport="shm")
    engine.read(other.name, bytearray(1000), oaddr, transport="shm")
    assert shm.mapped_pids() >= {victim.pid, other.pid}  # type: ignore[attr-defined]
    # what the soak's check reads (/proc/self/maps) sees the same
    assert mapped_engine_memory(os.getpid()).get(victim.pid, 0) >= 8 << 20
    (mm,) = [mm for k, (mm, _b) in shm._maps.items() if k[0] == victim.pid]  # type: ignore[attr-defined]
    victim.kill()
    deadline = time.monotonic() + 10 + shm_mod.SWEEP_S
    while victim.pid in shm.mapped_pids() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        engine.read(other.name, bytearray(1000), oaddr, transport="shm")  # only to the live one
        time.sleep(0.05)
    assert victim.pid not in shm.mapped_pids(), "the dead peer's segment is still mapped"  # type: ignore[attr-defined]
    assert mm.closed
    assert other.pid in shm.mapped_pids()  # type: ignore[attr-defined]  # the live one is kept
    assert victim.pid not in mapped_engine_memory(os.getpid())


def test_broken_connection_is_retried_and_completes(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    peer = spawn_peer()
    size = 4 << 20
    raddr = peer.call("alloc", size=size)["addr"]
    tcp = engine.transports["tcp"]
    assert isinstance(tcp, TCPTransport)
    broken = {"n": 0}

    def hook(conn: Any) -> bool:
        broken["n"] += 1
        return broken["n"] == 5  # break one connection once, mid-batch

    tcp.fault_hook = hook
    try:
        data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
        engine.write(peer.name, data, raddr, transport="tcp")
    finally:
        tcp.fault_hook = None
    assert tcp.retried_slices > 0
    assert peer.call("digest", addr=raddr, length=size)["sha"] == sha(data)
    back = np.zeros(size, dtype=np.uint8)
    broken["n"] = 0
    tcp.fault_hook = hook
    try:
        engine.read(peer.name, back, raddr, transport="tcp")
    finally:
        tcp.fault_hook = None
    assert sha(back) == sha(data)


def test_a_connection_closed_by_another_thread_is_retried_not_raised(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    """A thread can take a pooled connection just before another thread drops it (a transfer
    that found the peer dead closes all its connections): the socket is then closed under it.
    That is a failed connection to retry, never a raw OSError (a CI run got EBADF from it)."""
    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    engine.write(peer.name, bytearray(100), raddr, transport="tcp")  # connections exist now
    tcp = engine.transports["tcp"]
    assert isinstance(tcp, TCPTransport)
    for conn in tcp._pools[peer.name].conns:  # type: ignore[attr-defined]
        if conn is not None:
            conn.sock.close()  # closed, but not yet marked broken: the window of the race
    data = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    engine.write(peer.name, memoryview(data.data).cast("B"), raddr + 64, transport="tcp")
    assert peer.call("digest", addr=raddr + 64, length=5000)["sha"] == sha(data)
    assert tcp.retried_slices >= 1


def test_single_slice_requests_take_the_direct_path_and_keep_retries_errors_and_stats(
    engine: TransferEngine, spawn_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request that fits one slice, to a known peer, skips the batch planner (the store's hot
    path); it must still retry a broken connection, count bytes and fail exactly like the
    planner."""
    peer = spawn_peer()
    size = 60_001  # one 64 KiB slice
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    tcp = engine.transports["tcp"]
    assert isinstance(tcp, TCPTransport)
    engine.write(peer.name, bytearray(16), raddr, transport="tcp")  # resolves the peer
    planned = {"n": 0}
    plan = engine._plan

    def counting_plan(batch: Any) -> Any:
        planned["n"] += 1
        return plan(batch)

    monkeypatch.setattr(engine, "_plan", counting_plan)
    before = dict(engine.stats)
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    tcp.fault_hook = lambda conn: (
        tcp.fault_hook is not None and tcp.retried_slices == 0
    )  # break the first send
    try:
        batch = engine.transfer(
            TransferRequest(
                "write",
                peer.name,
                memoryview(data.data).cast("B"),
                None,
                raddr + 3,
                transport="tcp",
            )
        )
    finally:
        tcp.fault_hook = None
    assert tcp.retried_slices == 1 and batch.done() and batch.statuses[0].transferred == size
    assert peer.call("digest", addr=raddr + 3, length=size)["sha"] == sha(data)
    local = engine.allocate(1 << 16)  # a registered address as the local side
    engine.read(peer.name, local.addr + 5, raddr + 3, size, transport="tcp")
    assert sha(local.view[5 : 5 + size]) == sha(data)
    back = bytearray(size)
    engine.read(peer.name, back, raddr + 3, transport="tcp")
    assert sha(back) == sha(data)
    assert planned["n"] == 0, "single-slice requests went through the planner"
    assert engine.stats["bytes_written"] - before["bytes_written"] == size
    assert engine.stats["bytes_read"] - before["bytes_read"] == 2 * size
    # not of the direct shape: the planner handles them, with its messages
    with pytest.raises(InvalidRequest, match="not inside memory registered by peer"):
        engine.write(peer.name, bytearray(64), raddr + (1 << 20) - 10, transport="tcp")
    engine.read(peer.name, back, raddr + 3, transport="shm")
    assert planned["n"] == 1 and sha(back) == sha(data)  # shm: same host, direct as well
    os.kill(peer.pid, signal.SIGKILL)
    with pytest.raises(TransportError, match=r"request 0 \(read to peer"):
        engine.read(peer.name, back, raddr + 3, transport="tcp")


@pytest.mark.parametrize("slice_size", [4 << 20, 256 << 10])
def test_large_shm_copies_are_split_over_threads_and_stay_byte_exact(
    spawn_peer: Any, monkeypatch: pytest.MonkeyPatch, slice_size: int
) -> None:
    """A same-host copy of >= 2 MiB is cut into equal shares (64 KiB multiples) run by
    ``transfer.shm_copy_threads`` threads; every byte lands exactly once, both ways."""
    from mooncake_core.transfer.transports import shm as shm_mod

    calls: list[list[tuple[int, int, int]]] = []
    real = shm_mod._run_copies

    def record(jobs: list[tuple[int, int, int]]) -> None:
        calls.append(list(jobs))
        real(jobs)

    monkeypatch.setattr(shm_mod, "_run_copies", record)
    peer = spawn_peer()
    size = (5 << 20) + 13
    raddr = peer.call("alloc", size=size + 4096)["addr"] + 7  # odd addresses on both sides
    data = np.random.default_rng(5).integers(0, 256, size + 3, dtype=np.uint8)[3:]
    with TransferEngine(
        transfer={"slice_size": slice_size, "shm_copy_threads": 3, "timeout_s": 10}
    ) as eng:
        eng.write(peer.name, data, raddr, transport="shm")
        assert peer.call("digest", addr=raddr, length=size)["sha"] == sha(data)
        assert len(calls) == 3  # three threads' shares
        pieces = sorted((src, n) for part in calls for _dst, src, n in part)
        assert sum(n for _, n in pieces) == size
        assert all(
            a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False)
        )  # contiguous, no overlap
        shares = sorted(sum(n for *_, n in part) for part in calls)  # threads finish in any order
        assert shares[1] == shares[2] and shares[2] % (64 << 10) == 0 and 0 < shares[0] <= shares[2]
        calls.clear()
        back = np.zeros(size, dtype=np.uint8)
        eng.read(peer.name, back, raddr, transport="shm")
        assert sha(back) == sha(data) and len(calls) == 3
        calls.clear()
        eng.read(
            peer.name, back[: 1 << 20], raddr, transport="shm"
        )  # 1 MiB: one thread, not worth splitting
        assert len(calls) == 1 and bytes(back[: 1 << 20]) == bytes(data[: 1 << 20])


def test_shared_segments_can_live_in_a_tmpfs_directory(
    engine: TransferEngine, spawn_peer: Any
) -> None:
    """``transfer.shm_dir``: a peer's engine-allocated memory is an unnamed file there (a tmpfs
    mounted with huge=always gives it 2 MiB pages), and we still map it and copy directly."""
    import shutil
    import tempfile

    from mooncake_core.errors import SegmentError

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="mc-test-")
    try:
        peer = spawn_peer(env={"MOONCAKE_TRANSFER_SHM_DIR": d})
        raddr = peer.call("alloc", size=3 << 20)["addr"]
        links = [
            os.readlink(f"/proc/{peer.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{peer.pid}/fd")
        ]
        assert any(x.startswith(d + "/") for x in links), (
            links
        )  # the segment's file, unnamed, in that directory
        assert os.listdir(d) == []
        data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
        engine.write(peer.name, data, raddr, transport="shm")
        assert peer.call("digest", addr=raddr, length=3 << 20)["sha"] == sha(data)
        back = np.zeros(3 << 20, dtype=np.uint8)
        engine.read(peer.name, back, raddr, transport="shm")
        assert sha(back) == sha(data)
        assert any(pid == peer.pid for pid, _fd, _a in engine.transports["shm"]._maps)  # type: ignore[attr-defined]
        with pytest.raises(SegmentError, match=r"transfer.shm_dir '/nonexistent/mc'"):
            with TransferEngine(transfer={"shm_dir": "/nonexistent/mc"}) as eng:
                eng.allocate(1 << 20)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------- bad input
def test_bad_requests_get_clear_errors(engine: TransferEngine, spawn_peer: Any) -> None:
    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    buf = bytearray(4096)
    with pytest.raises(
        InvalidRequest, match="^request 0: 0x1000\\+4096 is not inside memory registered by peer"
    ):
        engine.write(peer.name, buf, 0x1000)
    with pytest.raises(
        InvalidRequest, match=r"^2 of 2 requests failed; first: request 0: 0x1000\+4096 is not"
    ):
        engine.transfer([TransferRequest("write", peer.name, buf, None, 0x1000)] * 2)
    with pytest.raises(InvalidRequest, match="not inside memory registered"):
        engine.write(peer.name, buf, raddr + (1 << 20) - 100)  # runs past the end
    with pytest.raises(InvalidRequest, match="length must be positive"):
        engine.write(peer.name, buf, raddr, 0)
    with pytest.raises(InvalidRequest, match="length must be positive"):
        engine.write(peer.name, buf, raddr, -5)
    with pytest.raises(InvalidRequest, match="exceeds the local buffer"):
        engine.write(peer.name, buf, raddr, 8192)
    with pytest.raises(InvalidRequest, match="not inside any registered memory"):
        engine.write(peer.name, 12345678, raddr, 16)  # unregistered local address
    with pytest.raises(PeerUnreachable, match="127.0.0.1:1"):
        engine.write("127.0.0.1:1", buf, raddr)
    with pytest.raises(PeerUnreachable, match="unknown peer 'no-such-host'"):
        engine.write("no-such-host", buf, raddr)
    with pytest.raises(InvalidRequest, match="unknown transport"):
        engine.write(peer.name, buf, raddr, transport="carrier-pigeon")
    # the engine still works after all that
    engine.write(peer.name, buf, raddr)


def test_server_refuses_out_of_bounds_even_if_client_does_not_check(spawn_peer: Any) -> None:
    """A misbehaving client that skips our checks still cannot touch unregistered memory."""
    from mooncake_core.transfer.protocol import MAGIC, REQ, RESP, Op, Status
    from mooncake_core.transfer.transports.tcp import TCPConnection

    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 16)["addr"]
    peer.call("fill", addr=raddr, length=1 << 16, seed=1)
    before = peer.call("digest", addr=raddr, length=1 << 16)["sha"]
    host, port = peer.name.rsplit(":", 1)
    conn = TCPConnection(host, int(port), secret="", timeout=5, peer=peer.name)

    def answer() -> tuple[int, bytes]:
        head = conn.sock.recv(RESP.size, socket.MSG_WAITALL)
        _magic, status, _rid, _pad, n = RESP.unpack(head)
        return status, conn.sock.recv(n, socket.MSG_WAITALL) if n else b""

    conn.sock.sendall(REQ.pack(MAGIC, Op.READ, 0, 0, 1, 0, raddr - 4096, 8192))
    status, msg = answer()
    assert status == Status.OUT_OF_BOUNDS and b"not inside any registered memory" in msg
    conn.sock.sendall(
        REQ.pack(MAGIC, Op.WRITE, 0, 0, 2, 0, raddr + (1 << 16) - 10, 100) + b"z" * 100
    )
    status, msg = answer()
    assert status == Status.OUT_OF_BOUNDS and b"runs past the end" in msg
    conn.close()
    assert peer.call("digest", addr=raddr, length=1 << 16)["sha"] == before


def test_wrong_secret_can_neither_read_nor_write(spawn_peer: Any) -> None:
    peer = spawn_peer(env={"MOONCAKE_TRANSFER_SECRET": "s3cret", "MOONCAKE_TRANSFER_SHM": "0"})
    raddr = peer.call("alloc", size=1 << 16)["addr"]
    with TransferEngine(transfer={"secret": "wrong", "timeout_s": 5}) as bad:
        with pytest.raises(AuthError, match="shared secret"):
            bad.write(peer.name, bytearray(10), raddr)
        with pytest.raises(AuthError):
            bad.read(peer.name, bytearray(10), raddr)
    with TransferEngine(transfer={"timeout_s": 5}) as nosecret:
        with pytest.raises(AuthError):
            nosecret.read(peer.name, bytearray(10), raddr)
    with TransferEngine(transfer={"secret": "s3cret", "timeout_s": 5}) as good:
        good.write(peer.name, bytearray(b"hello"), raddr)
        out = bytearray(5)
        good.read(peer.name, out, raddr)
        assert out == b"hello"


def test_tensors_between_processes(engine: TransferEngine, spawn_peer: Any) -> None:
    torch = pytest.importorskip("torch")
    peer = spawn_peer()
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    engine.put_tensor_async(t, peer.name, "layer0").result(10)
    got = peer.call("tensor_get", key="layer0")
    assert got == {
        "type": "torch",
        "dtype": "torch.float32",
        "shape": [10, 100],
        "sum": float(t.sum()),
    }
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    engine.put_tensor(a, peer.name, "np")
    got = peer.call("tensor_get", key="np")
    assert got["type"] == "numpy" and got["shape"] == [3, 4] and got["sum"] == 66.0
    with pytest.raises(InvalidRequest):
        engine.put_tensor_async("not a tensor", peer.name, "x")


def test_device_memory_staging_path(engine: TransferEngine, spawn_peer: Any) -> None:
    """The host-staging path used for CUDA memory, driven with CPU tensors registered as a
    device-kind region (the real CUDA test is test_transfer_cuda.py, which needs a GPU)."""
    torch = pytest.importorskip("torch")
    from mooncake_core.transfer.memory import Region

    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    src = torch.arange(100_000, dtype=torch.float32)
    engine.segments.add(Region(src.data_ptr(), src.numel() * 4, "dev-src", "cuda", owner=src))
    for transport in ("shm", "tcp"):
        engine.write(peer.name, src.data_ptr(), raddr, length=400_000, transport=transport)
        assert peer.call("digest", addr=raddr, length=400_000)["sha"] == sha(src.numpy())
        dst = torch.zeros(100_000, dtype=torch.float32)
        engine.segments.add(
            Region(dst.data_ptr(), 400_000, f"dev-dst-{transport}", "cuda", owner=dst)
        )
        engine.read(peer.name, dst.data_ptr(), raddr, length=400_000, transport=transport)
        assert torch.equal(src, dst)


def test_hung_peer_times_out_naming_peer_and_request(spawn_peer: Any) -> None:
    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    with TransferEngine(transfer={"timeout_s": 2, "retry_count": 1}) as eng:
        eng.write(peer.name, bytearray(1 << 20), raddr, transport="tcp")  # connected and working
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            _wait_stopped(peer.pid)  # every thread, so none can still answer
            t0 = time.monotonic()
            with pytest.raises(TransportError) as ei:
                eng.read(peer.name, bytearray(1 << 20), raddr, transport="tcp")
            elapsed = time.monotonic() - t0
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert elapsed < 2 + 1.5, elapsed
        msg = str(ei.value)
        assert "request 0 (read to peer" in msg and peer.name in msg and "timed out" in msg, msg


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_without_a_control_transport_peers_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_core import plugins

    monkeypatch.setenv("MOONCAKE_BLOCK_PLUGINS", "tcp")
    plugins.reset_plugin_manager()
    try:
        with TransferEngine() as eng:
            assert "tcp" not in eng.transports
            with pytest.raises(PeerUnreachable, match="no transport that carries control messages"):
                eng.peer(f"127.0.0.1:{eng.port}")
            assert not eng.ping(f"127.0.0.1:{eng.port}")
    finally:
        plugins.reset_plugin_manager()
