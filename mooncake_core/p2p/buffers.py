"""Turning what a caller hands to ``register`` / ``get_replica(into=...)`` into memory.

Accepted: ``bytearray``, writable ``memoryview``, ``mmap``, numpy arrays, CPU torch tensors
(all served in place, no copy); ``bytes`` (copied once into registered memory); a path
(``str`` / :class:`os.PathLike`) to a file, mapped copy-on-write into memory, or to a
directory, whose regular files (recursively, sorted) become one buffer each, labelled
with their relative paths. A list or tuple of these is several buffers; a dict maps labels
to buffers.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_core.errors import SegmentError
from mooncake_core.p2p.errors import BadName
from mooncake_core.transfer.memory import buffer_address, host_view

__all__ = ["Source", "collect", "directory_files"]


@dataclass
class Source:
    """One buffer to publish: the object that owns the memory, its address and a view."""

    owner: Any
    addr: int
    view: memoryview
    label: str

    @property
    def size(self) -> int:
        return self.view.nbytes


def directory_files(root: Path) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every regular file under ``root``, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.is_file() and not p.is_symlink():
                out.append((p.relative_to(root).as_posix(), p))
    return out


def _map_file(path: Path) -> Any:
    size = path.stat().st_size
    if size == 0:
        return bytearray(0)
    with open(path, "rb") as fh:
        # copy-on-write: writable for the engine's registration, never written back
        return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)


def _one(obj: Any, label: str) -> list[Source]:
    if isinstance(obj, (str, os.PathLike)):
        path = Path(os.fspath(obj))
        if path.is_dir():
            files = directory_files(path)
            if not files:
                raise BadName(f"directory {str(path)!r} holds no files to publish")
            return [s for rel, p in files for s in _one(_map_file(p), rel)]
        if not path.is_file():
            raise BadName(f"{str(path)!r} is neither a file nor a directory")
        return _one(_map_file(path), label or path.name)
    if isinstance(obj, bytes):
        obj = bytearray(obj)  # read-only: one copy into writable memory
    if isinstance(obj, bytearray) and len(obj) == 0:
        return [Source(obj, 0, memoryview(obj), label)]
    try:
        addr, size, kind = buffer_address(obj)
    except SegmentError as exc:
        raise BadName(f"buffer {label or '#'}: {exc}") from None
    if kind != "host":
        raise BadName(f"buffer {label!r}: the P2P store serves host memory only (got {kind})")
    return [Source(obj, addr, host_view(addr, size), label)]


def collect(buffers: Any) -> list[Source]:
    """Every buffer in ``buffers`` (see the module docstring), in order."""
    if isinstance(buffers, Mapping):
        out: list[Source] = []
        for k, v in buffers.items():
            out += _one(v, str(k))
        return out
    if isinstance(buffers, Sequence) and not isinstance(
        buffers, (bytes, bytearray, str, memoryview)
    ):
        if not buffers:
            raise BadName("buffers: give at least one buffer")
        out = []
        for i, v in enumerate(buffers):
            out += _one(v, f"{i}")
        return out
    return _one(buffers, "")
