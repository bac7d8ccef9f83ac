"""How many leading KV pages of a prompt the store holds (``mooncake-core proxy --store-master``).

An engine's store connector saves each full prompt page under keys of its own scheme,
which the engine's adapter describes (:meth:`~mooncake_core.proxy.engine.ProxyEngine.store_keys`,
a :class:`~mooncake_core.proxy.engine.StoreKeys`). For a token-id prompt,
:class:`StoreLookup` computes the keys of its pages and asks the master with one
``batch_exists`` RPC; the answer is the length of the leading run of pages present, which
is what an instance's store connector would load. The proxy's conductor then counts those
blocks as fetchable from the store.

The key scheme needs the model path exactly as the engine has it (by default the one the
first reachable prefill instance reports in ``GET /v1/models``), the dtype the engine
runs with, the block size and the TP size.

Failures never fail a request: an unreachable master, a timeout or an error answer counts
as "the store holds nothing", logs one warning, and lookups pause for ``retry_after_s``
(one info line when the master answers again).

*Thread-safety*: :meth:`StoreLookup.held_pages` may run on several executor threads at
once (the RPC client pools its connections); counters are updated under a lock.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from mooncake_core.errors import ConfigError
from mooncake_core.proxy.engine import ProxyEngine, StoreKeys, proxy_engine

__all__ = ["StoreLookup", "parse_master_address", "model_root"]

logger = logging.getLogger(__name__)

_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def parse_master_address(addr: str, what: str = "--store-master") -> str:
    """Check ``HOST:PORT`` (or ``etcd://HOST:PORT[,HOST:PORT...]``); raise a one-line
    :class:`ConfigError`."""
    text = (addr or "").strip()
    parts = text[len("etcd://") :].split(",") if text.startswith("etcd://") else [text]
    for part in parts:
        m = _HOSTPORT.match(part)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(
                f"{what}: {addr!r} is not a store master address; use HOST:PORT "
                "(e.g. 127.0.0.1:50051) or etcd://HOST:PORT"
            )
    return text


async def model_root(
    urls: Sequence[str], engine: ProxyEngine | None = None, timeout_s: float = 5.0
) -> str | None:
    """The model path the first answering instance serves (from its ``GET /v1/models``).

    ``engine`` reads the answer (:meth:`~mooncake_core.proxy.engine.ProxyEngine.model_path`;
    default: the default engine's).
    """
    import aiohttp

    engine = engine or proxy_engine()

    for url in urls:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
                s.get(url.rstrip("/") + "/v1/models") as r,
            ):
                if r.status != 200:
                    continue
                data = await r.json(content_type=None)
            root = engine.model_path(data)
            if root:
                return str(root)
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ValueError,
            AttributeError,
            IndexError,
        ) as exc:
            logger.debug("no model list from %s: %s", url, exc)
    return None


class StoreLookup:
    """Asks the store master which leading pages of a prompt are saved.

    Args:
        master: master address (``HOST:PORT`` or ``etcd://...``); a malformed one raises
            :class:`ConfigError`.
        block_tokens: tokens per page (the engine's KV block size).
        dtype: the dtype the engine instances run with (``float32``, ``bfloat16``, ...).
        tp_size: their tensor-parallel size.
        model: the model path as the engine has it; ``None``: set later with :meth:`set_model`.
        timeout_s: longest a lookup may take (RPC timeout and failover window).
        retry_after_s: pause after a failed lookup.
        engine: names the keys (default: the default engine, asked when the model is set).
    """

    def __init__(
        self,
        master: str,
        block_tokens: int,
        dtype: str,
        tp_size: int = 1,
        model: str | None = None,
        timeout_s: float = 0.5,
        retry_after_s: float = 10.0,
        engine: ProxyEngine | None = None,
    ) -> None:
        self.master = parse_master_address(master)
        if block_tokens <= 0 or tp_size <= 0:
            raise ConfigError(
                "store lookup needs a positive block size and TP size, "
                f"got {block_tokens}, {tp_size}"
            )
        if not dtype:
            raise ConfigError(
                "--store-master needs --store-dtype: the dtype the engine instances run with "
                "(e.g. float32 or bfloat16)"
            )
        self.block_tokens = block_tokens
        self.dtype = dtype
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.engine = engine
        self.scheme: StoreKeys | None = None
        self._rpc: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.counters: dict[str, int] = {
            "lookups": 0,
            "failures": 0,
            "skipped": 0,
            "pages_asked": 0,
            "pages_held": 0,
        }
        if model:
            self.set_model(model)

    def set_model(self, model: str) -> None:
        """Fix the model path (builds the key scheme; :class:`ConfigError` when no adapter serves
        the engine)."""
        if self.engine is None:
            self.engine = proxy_engine()
        try:
            self.scheme = self.engine.store_keys(model, self.dtype, self.block_tokens, self.tp_size)
        except ValueError as exc:
            raise ConfigError(f"--store-master: {exc}") from None
        logger.info(
            "store lookups on master %s: keys %s..., seed %r",
            self.master,
            self.scheme.rank_prefix(0),
            self.scheme.seed,
        )

    @property
    def available(self) -> bool:
        """False while lookups pause after a failure."""
        return time.monotonic() >= self._down_until

    def _client(self) -> Any:
        if self._rpc is None:
            from mooncake_core.store.rpc import MasterRPC

            self._rpc = MasterRPC(
                self.master, timeout_s=self.timeout_s, failover_timeout_s=self.timeout_s
            )
        return self._rpc

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counters["failures"] += 1
            self._down_until = time.monotonic() + self.retry_after_s
            first = not self._down
            self._down = True
        if first:
            logger.warning(
                "store master %s did not answer (%s); routing without store holdings, "
                "next try in %.0f s",
                self.master,
                exc,
                self.retry_after_s,
            )

    def _answered(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            logger.info("store master %s answers again; store holdings count again", self.master)

    def held_pages(self, tokens: Sequence[int]) -> int:
        """Leading pages of ``tokens`` the store holds (0 without a scheme or while the master is
        down).

        Blocking (one RPC); call from a thread, e.g. through :meth:`aheld_pages`.
        """
        scheme = self.scheme
        if scheme is None:
            return 0
        if not self.available:
            self._count(skipped=1)
            return 0
        pages = scheme.lookup_pages(tokens)
        if not pages:
            return 0
        try:
            exists = self._client().call(
                "batch_exists", (scheme.exists_keys(pages),), timeout=self.timeout_s
            )
            n = int(scheme.held_pages(list(exists)))
        except Exception as exc:  # any failure means "no store holdings", never a failed request
            self._failed(exc)
            return 0
        self._answered()
        self._count(lookups=1, pages_asked=len(pages), pages_held=n)
        return n

    async def aheld_pages(self, tokens: Sequence[int]) -> int:
        """:meth:`held_pages` on the default executor, bounded by ``timeout_s`` (plus a margin)."""
        if self.scheme is None or not self.available:
            return self.held_pages(tokens)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(None, self.held_pages, list(tokens)), self.timeout_s * 2 + 0.5
            )
        except asyncio.TimeoutError as exc:
            self._failed(exc)
            return 0

    def probe(self) -> bool:
        """One empty ``batch_exists``: True when the master answers (logs the warning otherwise)."""
        try:
            self._client().call("batch_exists", ([],), timeout=self.timeout_s)
        except Exception as exc:
            self._failed(exc)
            return False
        self._answered()
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out.update(
            master=self.master,
            down=self._down,
            scheme=None if self.scheme is None else self.scheme.seed,
        )
        return out

    def close(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None
