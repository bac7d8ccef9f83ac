"""Transfer requests and batches: what callers hand the engine and wait on.

:class:`TransferRequest` names one read or write; :meth:`TransferEngine.submit
<mooncake_core.transfer.engine.TransferEngine.submit>` returns a :class:`Batch` whose
``wait()`` raises the first failure (naming the request and how many failed) and whose
``statuses`` hold one :class:`RequestStatus` per request. :class:`DoneBatch` is a batch run to
completion in the calling thread (the synchronous path: no future, nobody waits on another
thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mooncake_core.errors import InvalidRequest, TransportError
from mooncake_core.transfer.memory import Region, SegmentTable, buffer_address, host_view
from mooncake_core.transfer.types import READ, WRITE

__all__ = [
    "OPS",
    "TransferRequest",
    "RequestStatus",
    "Batch",
    "DoneBatch",
    "wait_all",
    "local_side",
    "staging",
]

#: a request's ``op`` as given (name or constant) -> READ / WRITE
OPS = {"read": READ, "write": WRITE, READ: READ, WRITE: WRITE}


@dataclass
class TransferRequest:
    """One read or write between local memory and a peer's registered memory.

    Attributes:
        op: ``"read"`` (peer -> local) or ``"write"`` (local -> peer).
        peer: the peer's segment name (``host:port`` with the handshake metadata).
        local: a buffer object (bytearray, memoryview, numpy array, torch tensor) or an
            address inside this engine's registered memory.
        length: bytes to move; defaults to the size of ``local`` (required with an address).
        remote_addr: absolute address in the peer's registered memory; or give
        segment: the name of a region the peer registered, plus
        offset: an offset inside it.
        transport: force a transport (``"tcp"``, ``"shm"``, ``"rdma"``) for this request.
    """

    op: str | int
    peer: str
    local: Any
    length: int | None = None
    remote_addr: int | None = None
    segment: str | None = None
    offset: int = 0
    transport: str | None = None


@dataclass
class RequestStatus:
    """Per-request status inside a batch."""

    state: str = "pending"  # pending | completed | failed | timeout
    transferred: int = 0
    error: BaseException | None = None


class Batch:
    """An asynchronous batch of requests. ``wait()`` raises if any request failed."""

    _ids = itertools.count(1)
    _named: tuple[BaseException, ...] = ()  # errors whose message already names their request

    def __init__(self, requests: Sequence[TransferRequest]) -> None:
        self.id = next(Batch._ids)
        self.requests = list(requests)
        self.statuses = [RequestStatus() for _ in requests]
        self.future: Future[None] = Future()

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every request finished; raise the first failure."""
        self.future.result(timeout)

    def _finish(self) -> None:
        exc = self._failure()
        if exc is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(exc)

    def _failure(self) -> BaseException | None:
        """The exception naming the first failed request (and how many failed), or None."""
        failed = [(i, s) for i, s in enumerate(self.statuses) if s.state != "completed"]
        if not failed:
            return None
        i, st = failed[0]
        cause = st.error or TransportError("transfer failed")
        req = self.requests[i]
        where = (
            f"segment {req.segment!r}+{req.offset}"
            if req.segment is not None
            else (f"0x{req.remote_addr:x}" if isinstance(req.remote_addr, int) else "?")
        )
        what = f"request {i} ({req.op} to peer {req.peer!r} at {where})"
        if any(cause is e for e in self._named):
            what = ""
        lead = (
            f"{len(failed)} of {len(self.statuses)} requests failed; first: "
            if len(failed) > 1
            else ""
        )
        msg = f"{lead}{what}{': ' if what else ''}{cause}"
        try:
            exc: BaseException = (
                type(cause)(msg) if isinstance(cause, TransportError) else TransportError(msg)
            )
        except TypeError:
            exc = TransportError(msg)
        exc.__cause__ = cause
        return exc


class DoneBatch(Batch):
    """A batch run to completion in the calling thread (no future: nobody waits on another
    thread)."""

    def __init__(self, requests: Sequence[TransferRequest]) -> None:
        self.id = next(Batch._ids)
        self.requests = list(requests)
        self.statuses = [RequestStatus() for _ in requests]
        self._error: BaseException | None = None

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error

    def _finish(self) -> None:
        self._error = self._failure()


def wait_all(batches: Iterable[Batch], timeout: float | None = None) -> None:
    """Wait for several batches; raise the first failure."""
    for b in batches:
        b.wait(timeout)


def local_side(
    segments: SegmentTable, req: TransferRequest, i: int
) -> tuple[int, memoryview, int, Any]:
    """(addr, host view, length, staging-info) of the local side of request ``i``.

    An address must lie inside ``segments`` (this engine's registered memory); a buffer
    object is used where it lies. Device memory moves through a host staging buffer.
    """
    local = req.local
    if isinstance(local, int) and not isinstance(local, bool):
        if req.length is None:
            raise InvalidRequest(f"request {i}: a local address needs an explicit length")
        length = req.length
        if length <= 0:
            raise InvalidRequest(f"request {i}: length must be positive, got {length}")
        try:
            region = segments.find(local, length)
        except InvalidRequest as exc:
            raise InvalidRequest(f"request {i}: local buffer: {exc}") from None
        if region.kind != "host":
            return staging(region, local, length)
        return local, region.view(local, length), length, None
    addr, size, kind = buffer_address(local, writable=OPS.get(req.op) == READ)
    length = size if req.length is None else req.length
    if length <= 0:
        raise InvalidRequest(f"request {i}: length must be positive, got {length}")
    if length > size:
        raise InvalidRequest(
            f"request {i}: length {length} exceeds the local buffer ({size} bytes)"
        )
    if kind == "cuda":
        return staging(Region(addr, size, "staging", "cuda", owner=local), addr, length)
    return addr, host_view(addr, length), length, local


def staging(region: Region, device_addr: int, length: int) -> tuple[int, memoryview, int, Any]:
    """Device memory moves through a host staging buffer: (host addr, view, length, info)."""
    host = bytearray(length)
    host_addr = buffer_address(host)[0]
    return host_addr, memoryview(host), length, (region, device_addr, host_addr, host)
