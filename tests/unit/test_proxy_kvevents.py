"""KV events from vLLM re-chained into the proxy's block ids, and fed through real ZMQ."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from tests_support import free_port

from mooncake_core.proxy.kvevents import BlockChain, KVEventListener
from mooncake_core.proxy.policy import prefix_blocks


def _stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int = 4) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}


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
    # wrong block size or token count: ignored
    assert c.stored(_stored([b"y"], None, toks[:3])) == []
    assert sorted(c.clear()) == sorted(want[:5])


def test_listener_over_real_zmq_feeds_the_callbacks() -> None:
    zmq = pytest.importorskip("zmq")
    ep = f"tcp://127.0.0.1:{free_port()}"
    got: list[tuple[str, int, list[int]]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lst = KVEventListener([ep], 4, lambda i, b: got.append(("stored", i, b)),
                              lambda i, b: got.append(("removed", i, b)), loop)
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(ep)  # as vLLM does for an endpoint without '*'
        try:
            toks = list(range(8))
            batch = [time.time(), [_stored([b"a", b"b"], None, toks),
                                   {"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"}], None]
            for _ in range(50):  # PUB drops messages until the connection is up
                pub.send_multipart([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
                await asyncio.sleep(0.05)
                if got:
                    break
            pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\xc1garbage"])  # malformed: logged, ignored
            await asyncio.sleep(0.3)
        finally:
            pub.close(linger=0)
            lst.close()

    asyncio.run(main())
    ids = list(prefix_blocks(list(range(8)), 4))
    assert got[0] == ("stored", 0, ids)
    assert got[1] == ("removed", 0, [ids[1]])
