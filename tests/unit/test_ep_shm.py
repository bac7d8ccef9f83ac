"""The EP shared-memory plane: own buffers grow with new generations, a peer's memfd buffer
is mapped from another process and remapped when its generation changes, the epoch probe
refuses members on another host, and a mailbox wait ends with the rows, or with a clear
failure when a member aborted, died (also as an unreaped zombie) or hung."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from mooncake_core.ep.shm import COMBINE, DISPATCH, MailboxFailure, ShmPlane

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from mooncake_core.transfer.memory import ManagedBuffer

    bufs = []
    for line in sys.stdin:
        size, fill = map(int, line.split())
        b = ManagedBuffer(size)
        b.numpy()[:] = fill
        bufs.append(b)
        print(json.dumps({"fd": b.fd}), flush=True)
    """
)


def test_own_buffers_grow_with_a_new_generation() -> None:
    plane = ShmPlane(initial_bytes=4096)
    try:
        pid, fd, gen = plane.descriptor(DISPATCH)
        assert plane.send(DISPATCH, 100).numel() == 100
        assert plane.descriptor(DISPATCH) == (pid, fd, gen)  # fits: same buffer
        plane.send(DISPATCH, 10 << 20)[:] = 7
        _, _, gen2 = plane.descriptor(DISPATCH)
        assert gen2 != gen and plane.own(DISPATCH).numel() >= 10 << 20
        assert int(plane.own(DISPATCH)[(10 << 20) - 1]) == 7
        assert plane.descriptor(COMBINE)[2] not in (gen, gen2)
        # our own pid maps to our own buffer, whatever fd/gen a header carries
        assert plane.peer(DISPATCH, pid, -1, -1).data_ptr() == plane.own(DISPATCH).data_ptr()
    finally:
        plane.close()


def test_maps_another_processes_buffer_and_remaps_a_new_generation() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    plane = ShmPlane(max_members=4, row_width=4)
    try:
        assert child.stdin is not None and child.stdout is not None

        def alloc(size: int, fill: int) -> int:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(f"{size} {fill}\n")
            child.stdin.flush()
            return int(json.loads(child.stdout.readline())["fd"])

        fd1 = alloc(1 << 16, 3)
        t1 = plane.peer(DISPATCH, child.pid, fd1, 1)
        assert t1.numel() == 1 << 16 and bool((t1 == 3).all())
        assert plane.peer(DISPATCH, child.pid, fd1, 1) is t1  # cached per generation
        fd2 = alloc(1 << 20, 5)
        t2 = plane.peer(DISPATCH, child.pid, fd2, 2)
        assert t2.numel() == 1 << 20 and bool((t2 == 5).all())
        # the probe: same host and mappable -> yes; a member on another host -> no
        row = torch.tensor([plane.host, child.pid, fd2, 2, fd1, 1], dtype=torch.int64)
        assert plane.probe(torch.cat([plane.probe_row(), row]))
        other = row.clone()
        other[0] ^= 1
        assert not plane.probe(torch.cat([plane.probe_row(), other]))
        with pytest.raises(OSError):
            plane.peer(COMBINE, child.pid, 999, 3)  # no such fd in the child
    finally:
        plane.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)


def test_mailbox_wait_returns_rows_or_fails_clearly() -> None:
    plane = ShmPlane(max_members=2, row_width=3)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # member 0 is us; member 1's mailbox is a plain array we write as that member would
        slot = 1 + 2 * 3
        peer = np.zeros(2 * slot, dtype=np.int64)
        plane._boxes = [plane._ctrl, peer]
        plane._pids = [plane.pid, sleeper.pid]
        seq = (5 << 32) | 1  # epoch 5, first exchange: slot 1
        plane.post(seq, [[1, 2, 3], [4, 5, 6]])
        peer[slot + 1 : slot + 1 + 6] = [7, 8, 9, 10, 11, 12]
        peer[slot] = seq
        assert plane.collect(seq, 0, 3, 1.0, -6) == [[1, 2, 3], [7, 8, 9]]
        seq2 = (5 << 32) | 2  # slot 0: the peer has not posted it
        plane.post(seq2, [[0, 0, 0], [0, 0, 0]])
        with pytest.raises(MailboxFailure, match="did not post exchange 2 within 0.1s"):
            plane.collect(seq2, 0, 3, 0.1, -6)
        peer[0] = -6  # the peer left epoch 5
        with pytest.raises(MailboxFailure, match="left the epoch"):
            plane.collect(seq2, 0, 3, 5.0, -6)
        peer[0] = -5  # an abort of an older epoch is not ours: only the timeout ends it
        with pytest.raises(MailboxFailure, match="did not post"):
            plane.collect(seq2, 0, 3, 0.05, -6)
        zombie.send_signal(9)
        time.sleep(0.3)  # dead but not reaped: a zombie
        plane._pids = [plane.pid, zombie.pid]
        with pytest.raises(MailboxFailure, match=f"{zombie.pid}.*gone"):
            plane.collect(seq2, 0, 3, 5.0, -6)
        # our own abort marks only the slot of the exchange in progress
        plane.abort_slot(seq2, -6)
        assert plane._ctrl[0] == -6 and plane._ctrl[slot] == seq
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()
        plane._boxes = []
        plane.close()
