"""A small synchronous etcd client (over ``aetcd``, run on a private event loop thread),
and :class:`LocalEtcd`, a single-member etcd server process for tests, benchmarks and
examples.

The client is used by the etcd metadata backend, the store's leader election and the P2P
store. Keys written with a lease disappear when the writer dies (the lease is kept alive
by a refresh thread); :meth:`EtcdClient.watch` calls back on every change of a key or a
prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from typing import IO, Any, TypeVar

from mooncake_core.errors import ConfigError, MetadataError, MissingDependency

__all__ = [
    "EtcdClient",
    "parse_etcd_url",
    "LocalEtcd",
    "etcd_executable",
    "find_etcd",
    "etcd_command",
    "wait_etcd_healthy",
    "free_port",
]

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

    # ------------------------------------------------------------------ watches
    def watch(
        self,
        key: str,
        on_event: Callable[[str, bytes | None, int], None],
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> Callable[[], None]:
        """Call ``on_event(key, value, mod_revision)`` for every change of ``key`` (or of
        every key under it, with ``prefix``), from ``start_revision`` on; ``value`` is None
        for a deletion. Callbacks run on the client's event-loop thread, in revision order,
        and must be quick. ``on_error`` is called once if the watch breaks (etcd lost).
        Returns a function that cancels the watch.

        Raises:
            MetadataError: the watch could not be created.
        """
        made: dict[str, Any] = {}
        cancelled = threading.Event()

        async def create() -> Any:
            if prefix:
                return await self._client.watch_prefix(key.encode(), start_revision=start_revision)
            return await self._client.watch(key.encode(), start_revision=start_revision)

        async def pump(w: Any) -> None:
            try:
                async for ev in w:
                    kv = ev.kv
                    gone = "DELETE" in str(ev.kind)
                    try:
                        on_event(
                            kv.key.decode(),
                            None if gone else bytes(kv.value),
                            int(kv.mod_revision),
                        )
                    except Exception:  # a bad callback must not end the watch
                        logger.exception("etcd watch callback for %s failed", key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not cancelled.is_set():
                    logger.warning("etcd watch on %s ended: %s", key, exc)
                    if on_error is not None:
                        on_error(exc)

        w = self._run(create())
        made["task"] = asyncio.run_coroutine_threadsafe(pump(w), self._loop)

        def cancel() -> None:
            if cancelled.is_set():
                return
            cancelled.set()
            with contextlib.suppress(MetadataError):
                self._run(w.cancel(), timeout=2.0)
            made["task"].cancel()

        return cancel

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


# ---------------------------------------------------------------------- a local server
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the moment of the call."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_etcd() -> str | None:
    """Path of the ``etcd`` server binary (Debian's etcd-server), or None."""
    exe = shutil.which("etcd") or "/usr/bin/etcd"
    return exe if os.path.exists(exe) else None


def etcd_executable() -> str:
    """Path of the ``etcd`` server binary.

    Raises:
        ConfigError: it is not installed.
    """
    exe = find_etcd()
    if exe is None:
        raise ConfigError(
            "etcd is not installed (scripts/setup.sh installs Debian's etcd-server as root)"
        )
    return exe


def etcd_command(exe: str, data_dir: str, client: str, peer: str, name: str = "mc") -> list[str]:
    """Command line of a single-member etcd serving clients at ``client`` (``host:port``)
    and its (unused) peer port at ``peer``."""
    return [
        exe,
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        f"http://{client}",
        "--advertise-client-urls",
        f"http://{client}",
        "--listen-peer-urls",
        f"http://{peer}",
        "--initial-advertise-peer-urls",
        f"http://{peer}",
        "--initial-cluster",
        f"{name}=http://{peer}",
    ]


_HEALTH = (
    "import sys,urllib.request,json;"
    "sys.exit(0 if json.loads(urllib.request.urlopen(sys.argv[1],timeout=1).read())"
    ".get('health')=='true' else 1)"
)


def _healthy(http: str, exec_prefix: Sequence[str]) -> bool:
    if exec_prefix:  # e.g. inside a network namespace the caller cannot reach
        r = subprocess.run(
            [*exec_prefix, sys.executable, "-c", _HEALTH, f"{http}/health"],
            capture_output=True,
        )
        return r.returncode == 0
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=1) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def wait_etcd_healthy(
    http: str,
    proc: subprocess.Popen[Any],
    timeout: float = 20.0,
    *,
    exec_prefix: Sequence[str] = (),
    log_hint: str = "",
) -> None:
    """Wait until etcd at ``http://host:port`` reports healthy.

    Raises:
        MetadataError: it exited, or was not healthy within ``timeout`` seconds.
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _healthy(http, exec_prefix):
            return
        if proc.poll() is not None:
            raise MetadataError(
                f"etcd exited with {proc.returncode}" + (f"; see {log_hint}" if log_hint else "")
            )
        time.sleep(0.1)
    raise MetadataError(f"etcd at {http} did not become healthy within {timeout:.0f} s")


class LocalEtcd:
    """A single-member etcd server process (Debian's etcd-server) for tests, benchmarks
    and examples; its data and log live in ``data_dir`` (default a new temporary directory
    on /dev/shm, removed by :meth:`close`).

    Args:
        host: address it listens on for clients (default loopback).
        client_port / peer_port: 0 picks free ports on this host's network namespace.
        exec_prefix: command prefix to start it (and check its health) with, e.g.
            ``["ip", "netns", "exec", NS]``; give explicit ports then.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "mc",
        exec_prefix: Sequence[str] = (),
        timeout: float = 20.0,
        start: bool = True,
    ) -> None:
        self.exe = etcd_executable()
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port("127.0.0.1")
        self.name = name
        self.exec_prefix = list(exec_prefix)
        self.timeout = timeout
        self._own_dir = data_dir is None
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data = data_dir or tempfile.mkdtemp(prefix="mc-etcd-", dir=base)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``etcd://host:port`` (what :class:`EtcdClient` and ``--etcd`` options take)."""
        return f"etcd://{self.host}:{self.client_port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self) -> None:
        """Start it (again, on the same ports and data) and wait until it is healthy."""
        os.makedirs(self.data, exist_ok=True)
        log_path = os.path.join(self.data, "etcd.log")
        self.log = open(log_path, "ab")  # noqa: SIM115 - owned by the process
        cmd = etcd_command(
            self.exe,
            os.path.join(self.data, "d"),
            f"{self.host}:{self.client_port}",
            f"127.0.0.1:{self.peer_port}",
            self.name,
        )
        self.proc = subprocess.Popen([*self.exec_prefix, *cmd], stdout=self.log, stderr=self.log)
        try:
            wait_etcd_healthy(
                self.http,
                self.proc,
                self.timeout,
                exec_prefix=self.exec_prefix,
                log_hint=log_path,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the process (the data stays: :meth:`start` brings it back)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None

    def close(self) -> None:
        """Stop it and remove its data directory (when this object made it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
