"""``mooncake.async_store`` drop-in: ``MooncakeDistributedStoreAsync``.

Every method ``m`` of :class:`~mooncake_core.compat.store.MooncakeDistributedStore` is
also reachable as the coroutine function ``async_m`` (``await store.async_put(k, v)``),
which runs ``m`` in the event loop's default executor, as the published class does. Names
that are not ``async_`` + an existing method raise ``AttributeError``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from mooncake_core.compat.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStore", "MooncakeDistributedStoreAsync"]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """:class:`MooncakeDistributedStore` plus ``async_<method>`` coroutine functions."""

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        # only called for names not found normally
        kind = type(self).__name__
        if not name.startswith("async_"):
            raise AttributeError(f"'{kind}' object has no attribute '{name}'")
        sync_name = name[len("async_") :]
        method = getattr(self, sync_name, None)
        if method is None:
            raise AttributeError(f"'{kind}' object has no attribute '{name}' (nor '{sync_name}')")
        if not callable(method):
            raise AttributeError(f"'{sync_name}' is not callable")

        @functools.wraps(method)
        async def run(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))

        setattr(self, name, run)
        return run
