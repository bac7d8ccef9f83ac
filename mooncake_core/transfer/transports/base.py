"""The transport contract.

A transport moves the bytes of :class:`WorkItem` s between this process and one peer.
The engine picks transports per peer by priority (shared memory, then RDMA, then TCP)
and fails over to the next one when a transport raises :class:`TransportError`.

A transport sees its engine only through :class:`~mooncake_core.transfer.types.TransportHost`
(configuration, registered memory, worker pool, control requests), never the engine
class itself.

- :meth:`Transport.can_reach` -- *Called by* the engine when it plans a batch;
  *Blocking*: no; answers from the peer's descriptor only.
- :meth:`Transport.execute` -- *Called by* the engine's worker threads;
  *Blocking*: yes, until every item is done or failed; *Thread-safety*: may be called
  concurrently for the same or different peers.
- :meth:`Transport.control` -- only on a transport that sets ``carries_control``: the
  engine sends its control messages (descriptor requests, pings, notifications, tensors,
  the RDMA queue-pair exchange) through the first loaded transport that does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from mooncake_core.errors import TransportError
from mooncake_core.transfer.types import READ, WRITE, PeerInfo, TransportHost, WorkItem

__all__ = ["Transport", "WorkItem", "READ", "WRITE"]


class Transport(ABC):
    """A way to move bytes to and from one kind of peer.

    Attributes:
        name: protocol string (``"tcp"``, ``"shm"``, ``"rdma"``).
        carries_control: True when the transport implements :meth:`control` and
            :meth:`drop_peer`, i.e. it is a :class:`~mooncake_core.transfer.types.ControlChannel`.
        engine: the engine, seen through :class:`~mooncake_core.transfer.types.TransportHost`.
    """

    name: str = "base"
    carries_control: ClassVar[bool] = False

    def __init__(self, engine: TransportHost) -> None:
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
        """Send one control request to ``peer``; return ``(status, reply body)``.

        Raises:
            TransportError: this transport carries no control messages (the default).
        """
        raise TransportError(f"the {self.name} transport carries no control messages")

    def drop_peer(self, name: str) -> None:  # noqa: B027 - optional hook
        """Forget what this transport holds for peer ``name`` (connections, mappings)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and mappings."""
