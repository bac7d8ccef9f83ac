"""A peer's TCP connections dropped while transfers to it are in flight (``forget_peer``, or a
descriptor refresh that finds it listening elsewhere, drops them): those transfers retry on
new connections at once, with the right bytes, and none waits out its timeout. A refresh
that finds the peer where it was keeps its connections.

Found through the P2P store: a reader whose engine had cached a holder's descriptor before
the holder allocated the replica refreshed it from one fetch thread; another fetch thread,
waiting for its answer on a connection closed under it, waited the whole transfer timeout
(close() does not wake a waiting thread on Linux, and the descriptor number was reused by
the refresh's new connection), then failed, and the holder was dropped as dead.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mooncake_core.transfer import TransferEngine, TransferRequest

pytestmark = pytest.mark.timeout(60)


def test_reads_in_flight_survive_their_peers_pool_being_dropped() -> None:
    cfg = {"shm": False, "timeout_s": 3.0}  # TCP only; a stuck read fails within 3 s
    holder = TransferEngine(transfer=cfg).start()
    reader = TransferEngine(transfer=cfg).start()
    try:
        piece, nthreads = 256 << 10, 4
        src = holder.allocate(piece * nthreads)
        want = np.random.default_rng(5).integers(0, 256, piece * nthreads, dtype=np.uint8)
        src.view[:] = want.tobytes()
        dst = reader.allocate(piece * nthreads)
        reader.peer(holder.name)
        stop = time.monotonic() + 2.0
        errors: list[str] = []
        reads = [0] * nthreads
        drops = 0

        def read_loop(i: int) -> None:
            lo = i * piece
            while time.monotonic() < stop:
                dst.view[lo : lo + piece] = bytes(piece)
                try:
                    reader.transfer(
                        TransferRequest("read", holder.name, dst.addr + lo, piece, src.addr + lo)
                    )
                except Exception as exc:  # recorded: the assertion below names it
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if bytes(dst.view[lo : lo + piece]) != want[lo : lo + piece].tobytes():
                    errors.append(f"thread {i}: wrong bytes")
                reads[i] += 1

        def drop_loop() -> None:
            nonlocal drops
            while time.monotonic() < stop:
                reader.forget_peer(holder.name)  # drops the pooled connections
                reader.peer(holder.name)  # and resolves it again, as a refresh did
                drops += 1
                time.sleep(0.02)  # room for a retried read to land between drops

        threads = [threading.Thread(target=read_loop, args=(i,)) for i in range(nthreads)]
        threads.append(threading.Thread(target=drop_loop))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors[:3]
        assert drops >= 20 and min(reads) >= 20, (drops, reads)  # the race was exercised
    finally:
        reader.close()
        holder.close()


def test_a_descriptor_refresh_keeps_the_peers_connections_and_sees_new_memory() -> None:
    cfg = {"shm": False, "timeout_s": 3.0}
    holder = TransferEngine(transfer=cfg).start()
    reader = TransferEngine(transfer=cfg).start()
    try:
        first = holder.allocate(4096)
        first.view[:] = b"a" * 4096
        dst = reader.allocate(8192)
        reader.transfer(TransferRequest("read", holder.name, dst.addr, 4096, first.addr))
        tcp = reader._control
        assert tcp is not None
        conns = [c for c in tcp._pools[holder.name].conns if c is not None]  # type: ignore[attr-defined]
        assert conns
        later = holder.allocate(4096)  # registered after the reader cached the descriptor
        later.view[:] = b"b" * 4096
        # the bounds check misses, refreshes the descriptor and reads the new memory
        reader.transfer(TransferRequest("read", holder.name, dst.addr + 4096, 4096, later.addr))
        assert bytes(dst.view[:8192]) == b"a" * 4096 + b"b" * 4096
        kept = [c for c in tcp._pools[holder.name].conns if c is not None]  # type: ignore[attr-defined]
        assert all(c in kept and not c.broken for c in conns), "the refresh dropped them"
    finally:
        reader.close()
        holder.close()
