"""Shared fixtures: free loopback ports, a real etcd server, peer processes."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.etcd import LocalEtcd, find_etcd
from mooncake_core.jsonpipe import JsonLinesProcess

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = Path(__file__).resolve().parent / "integration" / "peer_proc.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer(LocalEtcd):
    """A real etcd (Debian's etcd-server) on free loopback ports, data dir on /dev/shm."""

    def __init__(self) -> None:
        if find_etcd() is None:
            pytest.skip(
                "etcd is not installed (scripts/setup.sh installs Debian's etcd-server as root)"
            )
        super().__init__(name="t")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    srv = EtcdServer()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture()
def etcd_url(etcd_server: EtcdServer) -> str:
    """``etcd://127.0.0.1:PORT`` of the session's real etcd server."""
    return etcd_server.url


class Peer(JsonLinesProcess):
    """A transfer-engine peer in its own process, driven by JSON lines over stdin/stdout."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        super().__init__(
            [*(prefix or []), sys.executable, str(PEER_SCRIPT), *(args or [])],
            env=e,
            label="peer process",
        )
        self.name: str = self.hello["name"]
        self.pid: int = self.hello["pid"]


@pytest.fixture()
def spawn_peer() -> Iterator[Any]:
    peers: list[Peer] = []

    def make(**kw: Any) -> Peer:
        p = Peer(**kw)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()
