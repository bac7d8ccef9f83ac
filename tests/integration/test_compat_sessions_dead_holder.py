"""Compat put sessions across a holder's death.

``batch_put_session_start`` reserves each object's replicas; a holder SIGKILLed after that makes
the range writes into its segment fail. A key none of whose bytes were written before is placed
again on the live segments (``exclude``: the dead one) and its session goes on there, over one
range call or several; a key whose bytes an earlier call already wrote cannot be placed again
(those bytes were in the caller's buffers): the range write and the session's end give it
TRANSFER_FAIL (-800) and it is not stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from store_support import Agent, Master, payload
from test_store_dead_holder import _two_phase_client

from mooncake_core.compat import store_sessions
from mooncake_core.compat.store import MooncakeDistributedStore, ReplicateConfig
from mooncake_core.store import StoreClient
from mooncake_core.store.client_core import HolderUnreachable
from mooncake_core.store.placement_retry import PLACEMENTS
from mooncake_core.store.protocol import ReplicaCfg, SliceW

TRANSFER_FAIL = -800


def _objects_in(m: Master, segment: str) -> int:
    """Objects (complete or still being put) with a replica in ``segment``, per the master."""
    segs = {s["name"]: s for s in json.loads(m.http("/segments")[1])}
    return int(segs[segment]["objects"])


@pytest.mark.timeout(90)
def test_put_sessions_survive_a_holder_killed_after_their_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # only the failed writes tell the master of the death (as for a holder cut off with its
    # sockets open), and the dead holder's segment stays registered for the whole test
    monkeypatch.setenv("MOONCAKE_STORE_SUSPECT_ON_DISCONNECT", "false")
    m = Master(tmp_path, "--client-ttl", "60")
    agents: list[Agent] = []
    clients: list[StoreClient] = []
    store = MooncakeDistributedStore()
    try:
        agents = [
            Agent(m.address, segment_size=64 << 20, log=tmp_path / f"h{i}.log") for i in (1, 2, 3)
        ]
        victim, live1, live2 = agents
        reader = _two_phase_client(m.address)
        clients = [reader]
        # fill the live holders: placement (free-ratio-first) then puts a replica on the victim
        for live in (live1, live2):
            for i in range(12):
                k = f"fill/{live.segment}/{i}"
                reader.put(k, payload(k, 2 << 20), preferred_segment=live.segment)
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", m.address) == 0

        one = [f"one/{i}" for i in range(6)]  # written by one range call each, after the death
        multi = "multi/fresh"  # several calls, all after the death
        dead = "multi/dead"  # several calls, the first before the death
        rep2 = ["rep2/0", "rep2/1"]  # two replicas, written after the death
        rep2_dead = "rep2/dead"  # two replicas, the first call before the death
        sizes = {k: (1000, 70_000, 300_000)[i % 3] for i, k in enumerate(one)}
        sizes.update({multi: 250_000, dead: 200_000, rep2[0]: 90_000, rep2[1]: 4096})
        sizes[rep2_dead] = 120_000
        src = {k: payload(k, n) for k, n in sizes.items()}
        blob = np.frombuffer(bytearray(b"".join(src.values())), dtype=np.uint8)
        base = int(blob.ctypes.data)
        assert store.register_buffer(base, blob.nbytes) == 0
        at: dict[str, int] = {}  # each key's bytes in the registered buffer
        pos = 0
        for k, v in src.items():
            at[k] = base + pos
            pos += len(v)

        single = [*one, multi, dead]
        assert store.batch_put_session_start(single, [sizes[k] for k in single]) == [0] * 8
        cfg2 = ReplicateConfig()
        cfg2.replica_num = 2
        pair = [*rep2, rep2_dead]
        assert store.batch_put_session_start(pair, [sizes[k] for k in pair], cfg2) == [0] * 3
        # every session object has a replica on the victim
        assert _objects_in(m, victim.segment) == len(single) + len(pair)

        def ranges(keys: list[str], parts: list[tuple[int, int]]) -> list[int]:
            """Write bytes [lo, hi) of each key (one range call; each range in two pieces)."""
            ptrs, ns, offs = [], [], []
            for k, (lo, hi) in zip(keys, parts, strict=True):
                mid = (lo + hi) // 2
                ptrs.append([at[k] + lo, at[k] + mid])
                ns.append([mid - lo, hi - mid])
                offs.append([lo, mid])
            return store.batch_put_from_multi_buffer_ranges(keys, ptrs, ns, offs)

        # before the death: the first part of the keys that will not survive it
        half = {dead: sizes[dead] // 2, rep2_dead: sizes[rep2_dead] // 3}
        assert ranges([dead, rep2_dead], [(0, half[dead]), (0, half[rep2_dead])]) == [
            half[dead],
            half[rep2_dead],
        ]

        victim.kill()  # SIGKILL; the master hears nothing of it until the TTL

        # one call per key (and the two-replica ones), in one batch
        whole = [*one, *rep2]
        assert ranges(whole, [(0, sizes[k]) for k in whole]) == [sizes[k] for k in whole]
        # several calls for one key: the first places it again, the others follow it there
        thirds = [0, sizes[multi] // 3, 2 * sizes[multi] // 3, sizes[multi]]
        for lo, hi in zip(thirds, thirds[1:], strict=False):
            assert ranges([multi], [(lo, hi)]) == [hi - lo]
        # the rest of the keys whose first part went to the dead holder: not written, said so
        rest = [(half[k], sizes[k]) for k in (dead, rep2_dead)]
        assert ranges([dead, rep2_dead], rest) == [TRANSFER_FAIL, TRANSFER_FAIL]
        assert ranges([dead], [(0, 10)]) == [TRANSFER_FAIL]  # and stays so

        ended = store.batch_put_session_end([*single, *pair])
        good = [*one, multi, *rep2]
        assert dict(zip([*single, *pair], ended, strict=True)) == {
            **{k: 0 for k in good},
            dead: TRANSFER_FAIL,
            rep2_dead: TRANSFER_FAIL,
        }
        for k in good:
            assert reader.get(k) == src[k], k
            q = reader.query(k)
            segs = [s["segment"] for rep in q["replicas"] for s in rep]
            assert victim.segment not in segs, k
            assert len(q["replicas"]) == (2 if k in rep2 else 1), k
        for k in (dead, rep2_dead):
            assert store.is_exist(k) == 0, k
        # nothing left reserved on the dead holder but the first parts' placements, dropped too
        assert _objects_in(m, victim.segment) == 0
        st = reader.stats()
        assert st["suspect_marks"] == 1  # from the re-placements' ``exclude``
        assert victim.segment in [s["name"] for s in json.loads(m.http("/segments")[1])]
    finally:
        store.close()
        for c in clients:
            c.close()
        for a in agents:
            a.stop()
        m.stop()


class _EveryHolderFails:
    """A client whose every write fails on the holders, each time on a new segment."""

    def __init__(self) -> None:
        self.writes = 0
        self.revoked: list[int] = []
        self.avoided: list[list[str]] = []

    def _write(self, jobs: Any) -> None:
        self.writes += 1
        raise HolderUnreachable(f"writing into s{self.writes}: refused", {f"s{self.writes}"})

    def _revoke(self, key: str, token: int) -> None:
        self.revoked.append(token)

    def _start_put(
        self, key: str, length: int, cfg: ReplicaCfg, avoid: set[str], failed: object
    ) -> tuple[int, list[list[SliceW]]]:
        self.avoided.append(sorted(avoid))
        seg = f"s{len(self.avoided) + 1}"
        return 100 + len(self.avoided), [[SliceW(seg, "peer", 0x1000, length, "h")]]


def test_a_key_is_placed_at_most_placements_times_then_dropped() -> None:
    fake = _EveryHolderFails()
    c = cast(Any, fake)
    sess = store_sessions._PutSession(7, 64, ReplicaCfg(), [[SliceW("s1", "p", 0, 64, "h")]])
    assert store_sessions._write_ranges(c, "k", sess, [(0x10, 64, 0)]) == TRANSFER_FAIL
    assert fake.writes == PLACEMENTS  # the session's placement and the re-placements
    assert fake.avoided == [[f"s{j}" for j in range(1, i + 1)] for i in range(1, PLACEMENTS)]
    assert fake.revoked == [7, *(100 + i for i in range(1, PLACEMENTS))]  # each one dropped
    assert sess.lost and not sess.written
    # the key's placement is gone: later calls fail at once
    assert store_sessions._write_ranges(c, "k", sess, [(0x10, 8, 0)]) == TRANSFER_FAIL
    assert fake.writes == PLACEMENTS
