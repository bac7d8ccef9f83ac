"""Where KV blocks live: per-instance LRU caches, a shared store pool, and a holder index.

Contract:

- Holders are numbered ``0 .. n-1`` (prefill instances) and ``n`` (the shared store).
- :meth:`BlockIndex.match` walks a request's prefix-chained block hashes once and returns
  every holder's matched prefix length (in blocks) and the prefix available anywhere in
  the pool (a block id names its whole prefix, so a chain may be assembled from several
  holders), using one bitmask of holders per block: its cost grows with the prompt
  length, not with the number of instances.
- :meth:`BlockIndex.insert` adds/refreshes blocks on a holder. With a capacity, the least
  recently used blocks are evicted; blocks evicted from an instance are demoted to the
  store if it has room (a victim cache). Without a capacity (``None``) nothing is evicted:
  that is the mode for a live cluster, where instances report evictions as KV events
  through :meth:`BlockIndex.remove`.
- Blocks of one prompt are inserted last-to-first, so a prefix is always more recent than
  its continuation and LRU eviction trims chains from the tail, never leaving a gap.

Thread-safety: none; the conductor serialises access.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["BlockIndex"]

logger = logging.getLogger(__name__)


class BlockIndex:
    """KV-block holdings of ``n`` prefill instances plus one shared store pool.

    Args:
        n_instances: Number of prefill instances (> 0).
        capacity_blocks: Per-instance capacity in blocks, or ``None`` for unbounded.
        store_blocks: Store pool capacity in blocks (0: no store; ``None``: unbounded).
    """

    def __init__(
        self, n_instances: int, capacity_blocks: int | None = None, store_blocks: int | None = 0
    ) -> None:
        if n_instances <= 0:
            raise ValueError("n_instances must be > 0")
        self.n = n_instances
        self.store = n_instances
        self._caps: list[int | None] = [capacity_blocks] * n_instances + [store_blocks]
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_instances + 1)]
        self._holders: dict[int, int] = {}
        self._nbytes = (n_instances + 1 + 7) // 8
        self.evictions = 0
        self.demotions = 0

    # --- queries -----------------------------------------------------------------------

    def _bits_to_bool(self, mask: int) -> np.ndarray:
        raw = np.frombuffer(mask.to_bytes(self._nbytes, "little"), dtype=np.uint8)
        return np.unpackbits(raw, bitorder="little")[: self.n + 1].astype(bool)

    def match(self, blocks: Sequence[int]) -> tuple[np.ndarray, int]:
        """Match a prompt's prefix-chained blocks against every holder.

        Returns:
            ``(lengths, union)``: each holder's own matched prefix length in blocks (array
            of ``n + 1`` ints, entry ``n`` is the store) and the length of the prefix whose
            every block is held *somewhere* (possibly by different holders).
        """
        out = np.zeros(self.n + 1, dtype=np.int64)
        holders = self._holders
        alive = 0
        for pos, h in enumerate(blocks):
            m = holders.get(h, 0)
            if pos == 0:
                alive = m
            elif alive:
                dropped = alive & ~m
                if dropped:
                    self._set(out, dropped, pos)
                alive &= m
            if not m:
                return out, pos
        if alive:
            self._set(out, alive, len(blocks))
        return out, len(blocks)

    def _set(self, out: np.ndarray, mask: int, value: int) -> None:
        if mask & (mask - 1) == 0:  # one holder: skip numpy
            out[mask.bit_length() - 1] = value
        else:
            out[self._bits_to_bool(mask)] = value

    def holds(self, holder: int, block: int) -> bool:
        """True if ``holder`` holds ``block``."""
        return bool(self._holders.get(block, 0) >> holder & 1)

    def size(self, holder: int) -> int:
        """Number of blocks on ``holder``."""
        return len(self._lru[holder])

    # --- updates -----------------------------------------------------------------------

    def insert(self, holder: int, blocks: Sequence[int]) -> list[int]:
        """Add or refresh ``blocks`` on ``holder``; return the blocks it evicted.

        Blocks evicted from an instance move to the store when it has capacity.
        """
        lru = self._lru[holder]
        holders = self._holders
        bit = 1 << holder
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        cap = self._caps[holder]
        evicted: list[int] = []
        if cap is not None:
            while len(lru) > cap:
                h, _ = lru.popitem(last=False)
                rest = holders[h] & ~bit
                if rest:
                    holders[h] = rest
                else:
                    del holders[h]
                evicted.append(h)
            self.evictions += len(evicted)
        if evicted and holder != self.store and self._caps[self.store] != 0:
            new = [h for h in evicted if not self.holds(self.store, h)]
            if new:
                self.demotions += len(new)
                # Evicted blocks come oldest-first; insert() walks its argument backwards.
                self.insert(self.store, new[::-1])
        return evicted

    def touch(self, holder: int, blocks: Sequence[int]) -> None:
        """Mark ``blocks`` (held by ``holder``) as recently used; unknown ones are ignored."""
        lru = self._lru[holder]
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)

    def remove(self, holder: int, blocks: Iterable[int]) -> None:
        """Forget ``blocks`` on ``holder`` (a KV-removed event); unknown ones are ignored."""
        lru = self._lru[holder]
        bit = 1 << holder
        for h in blocks:
            if lru.pop(h, 0) is None:
                rest = self._holders.get(h, 0) & ~bit
                if rest:
                    self._holders[h] = rest
                else:
                    self._holders.pop(h, None)

    def clear(self, holder: int) -> None:
        """Forget everything on ``holder`` (instance restarted)."""
        self.remove(holder, list(self._lru[holder]))
