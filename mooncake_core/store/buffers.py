"""The store client's view of the caller's memory: any buffer, or an address in registered memory.

- :func:`as_view` turns bytes, bytearray, memoryview, numpy arrays and CPU torch tensors into
  one flat byte memoryview (device memory is refused: copy it to the host first).
- :class:`LocalBuffer` is the local side of one object in a put or get: either such a view or
  an address plus length inside memory registered with the transfer engine.
- :func:`nbytes` is the byte size of an array-like without building a view of it.
"""

from __future__ import annotations

from typing import Any

from mooncake_core.errors import SegmentError
from mooncake_core.store.protocol import InvalidArgument
from mooncake_core.transfer.memory import buffer_address, host_view

__all__ = ["LocalBuffer", "as_view", "nbytes"]


def as_view(obj: Any, writable: bool) -> tuple[memoryview, Any]:
    """A flat byte memoryview of ``obj`` (plus an object to keep alive)."""
    if isinstance(obj, memoryview):
        mv = obj
    elif isinstance(obj, (bytes, bytearray)):
        mv = memoryview(obj)
    else:
        try:
            addr, n, kind = buffer_address(obj, writable=writable)
        except SegmentError as exc:
            raise InvalidArgument(str(exc)) from None
        if kind != "host":
            raise InvalidArgument(
                "device memory is not supported by the store client; copy it to the host first"
            )
        return host_view(addr, n), obj
    if mv.readonly and writable:
        raise InvalidArgument(
            f"{type(obj).__name__} is read-only; get_into needs a writable buffer"
        )
    if not mv.contiguous:
        raise InvalidArgument("buffer must be contiguous")
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv, obj


class LocalBuffer:
    """The local side of one object: a memoryview or an address in registered memory."""

    __slots__ = ("view", "addr", "length", "keep", "_a")

    def __init__(self, obj: Any, size: int | None, writable: bool) -> None:
        self.keep: Any = obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            if size is None or size <= 0:
                raise InvalidArgument(f"an address needs a positive size, got {size!r}")
            self.view: memoryview | None = None
            self.addr = obj
            self.length = size
            return
        mv, self.keep = as_view(obj, writable)
        if size is not None:
            if size <= 0 or size > len(mv):
                raise InvalidArgument(f"size {size} must be 1..{len(mv)} (the buffer's length)")
            mv = mv[:size]
        self.view = mv
        self.addr = 0
        self.length = len(mv)

    def part(self, off: int, n: int) -> Any:
        """``n`` bytes at ``off``: a view slice, or an address."""
        return self.view[off : off + n] if self.view is not None else self.addr + off

    def address(self) -> int:
        """The address of the first byte (looked up once for a view)."""
        if self.view is None:
            return self.addr
        a: int = getattr(self, "_a", 0)
        if not a:
            a = self._a = buffer_address(self.view, writable=False)[0]
        return a

    def first(self, n: int, obj: Any) -> LocalBuffer:
        """The first ``n`` bytes of this buffer (``obj``: what it was made from)."""
        return LocalBuffer(obj if self.view is not None else self.addr, n, True)


def nbytes(obj: Any) -> int:
    """The byte size of an array, tensor or buffer."""
    n = getattr(obj, "nbytes", None)
    if n is None and hasattr(obj, "element_size"):
        n = obj.numel() * obj.element_size()
    return int(n) if n is not None else len(memoryview(obj).cast("B"))
