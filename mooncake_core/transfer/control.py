"""Control messages between engines, and the inbox that receives them.

Besides moving bytes, engines exchange small control requests over a
:class:`~mooncake_core.transfer.types.ControlChannel` (today the TCP transport's first
connection to the peer): ``DESC`` (the peer's segment descriptor), ``PING``,
``NOTIFY`` (a ``(name, msg)`` notification), ``TENSOR`` (a tensor sent under a key) and
``RDMA_CONNECT`` (the queue-pair exchange). The sending side lives in
:class:`~mooncake_core.transfer.engine.TransferEngine` (``peer``, ``ping``, ``notify``,
``put_tensor``) and in the RDMA transport; the receiving side is the listener
(:mod:`~mooncake_core.transfer.server`), which hands what arrives to the engine's
:class:`ControlInbox`.
"""

from __future__ import annotations

import threading

from mooncake_core.transfer.tensors import TensorInbox

__all__ = ["ControlInbox"]


class ControlInbox:
    """What peers sent this engine: tensors by key, and notifications in arrival order.

    *Thread-safety*: all methods (the listener delivers from its connection threads).
    """

    def __init__(self) -> None:
        self.tensors = TensorInbox()
        self._notifies: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def deliver_notify(self, name: str, msg: str) -> None:
        """Queue a notification (called by the listener)."""
        with self._lock:
            self._notifies.append((name, msg))

    def take_notifies(self) -> list[tuple[str, str]]:
        """Every notification queued since the last call, oldest first."""
        with self._lock:
            out, self._notifies = self._notifies, []
        return out
