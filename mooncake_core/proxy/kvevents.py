"""Engines' KV-cache events into the conductor: which prefill instance holds which prefix.

An engine publishes ``stored`` / ``removed`` / ``cleared`` events over ZMQ (vLLM: started
with ``--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
"endpoint":"tcp://127.0.0.1:PORT"}'``). An endpoint without ``*`` makes the engine
*connect*, so the proxy binds one SUB socket per prefill instance on loopback and the
instances connect to it. The engine's adapter decodes each message into the neutral
events of :mod:`mooncake_core.proxy.engine`; a stored block carries its token ids and its
parent's engine hash, and :class:`BlockChain` re-chains them into the proxy's own block
ids (:func:`~mooncake_core.conductor.policy.prefix_blocks`) so that events and routed
prompts name blocks the same way.

*Thread-safety*: a listener thread decodes; updates are handed to the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mooncake_core.conductor.policy import chain_block, token_chunk
from mooncake_core.errors import MissingDependency
from mooncake_core.proxy.engine import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

__all__ = ["KVEventListener", "BlockChain"]

logger = logging.getLogger(__name__)


class BlockChain:
    """Maps one instance's engine block hashes to the proxy's chained block ids."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._digest: dict[Hashable, bytes] = {}  # engine hash -> our chain digest
        self._ids: dict[Hashable, int] = {}  # engine hash -> our block id

    def stored(self, event: BlocksStored) -> list[int]:
        """Our ids for a :class:`BlocksStored` event (empty when the chain cannot be followed)."""
        hashes = event.block_hashes
        tokens = event.token_ids
        size = event.block_size or self.block_tokens
        if size != self.block_tokens or len(tokens) != size * len(hashes):
            return []
        parent = None if event.parent_hash is None else self._key(event.parent_hash)
        if parent is None:
            h = b""
        elif parent in self._digest:
            h = self._digest[parent]
        else:  # the parent's event was missed: this chain is unknown to us
            return []
        out = []
        for i, eh in enumerate(hashes):
            h, bid = chain_block(h, token_chunk(tokens[i * size : (i + 1) * size]))
            k = self._key(eh)
            self._digest[k] = h
            self._ids[k] = bid
            out.append(bid)
        return out

    def removed(self, hashes: Sequence[Hashable]) -> list[int]:
        """Our ids of the blocks with these engine hashes (forgotten)."""
        out = []
        for eh in hashes:
            k = self._key(eh)
            self._digest.pop(k, None)
            bid = self._ids.pop(k, None)
            if bid is not None:
                out.append(bid)
        return out

    def clear(self) -> list[int]:
        """Our ids of every block (all forgotten)."""
        out = list(self._ids.values())
        self._digest.clear()
        self._ids.clear()
        return out

    @staticmethod
    def _key(h: Any) -> Hashable:
        if isinstance(h, (bytes, bytearray, memoryview)):
            return bytes(h)
        if isinstance(h, list):
            return tuple(h)
        key: Hashable = h
        return key


class KVEventListener:
    """Binds a ZMQ SUB socket per prefill instance and feeds their KV events to callbacks.

    Args:
        endpoints: ``tcp://127.0.0.1:PORT`` per prefill instance, in instance order.
        block_tokens: the engines' KV block size (must match the proxy's hashing).
        on_stored / on_removed: ``f(instance, block_ids)``, called on ``loop``.
        loop: the proxy's event loop.
        decode: the engine's decoder of one message's last frame
            (:meth:`~mooncake_core.proxy.engine.ProxyEngine.decode_kv_events`).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        block_tokens: int,
        on_stored: Callable[[int, list[int]], None],
        on_removed: Callable[[int, list[int]], None],
        loop: asyncio.AbstractEventLoop,
        decode: Callable[[bytes], list[KVEvent]],
    ) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise MissingDependency("zmq", "the proxy's --kv-events") from exc

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
        self._decode = decode
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
                except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
                    logger.warning(
                        "ignoring a malformed KV event from prefill instance %d: %s", inst, exc
                    )

    def _handle(self, inst: int, payload: bytes) -> None:
        chain = self.chains[inst]
        for ev in self._decode(payload):
            if isinstance(ev, BlocksStored):
                ids = chain.stored(ev)
                if ids:
                    self._loop.call_soon_threadsafe(self._on_stored, inst, ids)
            elif isinstance(ev, BlocksRemoved):
                ids = chain.removed(ev.block_hashes)
                if ids:
                    self._loop.call_soon_threadsafe(self._on_removed, inst, ids)
            elif isinstance(ev, AllBlocksCleared):
                ids = chain.clear()
                if ids:
                    self._loop.call_soon_threadsafe(self._on_removed, inst, ids)
            self.events += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self._socks:
            s.close(linger=0)
