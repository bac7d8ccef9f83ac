"""A small synchronous etcd client (over ``aetcd``, run on a private event loop thread).

Used by the etcd metadata backend and by the store's leader election. Keys written with
a lease disappear when the writer dies (the lease is kept alive by a refresh thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Coroutine
from typing import Any, TypeVar

from mooncake_core.errors import ConfigError, MetadataError, MissingDependency

__all__ = ["EtcdClient", "parse_etcd_url"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://h1:p1,h2:p2`` (or bare ``h:p``; the port defaults to 2379) -> endpoints.

    Raises:
        ConfigError: one line naming the malformed item (another scheme, an empty item, a
            port that is not a number in 1..65535, a path, no host).
    """
    text = url.strip()
    rest = text[len("etcd://") :] if text.startswith("etcd://") else text
    hint = "use etcd://host:port[,host:port...]"
    if "://" in rest:
        scheme = rest.split("://", 1)[0]
        raise ConfigError(
            f"etcd address {url!r}: scheme {scheme + '://'!r} is not etcd:// ({hint})"
        )
    out = []
    for item in rest.rstrip("/").split(","):
        item = item.strip()
        bad = f"etcd address {url!r}: endpoint {item!r}"
        if not item:
            raise ConfigError(f"etcd address {url!r}: an empty endpoint in the list ({hint})")
        u = urllib.parse.urlsplit("//" + item)
        if u.path or u.query or u.fragment or u.username is not None:
            raise ConfigError(f"{bad} is not host:port ({hint})")
        try:
            port = u.port
        except ValueError:
            port_text = item.rsplit(":", 1)[-1]
            raise ConfigError(
                f"{bad}: port {port_text!r} is not a number in 1..65535 ({hint})"
            ) from None
        if not u.hostname:
            raise ConfigError(f"{bad} has no host ({hint})")
        if port == 0:
            raise ConfigError(f"{bad}: port 0 is not a number in 1..65535 ({hint})")
        out.append((u.hostname, port or 2379))
    return out


def _endpoints_text(endpoints: list[tuple[str, int]]) -> str:
    return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in endpoints)


class EtcdClient:
    """Synchronous facade over ``aetcd`` with lease keep-alive.

    Args:
        url: ``etcd://host:port[,host:port]``; the first reachable endpoint is used.
        timeout: per-call timeout in seconds.
    """

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        try:
            import aetcd
        except ImportError as exc:
            raise MissingDependency("aetcd", f"etcd ({url})") from exc
        self._aetcd = aetcd
        self.endpoints = parse_etcd_url(url)
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mc-etcd", daemon=True)
        self._thread.start()
        self._client: Any = None
        self._leases: dict[int, Any] = {}
        self._stop = threading.Event()
        self._connect()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout or self.timeout)
        except TimeoutError as exc:
            fut.cancel()
            raise MetadataError(
                f"etcd at {self.endpoints} did not answer within {timeout or self.timeout:.1f}s"
            ) from exc
        except MetadataError:
            raise
        except Exception as exc:
            raise MetadataError(f"etcd at {self.endpoints}: {type(exc).__name__}: {exc}") from exc

    def _connect(self) -> None:
        """Try every endpoint, round after round, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        last: BaseException | None = None
        while True:
            for host, port in self.endpoints:

                async def mk(h: str = host, p: int = port) -> Any:
                    c = self._aetcd.Client(host=h, port=p, timeout=int(max(1, self.timeout)))
                    try:
                        await c.connect()
                        await c.get(b"mooncake/__probe__")
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await c.close()
                        raise
                    return c

                try:
                    left = max(0.5, deadline - time.monotonic())
                    self._client = self._run(mk(), timeout=left)
                    return
                except MetadataError as exc:
                    last = exc.__cause__ or exc
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        why = f"{type(last).__name__}: {last}" if last is not None else "no endpoint"
        if isinstance(last, TimeoutError):
            why = "no answer"
        raise MetadataError(
            f"cannot reach etcd at {_endpoints_text(self.endpoints)} within "
            f"{self.timeout:.0f}s ({why}); is etcd running there?"
        )

    # ------------------------------------------------------------------ kv
    def get(self, key: str) -> bytes | None:
        async def f() -> bytes | None:
            r = await self._client.get(key.encode())
            return None if r is None else bytes(r.value)

        return self._run(f())

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        async def f() -> dict[str, bytes]:
            r = await self._client.get_prefix(prefix.encode())
            return {kv.key.decode(): bytes(kv.value) for kv in r}

        return self._run(f())

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        async def f() -> None:
            await self._client.put(
                key.encode(), value, lease=self._leases.get(lease) if lease else None
            )

        self._run(f())

    def delete(self, key: str) -> None:
        self._run(self._client.delete(key.encode()))

    def delete_prefix(self, prefix: str) -> None:
        self._run(self._client.delete_prefix(prefix.encode()))

    def create_if_absent(self, key: str, value: bytes, lease: int | None = None) -> bool:
        """Atomically create ``key`` when it does not exist; True if we created it."""

        async def f() -> bool:
            c = self._client
            cmp = [c.transactions.create(key.encode()) == 0]
            put = [
                c.transactions.put(
                    key.encode(), value, lease=self._leases.get(lease) if lease else None
                )
            ]
            ok, _ = await c.transaction(compare=cmp, success=put, failure=[])
            return bool(ok)

        return self._run(f())

    # ------------------------------------------------------------------ leases
    def grant_lease(self, ttl: float) -> int:
        """Grant a lease of ``ttl`` seconds, kept alive until :meth:`revoke_lease` or close."""

        async def f() -> Any:
            return await self._client.lease(max(1, int(round(ttl))))

        lease = self._run(f())
        self._leases[lease.id] = lease
        interval = max(0.2, ttl / 3)

        def keepalive() -> None:
            while not self._stop.wait(interval):
                if lease.id not in self._leases:
                    return
                try:
                    self._run(lease.refresh())
                except MetadataError as exc:
                    logger.warning("etcd lease %x keep-alive failed: %s", lease.id, exc)

        threading.Thread(target=keepalive, name="mc-etcd-lease", daemon=True).start()
        return int(lease.id)

    def revoke_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            try:
                self._run(lease.revoke())
            except MetadataError:
                pass

    def close(self) -> None:
        self._stop.set()
        for lid in list(self._leases):
            self.revoke_lease(lid)
        if self._client is not None:
            try:
                self._run(self._client.close())
            except MetadataError:
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
