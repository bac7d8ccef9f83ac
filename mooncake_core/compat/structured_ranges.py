"""Byte ranges of chunked payloads, read from a :class:`BundleStore` moving only what is needed.

A payload (see :mod:`structured_bundle`) is a list of chunks, each its own store key.
:func:`read_ranges_into` copies ``(offset in the payload, offset in the destination,
length)`` ranges of one into a writable buffer:

- a chunk that a range covers whole is read with ``get``, once however many ranges it
  holds (and dropped as soon as its last range is copied);
- parts of chunks are read with one ``get_into_ranges`` call into a staging buffer
  registered for it (``register_buffer`` / ``unregister_buffer``) when the store has those
  three calls, as ours and the published ``MooncakeDistributedStore`` do: only the parts'
  bytes move (our store reads each range from the replica that holds it, see
  ``store_ranges.py``). The published module's transport does the same; a store without
  them (a dict wrapper) gives the whole chunks with ``get``.

Adjacent ranges (consecutive rows) are merged first, so a slice of rows is one range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake_core.compat.structured_types import BundleStore

__all__ = ["merge_ranges", "range_fragments", "read_ranges_into"]

#: (key, chunk size, destination offset, offset in the chunk, bytes)
Fragment = tuple[str, int, int, int, int]


def range_fragments(
    chunks: Sequence[Mapping[str, Any]], offset: int, length: int
) -> list[Fragment]:
    """Per chunk that overlaps ``[offset, offset+length)``: (key, chunk size,
    destination offset, offset in the chunk, bytes)."""
    out = []
    end, at = offset + length, 0
    for chunk in chunks:
        size = int(chunk["bytes"])
        lo, hi = max(offset, at), min(end, at + size)
        if lo < hi:
            out.append((chunk["key"], size, lo - offset, lo - at, hi - lo))
        at += size
    return out


def merge_ranges(ranges: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(source offset, destination offset, length)`` ranges, in order, each one that
    continues the previous on both sides merged into it, empty ones dropped."""
    out: list[tuple[int, int, int]] = []
    for src, dst, n in ranges:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + int(n))
        else:
            out.append((int(src), int(dst), int(n)))
    return out


def read_ranges_into(
    store: BundleStore,
    chunks: Sequence[Mapping[str, Any]],
    dest: Any,
    ranges: Sequence[tuple[int, int, int]],
) -> None:
    """Copy ``(offset in the payload, offset in dest, length)`` ranges of the payload made
    of ``chunks`` into the writable ``dest`` (a bytearray, memoryview or uint8 array)."""
    frags = [
        (key, size, dst + at, src, n)
        for off, dst, length in merge_ranges(ranges)
        for key, size, at, src, n in range_fragments(chunks, off, length)
    ]
    parts = [f for f in frags if f[4] < f[1]]
    if parts and _read_parts(store, dest, parts):
        frags = [f for f in frags if f[4] >= f[1]]
    uses: dict[str, int] = {}
    for f in frags:
        uses[f[0]] = uses.get(f[0], 0) + 1
    fetched: dict[str, bytes] = {}
    for key, size, at, src, n in frags:
        data = fetched.pop(key, None)
        if data is None:
            data = store.get(key)
            if len(data) != size:
                raise RuntimeError(f"get failed for {key}: expected {size} bytes, got {len(data)}")
        uses[key] -= 1
        if uses[key]:
            fetched[key] = data
        dest[at : at + n] = memoryview(data)[src : src + n]


def _read_parts(store: BundleStore, dest: Any, parts: Sequence[Fragment]) -> bool:
    """Read the parts with the store's ``get_into_ranges`` (one call) into a registered
    staging buffer, then copy them to ``dest``; False, nothing read, when the store cannot
    (no such calls, or the staging buffer could not be registered)."""
    get_into_ranges = getattr(store, "get_into_ranges", None)
    register = getattr(store, "register_buffer", None)
    unregister = getattr(store, "unregister_buffer", None)
    if not (callable(get_into_ranges) and callable(register) and callable(unregister)):
        return False
    total = sum(p[4] for p in parts)
    staging = np.empty(total, dtype=np.uint8)
    ptr = int(staging.ctypes.data)
    if register(ptr, total) != 0:
        return False
    plan: dict[str, tuple[list[int], list[int], list[int]]] = {}
    at = 0
    for key, _size, _dst, src, n in parts:
        dsts, srcs, sizes = plan.setdefault(key, ([], [], []))
        dsts.append(at)
        srcs.append(src)
        sizes.append(n)
        at += n
    keys = list(plan)
    try:
        got = get_into_ranges(
            [ptr],
            [keys],
            [[plan[k][0] for k in keys]],
            [[plan[k][1] for k in keys]],
            [[plan[k][2] for k in keys]],
        )
    finally:
        unregister(ptr)
    if len(got) != 1 or len(got[0]) != len(keys):
        raise RuntimeError(f"get_into_ranges returned an invalid result for {len(keys)} keys")
    for key, answers in zip(keys, got[0], strict=True):
        if list(answers) != plan[key][2]:
            raise RuntimeError(
                f"get_into_ranges failed for {key}: expected {plan[key][2]}, got {list(answers)}"
            )
    view, at = memoryview(staging.data), 0
    for _key, _size, dst, _src, n in parts:
        dest[dst : dst + n] = view[at : at + n]
        at += n
    return True
