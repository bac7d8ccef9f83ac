"""KV-cache events from the store master: every object stored, evicted or removed, over ZMQ.

``mooncake-core master --kv-events-endpoint tcp://127.0.0.1:5557`` (published spelling:
``--enable_kv_events --kv_events_bind_endpoint=tcp://...``) binds a ZMQ PUB socket there.
Each message is what vLLM's KV-event publisher sends, so routers that read vLLM's (or
SGLang's) events read the store's too:

- frames ``(topic, 8-byte big-endian sequence number, payload)``;
- payload: a msgpack ``EventBatch`` ``[ts, [event, ...], dp_rank]``, each event a map tagged
  ``"type"``: ``BlockStored`` (an object became readable, or its holders or medium changed),
  ``BlockRemoved`` (removed, evicted, or its holders went away), ``AllBlocksCleared``
  (sent once when the publisher starts: the master knows of no earlier announcement).

A store object is not a chain of token blocks: each event names one object. Its
``block_hashes`` is one 64-bit hash of the key (``key_hash``), ``parent_block_hash`` is
None, ``token_ids`` is empty and ``block_size`` 0 (the vLLM-compatible fields). Store fields
added to each event (ignored by vLLM's decoder, read by
:mod:`mooncake_core.proxy.store_events`): ``object_key`` (the key as its client named it),
``size``, ``holders`` (segment names of the memory replicas), ``tenant`` (the object's
tenant, ``""`` for the default; :mod:`mooncake_core.store.tenants`) and ``backend_id``.
``medium`` is ``"CPU"`` for objects in the memory pool and ``"STORAGE"`` for objects only
on a client's SSD tier.

Queue: the master's event loop only appends to a bounded queue (``queue_capacity``
events); a publisher thread takes up to ``batch_max`` events at a time (waiting at most
``flush_s`` for more) and sends them as one batch. When the queue is full the oldest events
are dropped and counted (``dropped``): a master never waits for its readers.

Thread-safety: :meth:`KVEventPublisher.observe` runs on the master's loop, the sender on
its own thread; they share the queue under a lock.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from mooncake_core.errors import ConfigError, MissingDependency

if TYPE_CHECKING:
    from mooncake_core.store.state import MasterState

__all__ = [
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "EventBatch",
    "KVEventPublisher",
    "check_endpoint",
    "key_hash",
    "MEDIUM_MEMORY",
    "MEDIUM_SSD",
]

logger = logging.getLogger(__name__)

MEDIUM_MEMORY = "CPU"
MEDIUM_SSD = "STORAGE"

_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):\d{1,5}|ipc://.+)$")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's event batch: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """An object is readable (vLLM's ``BlockStored`` fields, then the store's)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    object_key: str = ""
    size: int = 0
    holders: list[str] = []
    tenant: str = ""
    backend_id: str = ""


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """An object is gone from ``medium`` (vLLM's ``BlockRemoved`` fields, then the store's)."""

    block_hashes: list[int]
    medium: str | None
    object_key: str = ""
    tenant: str = ""
    backend_id: str = ""


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """Forget everything announced before (sent when the publisher starts)."""


def key_hash(key: str) -> int:
    """The 64-bit block hash an event carries for object ``key`` (blake2b, unsigned)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def check_endpoint(endpoint: str, what: str = "--kv-events-endpoint") -> str:
    """``tcp://HOST:PORT`` or ``ipc://PATH``; raises a one-line :class:`ConfigError`."""
    text = (endpoint or "").strip()
    if not _ENDPOINT.match(text):
        raise ConfigError(
            f"{what}: {endpoint!r} is not a ZMQ endpoint; use tcp://HOST:PORT "
            "(e.g. tcp://127.0.0.1:5557) or ipc://PATH"
        )
    return text


_Announced = tuple[str, tuple[str, ...], str]  # medium, holders, tenant


class KVEventPublisher:
    """Turns the master's change entries into KV events and publishes them (module doc).

    Args:
        endpoint: where to bind the PUB socket (``tcp://127.0.0.1:5557``).
        queue_capacity: most events waiting to be sent (oldest dropped beyond; 0: unbounded).
        batch_max: most events in one message.
        flush_s: longest an event waits for others to share its message.
        backend_id: copied into every event (the published ``--kv_events_backend_id``).
        topic: the first frame of every message.
        tenant_of: the tenant of a key (None: every event says ``""``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        queue_capacity: int = 65536,
        batch_max: int = 512,
        flush_s: float = 0.005,
        backend_id: str = "",
        topic: str = "",
        tenant_of: Callable[[str], str] | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        if queue_capacity < 0 or batch_max <= 0:
            raise ConfigError(
                f"--kv-events-queue must be >= 0 and the batch size > 0, got "
                f"{queue_capacity}, {batch_max}"
            )
        try:
            import zmq
        except ImportError as exc:
            raise MissingDependency("zmq", "the master's --kv-events-endpoint") from exc
        self._zmq = zmq
        self.capacity = queue_capacity
        self.batch_max = batch_max
        self.flush_s = flush_s
        self.backend_id = backend_id
        self._topic = topic.encode()
        self.tenant_of = tenant_of
        self._ctx: Any = zmq.Context.instance()
        self._sock: Any = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ConfigError(f"--kv-events-endpoint {self.endpoint}: cannot bind: {exc}") from None
        self.bound = str(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._announced: dict[str, _Announced] = {}
        self._seq = 0
        self._enc = msgspec.msgpack.Encoder()
        self.counters = {"events": 0, "batches": 0, "dropped": 0, "send_errors": 0}
        self._push(AllBlocksCleared())
        self._thread = threading.Thread(target=self._run, name="mc-kv-events-pub", daemon=True)
        self._thread.start()
        logger.info("publishing store KV events on %s", self.bound)

    # ------------------------------------------------------------------ master side
    def sink(self, inner: Callable[[tuple[Any, ...]], None], state: MasterState) -> Any:
        """A change sink for ``state.on_change`` that feeds ``inner`` and then observes."""

        def on_change(entry: tuple[Any, ...]) -> None:
            inner(entry)
            self.observe(entry, state)

        return on_change

    def observe(self, entry: tuple[Any, ...], state: MasterState) -> None:
        """One change entry of ``state`` (see :mod:`mooncake_core.store.replication`)."""
        kind = entry[0]
        if kind == "obj":
            self._refresh(entry[1], state)
        elif kind == "del":
            self._gone(entry[1])
        elif kind in ("unseg", "unclient"):
            # objects that lost replicas with a segment emit nothing of their own
            for key in list(self._announced):
                self._refresh(key, state)

    def _refresh(self, key: str, state: MasterState) -> None:
        o = state.objects.get(key)
        if o is None or not o.complete:
            self._gone(key)
            return
        if o.replicas:
            medium = MEDIUM_MEMORY
            holders = tuple(sorted({x[0] for rep in o.replicas for x in rep}))
        elif o.disk:
            medium, holders = MEDIUM_SSD, ()
        else:
            self._gone(key)
            return
        tenant = self.tenant_of(key) if self.tenant_of is not None else ""
        now = (medium, holders, tenant)
        old = self._announced.get(key)
        if old == now:
            return
        if old is not None:
            self._push(self._removed(key, old))
        self._announced[key] = now
        self._push(
            BlockStored(
                [key_hash(key)],
                None,
                [],
                0,
                None,
                medium,
                None,
                object_key=key[len(tenant) + 1 :] if tenant else key,
                size=o.size,
                holders=list(holders),
                tenant=tenant,
                backend_id=self.backend_id,
            )
        )

    def _gone(self, key: str) -> None:
        old = self._announced.pop(key, None)
        if old is not None:
            self._push(self._removed(key, old))

    def _removed(self, key: str, old: _Announced) -> BlockRemoved:
        user = key[len(old[2]) + 1 :] if old[2] else key
        return BlockRemoved(
            [key_hash(key)], old[0], object_key=user, tenant=old[2], backend_id=self.backend_id
        )

    def _push(self, ev: Any) -> None:
        with self._cond:
            q = self._queue
            if self.capacity and len(q) >= self.capacity:
                q.popleft()
                self.counters["dropped"] += 1
            q.append(ev)
            if len(q) == 1 or len(q) >= self.batch_max:
                self._cond.notify()

    # ------------------------------------------------------------------ sender
    def _run(self) -> None:
        zmq = self._zmq
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                if len(self._queue) < self.batch_max and not self._stop:
                    self._cond.wait(self.flush_s)  # let a burst share one message
                n = min(len(self._queue), self.batch_max)
                events = [self._queue.popleft() for _ in range(n)]
            if not events:
                continue
            payload = self._enc.encode(EventBatch(time.time(), events))
            self._seq += 1
            try:
                self._sock.send_multipart(
                    (self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
                self.counters["events"] += n
                self.counters["batches"] += 1
            except zmq.ZMQError as exc:  # PUB drops at its high-water mark; anything else: count
                self.counters["send_errors"] += 1
                logger.debug("KV event batch %d not sent: %s", self._seq, exc)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                **self.counters,
                "queued": len(self._queue),
                "announced": len(self._announced),
            }

    def close(self) -> None:
        """Send what is queued (at most 1 s), then close the socket."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=1.0)
        self._sock.close(linger=0)
