"""The SSD tier of a client: objects offloaded from its memory segment to a directory.

Contract: one file per key under ``path`` (name = SHA-256 of the key), written to a
temporary name and renamed, so a reader never sees a partial file. ``read_into``
returns False when the file is missing. Not shared between processes.

:func:`~mooncake_core.store.ssd_withdraw.withdraw_ssd_tier` takes a live client's tier away
again (the master's ``drop_disk``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

__all__ = ["SsdTier"]

logger = logging.getLogger(__name__)


class SsdTier:
    """Files of offloaded objects in ``path`` (created if needed)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.cleared = False  # set by clear(): a write finishing later removes its own file

    def _file(self, key: str) -> Path:
        return self.path / (hashlib.sha256(key.encode()).hexdigest() + ".obj")

    def write(self, key: str, data: memoryview) -> None:
        f = self._file(key)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, f)
        if self.cleared:  # the tier was withdrawn while this write ran (clear() may have missed it)
            f.unlink(missing_ok=True)

    def read_into(self, key: str, view: memoryview) -> bool:
        f = self._file(key)
        try:
            with open(f, "rb", buffering=0) as fh:
                n = fh.readinto(view)
        except FileNotFoundError:
            return False
        if n != len(view):
            logger.warning("SSD copy of %r is %d bytes, expected %d", key, n, len(view))
            return False
        return True

    def delete(self, key: str) -> None:
        try:
            self._file(key).unlink()
        except FileNotFoundError:
            pass

    def __contains__(self, key: str) -> bool:
        return self._file(key).exists()

    def clear(self) -> None:
        self.cleared = True  # before listing: a write that replaces its file after that sees it
        for f in self.path.glob("*.obj"):
            f.unlink(missing_ok=True)
