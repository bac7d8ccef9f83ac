"""The transport contract.

A transport moves the bytes of :class:`WorkItem` s between this process and one peer.
The engine picks transports per peer by priority (shared memory, then RDMA, then TCP)
and fails over to the next one when a transport raises :class:`TransportError`.

- :meth:`Transport.can_reach` -- *Called by* the engine when it plans a batch;
  *Blocking*: no; answers from the peer's descriptor only.
- :meth:`Transport.execute` -- *Called by* the engine's worker threads;
  *Blocking*: yes, until every item is done or failed; *Thread-safety*: may be called
  concurrently for the same or different peers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mooncake_core.transfer.engine import PeerInfo, TransferEngine

__all__ = ["Transport", "WorkItem", "READ", "WRITE"]

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


class Transport(ABC):
    """A way to move bytes to and from one kind of peer."""

    name: str = "base"

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine

    @abstractmethod
    def can_reach(self, peer: PeerInfo) -> bool:
        """Whether this transport can serve ``peer`` (from its descriptor)."""

    @abstractmethod
    def execute(self, peer: PeerInfo, items: list[WorkItem], deadline: float) -> None:
        """Move every item; mark each ``done`` or set its ``error``.

        Raises:
            TransportError: the transport failed for the items still not done; the engine
                may retry them on another transport.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and mappings."""
