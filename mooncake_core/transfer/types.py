"""Value types shared by the engine, its listener and the transports, and the narrow
interfaces each of them sees of the others.

- :class:`WorkItem` (with :data:`READ` / :data:`WRITE`): one slice of a request, as a
  transport moves it.
- :class:`PeerInfo`: what the engine knows about a peer (addresses, segment descriptor).
- :class:`ControlChannel`: a transport that also carries control messages (descriptor
  requests, pings, notifications, tensors, the RDMA queue-pair exchange); the TCP
  transport is one.
- :class:`TransportHost`: exactly what a transport needs from its engine. Transports get
  this, never :class:`~mooncake_core.transfer.engine.TransferEngine` itself.
- :class:`ListenerHost`: exactly what the listener (:mod:`~mooncake_core.transfer.server`)
  needs from its engine.

This module imports no engine, listener or transport, so all of them can import it.
"""

from __future__ import annotations

import bisect
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncake_core.config import MooncakeConfig
from mooncake_core.transfer.control import ControlInbox
from mooncake_core.transfer.memory import SegmentTable

__all__ = [
    "READ",
    "WRITE",
    "WorkItem",
    "PeerInfo",
    "ControlChannel",
    "TransportHost",
    "ListenerHost",
]

READ = 0
WRITE = 1


@dataclass(eq=False)
class WorkItem:
    """One contiguous piece of a request (the engine cuts requests into slices).

    Attributes:
        req: index of the request in its batch.
        op: :data:`READ` (remote -> local) or :data:`WRITE` (local -> remote).
        local_addr: address of the local bytes.
        local_view: host memoryview of the local bytes (staging for device memory).
        remote_addr: address in the peer's registered memory.
        length: number of bytes.
        done: set by the transport when the bytes have moved (writes: acknowledged).
        error: a permanent error for this item (no retry or failover helps).
    """

    req: int
    op: int
    local_addr: int
    local_view: memoryview
    remote_addr: int
    length: int
    done: bool = False
    error: BaseException | None = None
    attempts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PeerInfo:
    """What we know about a peer: where it listens and what it registered."""

    name: str
    addresses: list[tuple[str, int]]
    desc: dict[str, Any]
    host_id: str = ""
    pid: int = 0
    regions: list[dict[str, Any]] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.regions = sorted(self.desc.get("buffers", []), key=lambda r: int(r["addr"]))
        self._starts = [int(r["addr"]) for r in self.regions]
        self.host_id = str(self.desc.get("host_id", ""))
        self.pid = int(self.desc.get("pid", 0))

    def find_region(self, addr: int, length: int) -> dict[str, Any] | None:
        """The registered region holding ``[addr, addr+length)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        r = self.regions[i]
        return r if addr + length <= int(r["addr"]) + int(r["length"]) else None

    def region_named(self, name: str) -> dict[str, Any] | None:
        """The region the peer registered under ``name``, or None."""
        return next((r for r in self.regions if r.get("name") == name), None)


class ControlChannel(Protocol):
    """Carries control requests (opcodes of :class:`~mooncake_core.transfer.protocol.Op`)
    to a peer's listener and returns its answer."""

    def control(
        self,
        peer: PeerInfo,
        op: int,
        deadline: float,
        *,
        payload: bytes = b"",
        aux: int = 0,
        extra: memoryview | None = None,
    ) -> tuple[int, bytes]:
        """Send one control request; return ``(status, reply body)``.

        Raises:
            PeerUnreachable: the request could not be delivered.
        """
        ...

    def drop_peer(self, name: str) -> None:
        """Forget the connections to peer ``name`` (it went away or changed)."""
        ...


class TransportHost(Protocol):
    """What a transport may use of its engine (the engine implements this)."""

    @property
    def config(self) -> MooncakeConfig:
        """The engine's configuration (``transfer.*`` and ``device_name``)."""
        ...

    @property
    def name(self) -> str:
        """The engine's segment name (how peers address it)."""
        ...

    @property
    def host_id(self) -> str:
        """Identity of this host as seen by shared memory (boot id and namespaces)."""
        ...

    @property
    def source_addresses(self) -> list[str]:
        """Local addresses to stripe outgoing connections over (empty: let the OS pick)."""
        ...

    @property
    def io_pool(self) -> Executor:
        """Worker threads for a transport's parallel work (connections, copy shares)."""
        ...

    @property
    def segments(self) -> SegmentTable:
        """This engine's registered memory."""
        ...

    def control(
        self,
        peer: PeerInfo,
        op: int,
        deadline: float,
        *,
        payload: bytes = b"",
        aux: int = 0,
        extra: memoryview | None = None,
    ) -> tuple[int, bytes]:
        """One control request to ``peer`` over the engine's control channel."""
        ...


class ListenerHost(Protocol):
    """What the engine's listener may use of its engine (the engine implements this)."""

    @property
    def segments(self) -> SegmentTable:
        """This engine's registered memory: every remote read and write is checked here."""
        ...

    @property
    def inbox(self) -> ControlInbox:
        """Where tensors and notifications from peers are delivered."""
        ...

    def describe(self) -> dict[str, Any]:
        """This engine's segment descriptor (answer to a peer's descriptor request)."""
        ...

    def accept_rdma(self, info: dict[str, Any]) -> dict[str, Any]:
        """Server side of a peer's RDMA queue-pair exchange; returns our queue pair."""
        ...
