"""KV events re-chained into the proxy's block ids, and fed through real ZMQ (engine-neutral)."""

from __future__ import annotations

import asyncio
import json

import pytest
from tests_support import free_port

from mooncake_core.conductor.policy import least_loaded, prefix_blocks
from mooncake_core.proxy.engine import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from mooncake_core.proxy.kvevents import BlockChain, KVEventListener


def _stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int | None = 4
) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, tuple(tokens), size)


def test_chain_matches_the_proxys_prompt_hashes() -> None:
    toks = list(range(100, 124))  # 6 blocks of 4
    want = list(prefix_blocks(toks, 4))
    c = BlockChain(4)
    # events arrive in pieces: the first 2 blocks, then 4 more chained on the 2nd
    assert c.stored(_stored([b"a", b"b"], None, toks[:8])) == want[:2]
    assert c.stored(_stored([b"c", b"d", b"e", b"f"], b"b", toks[8:])) == want[2:]
    assert c.removed([b"f", b"zz"]) == [want[5]]
    # a chain whose parent we never saw cannot be named: ignored, not guessed
    assert c.stored(_stored([b"x"], b"unknown", toks[:4])) == []
    # wrong block size or token count: ignored; no size given: the proxy's
    assert c.stored(_stored([b"y"], None, toks[:3])) == []
    assert c.stored(_stored([b"y"], None, toks[:8], size=8)) == []
    assert c.stored(_stored([b"a2"], None, toks[:4], size=None)) == want[:1]
    assert sorted(c.clear()) == sorted(want[:5] + want[:1])


def test_least_loaded_rotates_ties_from_start() -> None:
    assert least_loaded([3, 1, 1, 2]) == 1
    assert least_loaded([3, 1, 1, 2], start=2) == 2
    assert least_loaded([3, 1, 1, 2], start=3) == 1
    assert least_loaded([(1, 5), (1, 2), (0, 9)], start=1) == 2


def _decode(payload: bytes) -> list[KVEvent]:
    """A toy engine format: JSON lists of ["stored", hashes, parent, tokens] / ["removed", hashes]
    / ["cleared"]."""
    out: list[KVEvent] = []
    for ev in json.loads(payload):
        if ev[0] == "stored":
            out.append(BlocksStored(tuple(ev[1]), ev[2], tuple(ev[3]), 4))
        elif ev[0] == "removed":
            out.append(BlocksRemoved(tuple(ev[1])))
        else:
            out.append(AllBlocksCleared())
    return out


def test_listener_over_real_zmq_feeds_the_callbacks() -> None:
    zmq = pytest.importorskip("zmq")
    ep = f"tcp://127.0.0.1:{free_port()}"
    got: list[tuple[str, int, list[int]]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lst = KVEventListener(
            [ep],
            4,
            lambda i, b: got.append(("stored", i, b)),
            lambda i, b: got.append(("removed", i, b)),
            loop,
            _decode,
        )
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(ep)  # as an engine does for an endpoint without '*'
        try:
            batch = [["stored", ["a", "b"], None, list(range(8))], ["removed", ["b"]]]
            for _ in range(50):  # PUB drops messages until the connection is up
                pub.send_multipart([b"", json.dumps(batch).encode()])
                await asyncio.sleep(0.05)
                if got:
                    break
            pub.send_multipart([b"", b"\xc1garbage"])  # malformed: logged, ignored
            await asyncio.sleep(0.3)
            assert lst.events >= 2
        finally:
            pub.close(linger=0)
            lst.close()

    asyncio.run(main())
    ids = list(prefix_blocks(list(range(8)), 4))
    assert got[0] == ("stored", 0, ids)
    assert got[1] == ("removed", 0, [ids[1]])
