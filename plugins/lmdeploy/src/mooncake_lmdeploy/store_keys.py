"""LMDeploy's store keys with the TP size in them.

LMDeploy 0.18.0 names a block's object ``[cache_prefix@]model@tp_rank:R@group:0@HASH``
(``lmdeploy.pytorch.kv_connector.mooncake.store.data.build_store_key``; ``R`` is the
KV-head shard). The TP size is not in it, so rank 0 of a TP-2 engine and a TP-1 engine of
the same model compute the same key for different bytes (half the KV heads against all
of them): the second one to save finds the key present and skips its put, and the other
instance then loads blocks of the wrong shape.

:func:`patch` (run by :mod:`mooncake_lmdeploy.autoload` after LMDeploy's store modules
load) replaces ``build_store_key`` in those modules with :func:`tp_size_key`, which
calls LMDeploy's own function with the model name extended by ``@tp_size:N``:
``[cache_prefix@]model@tp_size:N@tp_rank:R@group:0@HASH``. Everything else is
LMDeploy's: the saving rank writes its shard's key, and ``MooncakeStoreWorker.lookup``
still asks for every KV-head shard of a block (a hit needs all ranks' shards).
``MOONCAKE_LMDEPLOY_AUTOLOAD=0`` leaves LMDeploy's keys as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["MODULES", "patch", "tp_size_key", "upstream_build_store_key"]

#: LMDeploy modules that hold ``build_store_key`` (defined in the first, imported by name
#: into the others)
MODULES = (
    "lmdeploy.pytorch.kv_connector.mooncake.store.data",
    "lmdeploy.pytorch.kv_connector.mooncake.store.worker",
    "lmdeploy.pytorch.kv_connector.mooncake.store.worker_threads",
)
_MARK = "_mooncake_tp_size_keys"


def upstream_build_store_key() -> Callable[..., str]:
    """LMDeploy's own ``build_store_key`` (also after :func:`patch`)."""
    from lmdeploy.pytorch.kv_connector.mooncake.store import data

    fn: Callable[..., str] = data.build_store_key
    return getattr(fn, "__wrapped__", fn) if getattr(fn, _MARK, False) else fn


@functools.lru_cache(maxsize=64)
def _scoped(metadata: Any) -> Any:
    """``metadata`` (a frozen ``MooncakeStoreKeyMetadata``) with the TP size in its model
    name; cached: the same metadata object names every key of a worker."""
    return dataclasses.replace(
        metadata, model_name=f"{metadata.model_name}@tp_size:{int(metadata.tp_size)}"
    )


def tp_size_key(
    metadata: Any, kv_head_rank: int, block_hash: bytes | bytearray | memoryview
) -> str:
    """LMDeploy's key of one KV-head shard of a block, with ``@tp_size:N`` after the model."""
    return upstream_build_store_key()(_scoped(metadata), kv_head_rank, block_hash)


setattr(tp_size_key, _MARK, True)


def patch(module: ModuleType) -> bool:
    """Point ``module.build_store_key`` at :func:`tp_size_key` (idempotent). Returns
    whether the module has the function."""
    fn = getattr(module, "build_store_key", None)
    if fn is None:
        return False
    if not getattr(fn, _MARK, False):
        tp_size_key.__wrapped__ = fn  # type: ignore[attr-defined]
        module.build_store_key = tp_size_key  # type: ignore[attr-defined]
    return True
