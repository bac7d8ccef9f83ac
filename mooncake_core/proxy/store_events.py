"""What the store pool holds, learned from the store master's KV events (``--store-events``).

The master publishes an event for every object stored, evicted or removed
(:mod:`mooncake_core.store.kvevents`: vLLM's EventBatch format, one object per event, with
the object key and the segments holding it). :class:`StoreEvents` subscribes (ZMQ SUB,
connecting to the master's endpoint), keeps an index ``key -> holders``, and answers the
proxy's questions without asking the master anything per request:

- :meth:`StoreEvents.held_pages`: leading pages of a prompt the pool holds (in memory or on
  a client's SSD tier), like :class:`~mooncake_core.proxy.storelookup.StoreLookup` does with
  one ``batch_exists`` RPC;
- :meth:`StoreEvents.held_by`: per prefill instance, leading pages held in that instance's
  own segment (``holders``: the segment name of each prefill instance's store client, in
  instance order; a name also matches the client's further segments ``NAME#1``, ...).

Page keys come from the engine's store key scheme
(:meth:`~mooncake_core.proxy.engine.ProxyEngine.store_keys`), so this works for every engine
whose adapter names its pages, whatever KV events the engine itself publishes.

Events missed while the proxy was not subscribed are not replayed: pages stored before the
proxy started count once they are stored again (or are never counted). An ``AllBlocksCleared``
(the master restarted) empties the index.

*Thread-safety*: a listener thread updates the index under a lock; lookups take the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from mooncake_core.errors import ConfigError, MissingDependency
from mooncake_core.proxy.engine import ProxyEngine, StoreKeys, proxy_engine

__all__ = ["StoreEvents", "decode_store_events"]

logger = logging.getLogger(__name__)

_Event = tuple[str, str, tuple[str, ...]]  # (kind, key, holders); kind: stored|removed|cleared


def decode_store_events(payload: bytes) -> list[_Event]:
    """The store events in one message's payload; ValueError when it is not an EventBatch.

    Events without an ``object_key`` (an engine's own block events) are skipped.
    """
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not an EventBatch [ts, events, ...]")
    out: list[_Event] = []
    for ev in batch[1]:
        if not isinstance(ev, dict):
            continue
        kind = ev.get("type")
        if kind == "AllBlocksCleared":
            out.append(("cleared", "", ()))
            continue
        key = ev.get("object_key")
        if not isinstance(key, str) or not key:
            continue
        if kind == "BlockStored":
            holders = ev.get("holders") or []
            out.append(("stored", key, tuple(str(h) for h in holders)))
        elif kind == "BlockRemoved":
            out.append(("removed", key, ()))
    return out


class StoreEvents:
    """The pool's holdings from the master's events (see module doc).

    Args:
        endpoint: the master's KV-event endpoint (``tcp://127.0.0.1:5557``).
        block_tokens / dtype / tp_size: the instances' store key scheme (as for
            :class:`~mooncake_core.proxy.storelookup.StoreLookup`).
        holders: segment name of each prefill instance's store client (instance order);
            empty: pages count as held by the pool only.
        model: the model path as the engine has it (None: :meth:`set_model` later).
        engine: names the keys (default: the default engine, asked when the model is set).
    """

    def __init__(
        self,
        endpoint: str,
        block_tokens: int,
        dtype: str,
        tp_size: int = 1,
        holders: Sequence[str] = (),
        model: str | None = None,
        engine: ProxyEngine | None = None,
    ) -> None:
        from mooncake_core.store.kvevents import check_endpoint

        self.endpoint = check_endpoint(endpoint, "--store-events")
        if block_tokens <= 0 or tp_size <= 0:
            raise ConfigError(
                f"--store-events needs a positive block size and TP size, got {block_tokens}, "
                f"{tp_size}"
            )
        if not dtype:
            raise ConfigError(
                "--store-events needs --store-dtype: the dtype the engine instances run with"
            )
        try:
            import zmq
        except ImportError as exc:
            raise MissingDependency("zmq", "the proxy's --store-events") from exc
        self.master = self.endpoint  # what the policy logs
        self.block_tokens = block_tokens
        self.dtype = dtype
        self.tp_size = tp_size
        self.holders = [h.strip() for h in holders]
        self.engine = engine
        self.scheme: StoreKeys | None = None
        self._index: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {
            "events": 0,
            "batches": 0,
            "malformed": 0,
            "lookups": 0,
            "pages_asked": 0,
            "pages_held": 0,
            "gaps": 0,
        }
        self._last_seq = -1
        self._zmq = zmq
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mc-store-events", daemon=True)
        self._thread.start()
        if model:
            self.set_model(model)

    # ------------------------------------------------------------------ scheme (as StoreLookup)
    def set_model(self, model: str) -> None:
        """Fix the model path (builds the key scheme)."""
        if self.engine is None:
            self.engine = proxy_engine()
        try:
            self.scheme = self.engine.store_keys(model, self.dtype, self.block_tokens, self.tp_size)
        except ValueError as exc:
            raise ConfigError(f"--store-events: {exc}") from None
        logger.info(
            "store holdings from the events on %s: keys %s...",
            self.endpoint,
            self.scheme.rank_prefix(0),
        )

    @property
    def available(self) -> bool:
        return True

    def probe(self) -> bool:
        """Always True: a SUB socket connects (and reconnects) by itself."""
        return True

    # ------------------------------------------------------------------ listener
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                self.apply(decode_store_events(frames[-1]), frames)
            except zmq.Again:
                continue
            except (ValueError, TypeError, IndexError) as exc:
                self.counters["malformed"] += 1
                logger.warning("ignoring a malformed store event message: %s", exc)

    def apply(self, events: Sequence[_Event], frames: Sequence[bytes] = ()) -> None:
        """Apply decoded events to the index (the listener's work; public for tests)."""
        if len(frames) >= 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if self._last_seq >= 0 and seq != self._last_seq + 1:
                self.counters["gaps"] += 1
            self._last_seq = seq
        with self._lock:
            idx = self._index
            for kind, key, holders in events:
                if kind == "stored":
                    idx[key] = holders
                elif kind == "removed":
                    idx.pop(key, None)
                else:
                    idx.clear()
            self.counters["events"] += len(events)
            self.counters["batches"] += 1

    # ------------------------------------------------------------------ lookups
    def _keys(self, tokens: Sequence[int]) -> tuple[list[str], list[str]]:
        scheme = self.scheme
        if scheme is None:
            return [], []
        pages = scheme.lookup_pages(tokens)
        return pages, (scheme.exists_keys(pages) if pages else [])

    def held_pages(self, tokens: Sequence[int]) -> int:
        """Leading pages of ``tokens`` the pool holds (0 without a scheme)."""
        pages, keys = self._keys(tokens)
        if not pages:
            return 0
        with self._lock:
            exists = [k in self._index for k in keys]
        assert self.scheme is not None
        n = int(self.scheme.held_pages(exists))
        self.counters["lookups"] += 1
        self.counters["pages_asked"] += len(pages)
        self.counters["pages_held"] += n
        return n

    async def aheld_pages(self, tokens: Sequence[int]) -> int:
        """:meth:`held_pages` (no I/O: the index is local)."""
        return self.held_pages(tokens)

    def _instance_of(self, holder: str) -> int:
        base = holder.split("#", 1)[0]
        for i, name in enumerate(self.holders):
            if name and (holder == name or base == name):
                return i
        return -1

    def held_by(self, tokens: Sequence[int]) -> list[int]:
        """Per prefill instance (``holders`` order), leading pages of ``tokens`` in its segment.

        A page counts for an instance when every key the scheme checks for it
        (:meth:`~mooncake_core.proxy.engine.StoreKeys.exists_keys`) has a replica there.
        """
        if not self.holders:
            return []
        pages, keys = self._keys(tokens)
        out = [0] * len(self.holders)
        if not pages:
            return out
        assert self.scheme is not None
        with self._lock:
            where = [self._index.get(k, ()) for k in keys]
        for i in range(len(self.holders)):
            on_i = [any(self._instance_of(h) == i for h in hs) for hs in where]
            out[i] = int(self.scheme.held_pages(on_i))
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            keys = len(self._index)
        return {
            **self.counters,
            "keys": keys,
            "endpoint": self.endpoint,
            "scheme": None if self.scheme is None else self.scheme.seed,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
