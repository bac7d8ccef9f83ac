"""A real store for the suite: a ``mooncake-core master`` and a memory node, each a process.

:class:`StoreCluster` starts both on free loopback ports (``--ready-file`` tells when
they listen), can kill and restart either (same port, so clients reconnect), and hands
out raw :class:`~mooncake_core.store.StoreClient` objects for checks that look at
store objects directly. Adapters under test contribute no memory of their own by
default, so what they save outlives their process, as in a deployment with store nodes.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from mooncake_core.config import environment

__all__ = ["StoreCluster", "free_port"]

logger = logging.getLogger(__name__)


#: The children get SIGTERM when the test process dies, however it dies (a ``timeout`` or CI
#: runner killing pytest never runs ``close()``; in their own session they were left running).
_SETPRIV = shutil.which("setpriv")
_DIE_WITH_US = [_SETPRIV, "--pdeathsig", "TERM"] if _SETPRIV else []


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StoreCluster:
    """A master process plus one memory node process on loopback.

    Args:
        segment_size: memory the node lends to the pool (``"256MB"``).
        lease_ttl_s: the master's read lease (short leases let ``clear`` and removals act fast).
        env: extra environment for both processes.
    """

    def __init__(
        self,
        segment_size: str = "256MB",
        lease_ttl_s: float = 5.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.segment_size = segment_size
        self.lease_ttl_s = lease_ttl_s
        self.dir = Path(tempfile.mkdtemp(prefix="mc-conformance-"))
        self.rpc_port = free_port()
        self.env = dict(environment())
        self.env.update(env or {})
        self.env.setdefault("MOONCAKE_LOG_LEVEL", "WARNING")
        self.master: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self._clients: list[Any] = []
        self._logs: list[Any] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> StoreCluster:
        try:
            self.start_master()
            self.start_node()
        except BaseException:  # ``with`` never calls __exit__ when __enter__ fails
            self.close()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        ready = self.dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        cmd = [sys.executable, "-m", "mooncake_core", *args, "--ready-file", str(ready)]
        proc = subprocess.Popen(
            [*_DIE_WITH_US, *cmd],
            stdout=log,
            stderr=log,
            env=self.env,
            start_new_session=True,
        )
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if ready.exists():
                return proc
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{name} did not become ready within 60 s: {self.log_tail(name)}")

    def start_master(self) -> None:
        """Start (or restart, on the same port) the master."""
        if self.master is not None and self.master.poll() is None:
            return
        end = time.monotonic() + 15
        while True:  # after a kill the port may take a moment to be free again
            try:
                self.master = self._spawn(
                    "master",
                    [
                        "master",
                        "--rpc-address",
                        "127.0.0.1",
                        "--rpc-port",
                        str(self.rpc_port),
                        "--http-port",
                        "-1",
                        "--default-kv-lease-ttl",
                        str(self.lease_ttl_s),
                    ],
                )
                return
            except RuntimeError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.3)

    def start_node(self) -> None:
        """Start (or restart) the memory node."""
        if self.node is not None and self.node.poll() is None:
            return
        self.node = self._spawn(
            "node", ["store", "--master", self.master_address, "--segment-size", self.segment_size]
        )

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None, kill: bool) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_master(self, kill: bool = True) -> None:
        """Stop the master (``kill``: SIGKILL, as a crash)."""
        self._stop(self.master, kill)

    def stop_node(self, kill: bool = True) -> None:
        """Stop the memory node; the objects it held are gone."""
        self._stop(self.node, kill)

    def log_tail(self, name: str, n: int = 2000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    # ------------------------------------------------------------------ raw access
    def client(self) -> Any:
        """A started raw ``StoreClient`` (no memory of its own), closed with the cluster."""
        from mooncake_core.store import StoreClient

        c = StoreClient(master=self.master_address, segment_size=0, failover_timeout_s=5.0).start()
        self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception as exc:  # closing must not hide the test's own failure
                logger.debug("closing a raw client: %s", exc)
        self._clients.clear()
        self.stop_node(kill=False)
        self.stop_master(kill=False)
        for f in self._logs:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StoreCluster:
        return self.start()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def describe(self) -> str:
        return json.dumps({"master": self.master_address, "dir": str(self.dir)})
