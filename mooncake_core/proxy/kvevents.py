"""vLLM KV-cache events into the conductor: which prefill instance holds which prefix.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events over ZMQ
when started with ``--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
"endpoint":"tcp://127.0.0.1:PORT"}'``. An endpoint without ``*`` makes vLLM *connect*,
so the proxy binds one SUB socket per prefill instance on loopback and the instances
connect to it. Each stored block carries its token ids and its parent's vLLM hash; we
re-chain them into the proxy's own block hashes (:func:`~mooncake_core.proxy.policy.prefix_blocks`)
so that events and routed prompts name blocks the same way.

Messages are ``(topic, 8-byte big-endian sequence, msgpack EventBatch)`` where the batch is
``[ts, [event, ...], dp_rank]`` and each event a map tagged ``"type"``.

*Thread-safety*: a listener thread decodes; updates are handed to the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

__all__ = ["KVEventListener", "BlockChain"]

logger = logging.getLogger(__name__)


class BlockChain:
    """Maps one instance's vLLM block hashes to the proxy's chained block ids."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._digest: dict[Any, bytes] = {}  # vLLM hash -> our chain digest
        self._ids: dict[Any, int] = {}  # vLLM hash -> our block id

    def stored(self, event: dict[str, Any]) -> list[int]:
        """Our ids for a ``BlockStored`` event (empty when the chain cannot be followed)."""
        hashes: list[Any] = list(event.get("block_hashes") or [])
        tokens: list[int] = list(event.get("token_ids") or [])
        size = int(event.get("block_size") or self.block_tokens)
        parent = event.get("parent_block_hash")
        if size != self.block_tokens or len(tokens) != size * len(hashes):
            return []
        if parent is None:
            h = b""
        elif parent in self._digest:
            h = self._digest[parent]
        else:  # the parent's event was missed: this chain is unknown to us
            return []
        out = []
        for i, vh in enumerate(hashes):
            chunk = ",".join(map(str, tokens[i * size : (i + 1) * size])).encode()
            h = hashlib.blake2b(h + chunk, digest_size=8).digest()
            bid = int.from_bytes(h, "little") & ((1 << 62) - 1)
            self._digest[self._key(vh)] = h
            self._ids[self._key(vh)] = bid
            out.append(bid)
        return out

    def removed(self, hashes: Sequence[Any]) -> list[int]:
        out = []
        for vh in hashes:
            k = self._key(vh)
            self._digest.pop(k, None)
            bid = self._ids.pop(k, None)
            if bid is not None:
                out.append(bid)
        return out

    def clear(self) -> list[int]:
        out = list(self._ids.values())
        self._digest.clear()
        self._ids.clear()
        return out

    @staticmethod
    def _key(h: Any) -> Any:
        return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h


class KVEventListener:
    """Binds a ZMQ SUB socket per prefill instance and feeds their KV events to callbacks.

    Args:
        endpoints: ``tcp://127.0.0.1:PORT`` per prefill instance, in instance order.
        block_tokens: the engines' KV block size (must match the proxy's hashing).
        on_stored / on_removed: ``f(instance, block_ids)``, called on ``loop``.
        loop: the proxy's event loop.
    """

    def __init__(self, endpoints: Sequence[str], block_tokens: int,
                 on_stored: Callable[[int, list[int]], None], on_removed: Callable[[int, list[int]], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._socks: list[Any] = []
        for ep in endpoints:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.bind(ep)
            self._socks.append(s)
        self.chains = [BlockChain(block_tokens) for _ in endpoints]
        self._on_stored = on_stored
        self._on_removed = on_removed
        self._loop = loop
        self._stop = threading.Event()
        self.events = 0
        self._thread = threading.Thread(target=self._run, name="mc-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                inst = self._socks.index(sock)
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    self._handle(inst, frames[-1])
                except zmq.Again:
                    continue
                except (msgspec.DecodeError, ValueError, TypeError, IndexError) as exc:
                    logger.warning("ignoring a malformed KV event from prefill instance %d: %s", inst, exc)

    def _handle(self, inst: int, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        events = batch[1] if isinstance(batch, list) else batch.get("events", [])
        chain = self.chains[inst]
        for ev in events:
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "BlockStored":
                ids = chain.stored(ev)
                if ids:
                    self._loop.call_soon_threadsafe(self._on_stored, inst, ids)
            elif kind == "BlockRemoved":
                ids = chain.removed(ev.get("block_hashes") or [])
                if ids:
                    self._loop.call_soon_threadsafe(self._on_removed, inst, ids)
            elif kind == "AllBlocksCleared":
                ids = chain.clear()
                if ids:
                    self._loop.call_soon_threadsafe(self._on_removed, inst, ids)
            self.events += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self._socks:
            s.close(linger=0)
