"""``mooncake.store.EngramStore`` / ``EngramStoreConfig``: embedding tables in the store.

A layer's Engram tables (DeepSeek Engram-style n-gram hash embeddings, one table per head)
live in the distributed store and are read row by row. Behaviour as observed by running the
published wheel (0.3.13; tests/integration/test_compat_engram.py runs one script against
both):

- ``EngramStoreConfig()``: ``embedding_dim`` (C ``int``, default 64) and
  ``table_vocab_sizes`` (``list[int64]``, default ``[1024]``); the getter returns a copy.
  Values are checked when an ``EngramStore`` is made from it (``ValueError``).
- ``EngramStore(layer_id, config, store=None)`` copies the config. Head ``h``'s table is
  the object ``engram:l{layer_id}:h{h}``: ``table_vocab_sizes[h] * embedding_dim``
  float32 values, row-major (C order), nothing else.
- ``populate(list_of_arrays)``: one 2-D array per head, of shape ``(vocab_h, dim)``, any
  numeric dtype (converted to float32, C order). Refused (``RuntimeError("populate
  failed")``) when any of the layer's keys already exists: remove the layer first. The
  keys are leased afterwards (the published client checks them after publishing), so a
  ``remove_from_store()`` right away answers -706 unless ``force``.
- ``lookup(row_ids)``: row ids of shape ``[B, L, H]`` (a NumPy array of any dtype that
  converts to int64, or nested sequences of ints), head ``h``'s id indexing table ``h``;
  returns float32 ``[B, L, H, D]``. Only the rows asked for are read (byte ranges of the
  objects). An id outside a table, a missing table or no store: ``RuntimeError("EngramStore
  lookup failed")``.
- ``remove_from_store(force=False)``: removes the layer's tables and returns how many there
  were; missing ones are skipped; any other failure raises ``RuntimeError("remove_from_store
  failed, rc=N")`` (-600 without a store).

Errors are the published ones: the same exception types and messages (argument-type errors
as pybind11 words them).
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["EngramStore", "EngramStoreConfig"]

logger = logging.getLogger("mooncake_core.compat.store")

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_NOT_FOUND = -704
_INVALID_PARAMS = -600
_CFG = "mooncake.store.EngramStoreConfig"
_STORE_METHODS = (
    "register_buffer",
    "unregister_buffer",
    "batch_put_from",
    "batch_is_exist",
    "get_into_ranges",
    "remove",
)


class _Store(Protocol):
    """The ``MooncakeDistributedStore`` calls an EngramStore makes."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]: ...
    def remove(self, key: str, force: bool = False) -> int: ...


def _mismatch(what: str, signature: str, args: Sequence[object]) -> TypeError:
    """pybind11's words for arguments it cannot convert."""
    kind = "constructor" if what == "__init__" else "function"
    return TypeError(
        f"{what}(): incompatible {kind} arguments. The following argument types are "
        f"supported:\n    1. {signature}\n\nInvoked with: {', '.join(map(repr, args))}"
    )


def _as_int(value: object, lo: int, hi: int) -> int | None:
    """pybind11's integer conversion (floats refused, ``__index__`` taken, range checked)."""
    if isinstance(value, float):
        return None
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__int__"):
            return None
        try:
            n = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            return None
    return n if lo <= n <= hi else None


class EngramStoreConfig:
    """``embedding_dim`` and ``table_vocab_sizes`` of one layer's tables."""

    __slots__ = ("_dim", "_vocab")

    def __init__(self, *args: object, **kwargs: object) -> None:
        if args or kwargs:
            raise _mismatch(
                "__init__", f"{_CFG}()", [*args, *(f"{k}={v!r}" for k, v in kwargs.items())]
            )
        object.__setattr__(self, "_dim", 64)
        object.__setattr__(self, "_vocab", [1024])

    def __setattr__(self, name: str, value: object) -> None:
        if name not in ("embedding_dim", "table_vocab_sizes"):
            raise AttributeError(f"'{_CFG}' object has no attribute '{name}'")
        object.__setattr__(self, name, value)

    @property
    def embedding_dim(self) -> int:
        dim: int = object.__getattribute__(self, "_dim")
        return dim

    @embedding_dim.setter
    def embedding_dim(self, value: int) -> None:
        n = _as_int(value, *_INT32)
        if n is None:
            raise _mismatch("", f"(self: {_CFG}, arg0: int) -> None", [self, value])
        object.__setattr__(self, "_dim", n)

    @property
    def table_vocab_sizes(self) -> list[int]:
        vocab: list[int] = object.__getattribute__(self, "_vocab")
        return list(vocab)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value: list[int]) -> None:
        sizes: list[int] | None = None
        if not isinstance(value, (str, bytes)) and isinstance(value, (Sequence, np.ndarray)):
            sizes = [n for n in (_as_int(v, *_INT64) for v in value) if n is not None]
            sizes = sizes if len(sizes) == len(value) else None
        if sizes is None:
            raise _mismatch("", f"(self: {_CFG}, arg0: list[int]) -> None", [self, value])
        object.__setattr__(self, "_vocab", sizes)


class _Failed(Exception):
    """A store call failed; the caller raises the published one-line error."""


class EngramStore:
    """One layer's Engram embedding tables in a ``MooncakeDistributedStore``."""

    def __init__(self, layer_id: int, config: EngramStoreConfig, store: object = None) -> None:
        layer = _as_int(layer_id, *_INT32)
        if layer is None or not isinstance(config, EngramStoreConfig):
            raise _mismatch(
                "__init__",
                f"mooncake.store.EngramStore(layer_id: int, config: {_CFG}, store: object = None)",
                [layer_id, config, store],
            )
        if store is not None and not all(callable(getattr(store, m, None)) for m in _STORE_METHODS):
            raise RuntimeError(
                "EngramStore store parameter must be a PyClient or store wrapper that "
                "implements _get_pyclient_capsule()"
            )
        dim, vocab = config.embedding_dim, config.table_vocab_sizes
        if dim <= 0:
            raise ValueError("EngramStoreConfig.embedding_dim must be positive")
        if not vocab:
            raise ValueError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if any(n <= 0 for n in vocab):
            raise ValueError(
                "EngramStoreConfig.table_vocab_sizes must contain only positive values"
            )
        self._layer = layer
        self._dim = dim
        self._vocab = vocab
        self._store: _Store | None = store  # type: ignore[assignment]
        self._keys = [f"engram:l{layer}:h{h}" for h in range(len(vocab))]

    # ------------------------------------------------------------------ shape
    def get_store_keys(self) -> list[str]:
        return list(self._keys)

    def get_embedding_dim(self) -> int:
        return self._dim

    def get_num_heads(self) -> int:
        return len(self._vocab)

    def get_table_vocab_sizes(self) -> list[int]:
        return list(self._vocab)

    # ------------------------------------------------------------------ populate
    def populate(self, embedding_buffers: list[Any]) -> None:
        """Write one ``(vocab_h, dim)`` table per head; refused when the layer exists."""
        if not isinstance(embedding_buffers, list):
            raise _mismatch(
                "populate",
                "(self: mooncake.store.EngramStore, embedding_buffers: list) -> None",
                [self, embedding_buffers],
            )
        if len(embedding_buffers) != len(self._vocab):
            raise RuntimeError("embedding_buffers size must match num_heads")
        tables = [self._table(h, buf) for h, buf in enumerate(embedding_buffers)]
        if self._store is None:
            logger.error("EngramStore populate: no store was given")
            raise RuntimeError("populate failed")
        try:
            self._publish(self._store, tables)
        except _Failed:
            raise RuntimeError("populate failed") from None

    def _table(self, head: int, buf: object) -> np.ndarray:
        if not isinstance(buf, np.ndarray):
            raise RuntimeError("embedding_buffers must be NumPy arrays")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                table = np.ascontiguousarray(buf, dtype=np.float32)
        except (TypeError, ValueError):
            raise RuntimeError("embedding_buffers must be float32 arrays") from None
        if table.ndim != 2:
            raise RuntimeError("each embedding buffer must be 2D [N_h, D]")
        if table.shape != (self._vocab[head], self._dim):
            raise RuntimeError(
                "embedding buffer shape does not match get_table_vocab_sizes()/get_embedding_dim()"
            )
        return table

    def _publish(self, store: _Store, tables: list[np.ndarray]) -> None:
        there = store.batch_is_exist(self._keys)
        for key, rc in zip(self._keys, there, strict=True):
            if rc < 0:
                logger.error("Failed to query EngramStore key '%s' before populate, rc=%d", key, rc)
                raise _Failed
            if rc == 1:
                logger.error(
                    "EngramStore populate requires empty destination key '%s'. "
                    "Remove the existing layer first.",
                    key,
                )
                raise _Failed
        ptrs = [int(t.ctypes.data) for t in tables]
        sizes = [int(t.nbytes) for t in tables]
        registered: list[int] = []
        try:
            for h, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
                rc = store.register_buffer(ptr, size)
                if rc != 0:
                    logger.error(
                        "EngramStore: registering embedding buffer %d failed, rc=%d", h, rc
                    )
                    raise _Failed
                registered.append(ptr)
            codes = store.batch_put_from(list(self._keys), ptrs, sizes)
        finally:
            for h, ptr in enumerate(registered):
                if store.unregister_buffer(ptr) != 0:
                    logger.error("Failed to unregister embedding buffer at index %d", h)
        put = [k for k, rc in zip(self._keys, codes, strict=True) if rc == 0]
        # read back as the published client does (this also leases the keys, as there)
        if len(put) != len(self._keys) or store.batch_is_exist(self._keys) != [1] * len(put):
            logger.error(
                "Failed to roll back partially populated EngramStore layer %d: put answered %s",
                self._layer,
                codes,
            )
            for key in put:
                store.remove(key, True)
            raise _Failed

    # ------------------------------------------------------------------ lookup
    def lookup(self, row_ids: object) -> np.ndarray:
        """Rows ``row_ids[b, l, h]`` of table ``h``: float32 ``[B, L, H, D]``."""
        ids = self._row_ids(row_ids)
        heads, dim = len(self._vocab), self._dim
        if ids.size == 0 or self._store is None:
            raise RuntimeError("EngramStore lookup failed")
        for h, n in enumerate(self._vocab):
            col = ids[..., h]
            if int(col.min()) < 0 or int(col.max()) >= n:
                logger.error("EngramStore lookup: a row id of head %d is outside [0, %d)", h, n)
                raise RuntimeError("EngramStore lookup failed")
        uniques, inverses = [], []
        for h in range(heads):
            u, inv = np.unique(ids[..., h], return_inverse=True)
            uniques.append(u)
            inverses.append(inv.reshape(ids.shape[:2]))
        staged = np.empty((sum(len(u) for u in uniques), dim), dtype=np.float32)
        try:
            self._read(self._store, uniques, staged)
        except _Failed:
            raise RuntimeError("EngramStore lookup failed") from None
        out = np.empty((*ids.shape, dim), dtype=np.float32)
        base = 0
        for h, (u, inv) in enumerate(zip(uniques, inverses, strict=True)):
            out[:, :, h, :] = staged[base + inv]
            base += len(u)
        return out

    def _row_ids(self, row_ids: object) -> np.ndarray:
        """``row_ids`` as int64 ``[B, L, H]``, with the published checks and errors."""
        heads = len(self._vocab)
        if isinstance(row_ids, np.ndarray):
            try:
                with warnings.catch_warnings(), np.errstate(all="ignore"):
                    warnings.simplefilter("ignore")
                    ids = np.asarray(row_ids).astype(np.int64)
            except (TypeError, ValueError, OverflowError):
                raise RuntimeError("row_ids array must be convertible to int64") from None
            if ids.ndim != 3:
                raise RuntimeError("row_ids array must have shape [B, L, H]")
            if ids.shape[2] != heads:
                raise RuntimeError("row_ids last dimension must match num_heads")
            return ids
        nested: list[list[list[int]]] = []
        for per_b in row_ids:  # type: ignore[attr-defined]  # TypeError: not iterable
            rows: list[list[int]] = []
            for per_l in per_b:
                rows.append([self._cast(x) for x in per_l])
            nested.append(rows)
        if not nested or not nested[0]:
            raise RuntimeError("row_ids must not be empty")
        length = len(nested[0])
        if any(len(b) != length or any(len(x) != heads for x in b) for b in nested):
            raise RuntimeError("EngramStore lookup failed")
        return np.array(nested, dtype=np.int64).reshape(len(nested), length, heads)

    @staticmethod
    def _cast(value: object) -> int:
        n = _as_int(value, *_INT64)
        if n is None:
            raise RuntimeError(
                f"Unable to cast Python instance of type {type(value)!r} to C++ type 'long'"
            )
        return n

    def _read(self, store: _Store, uniques: list[np.ndarray], staged: np.ndarray) -> None:
        """The rows ``uniques[h]`` of each table into ``staged``, head after head: one byte
        range per run of consecutive rows, all in one ``get_into_ranges`` call."""
        row = self._dim * 4
        dst: list[list[int]] = []
        src: list[list[int]] = []
        sizes: list[list[int]] = []
        at = 0
        for u in uniques:
            breaks = np.flatnonzero(np.diff(u) != 1) + 1
            starts = np.concatenate(([0], breaks))
            ends = np.concatenate((breaks, [len(u)]))
            dst.append([(at + int(s)) * row for s in starts])
            src.append([int(u[s]) * row for s in starts])
            sizes.append([int(e - s) * row for s, e in zip(starts, ends, strict=True)])
            at += len(u)
        ptr = int(staged.ctypes.data)
        if store.register_buffer(ptr, int(staged.nbytes)) != 0:
            logger.error("EngramStore lookup: registering the staging buffer failed")
            raise _Failed
        try:
            got = store.get_into_ranges([ptr], [list(self._keys)], [dst], [src], [sizes])
        finally:
            store.unregister_buffer(ptr)
        for key, want, codes in zip(self._keys, sizes, got[0], strict=True):
            if list(codes) != want:
                logger.error("EngramStore lookup: reading rows of '%s' answered %s", key, codes)
                raise _Failed

    # ------------------------------------------------------------------ remove
    def remove_from_store(self, force: bool = False) -> int:
        """Remove the layer's tables; the number removed (missing ones are skipped)."""
        if self._store is None:
            raise RuntimeError(f"remove_from_store failed, rc={_INVALID_PARAMS}")
        removed = 0
        for key in self._keys:
            rc = self._store.remove(key, bool(force))
            if rc == 0:
                removed += 1
            elif rc != _NOT_FOUND:
                raise RuntimeError(f"remove_from_store failed, rc={rc}")
        return removed
