"""Coordination without etcd, for the two-process case (one seeder, one reader).

The seeder opens its store with ``P2PStore("P2PHANDSHAKE")``: it starts the metadata
layer's HTTP key-value server (:class:`~mooncake_core.metadata.http.MetadataServer`) in its
own process and keeps its manifests and holder records there. The reader opens
``P2PStore(seeder.address)`` (``p2p://host:port``, or the ``http://host:port/metadata`` URL
of any HTTP metadata server) and reads them with the metadata layer's HTTP client
(:class:`~mooncake_core.metadata.http.HTTPMetadata`). The transfer engines find each other
by the P2P handshake (a segment's name is its ``host:port``): no coordination service runs
anywhere else.

The HTTP protocol has get, put and delete only, so this module adds what the store needs
on top of it:

- a *revision* stored before each value (``b"<revision> <value>"``, nanoseconds of the
  writer's clock), so guarded writes compare the manifest's revision as with etcd;
- an *index* per key directory (``<dir>/`` + ``\\x00index``: the JSON list of its
  entries, a sub-directory with a trailing ``/``), kept by the writers, for prefix reads.

Limits, by design of the case it serves: guarded writes and index updates are
read-then-write, not atomic (two writers of one name at the same moment could lose an
index entry); there are no leases (records of a reader that died stay listed until the
seeder goes; readers that fail to reach it skip it); no watches (readers poll the seeder
every ``refresh_s``); corruption reports are honoured by readers, but the holder is not
told to re-verify. For a swarm of readers use etcd.
"""

from __future__ import annotations

import json
import threading
import time

from mooncake_core.errors import ConfigError
from mooncake_core.metadata.http import HTTPMetadata, MetadataServer

__all__ = ["HTTPCoordinator", "serve_coordination", "http_url"]

_INDEX = "\x00index"


def http_url(url: str) -> str:
    """``p2p://host:port`` -> ``http://host:port/metadata``; an http(s) URL stays."""
    if url.startswith("p2p://"):
        rest = url[len("p2p://") :].rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"P2P store coordinator {url!r}: use p2p://host:port (the seeder's)")
        return f"http://{rest}/metadata"
    return url


def serve_coordination(listen: str) -> MetadataServer:
    """Start the metadata layer's HTTP key-value server on ``host:port`` (0: a free port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"P2P store listen address {listen!r}: use host:port (port 0: any)")
    return MetadataServer(host.strip("[]") or "127.0.0.1", int(port)).start()


class HTTPCoordinator:
    """The operations :class:`~mooncake_core.p2p.store.P2PStore` needs, over an HTTP
    metadata server (see the module docstring for what is weaker than with etcd)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = http_url(url)
        self.kv = HTTPMetadata(self.url, timeout=timeout)
        self._indexed: set[tuple[str, str]] = set()  # (dir, entry) this client added
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ encoding
    @staticmethod
    def _split(raw: bytes) -> tuple[bytes, int]:
        rev, _, value = raw.partition(b" ")
        return value, int(rev) if rev.isdigit() else 0

    @staticmethod
    def _revision() -> int:
        return time.time_ns()

    # ------------------------------------------------------------------ index
    @staticmethod
    def _parents(key: str) -> list[tuple[str, str]]:
        """``(directory, entry)`` pairs from the key's own directory up to the top."""
        out = []
        path = key
        while "/" in path.rstrip("/"):
            trimmed = path.rstrip("/")
            d, _, leaf = trimmed.rpartition("/")
            out.append((d + "/", leaf + ("/" if path.endswith("/") else "")))
            path = d + "/"
        return out

    def _entries(self, directory: str) -> list[str]:
        raw = self.kv.get(directory + _INDEX)
        if raw is None:
            return []
        try:
            return [str(x) for x in json.loads(raw)]
        except ValueError:
            return []

    def _index_add(self, key: str) -> None:
        for d, entry in self._parents(key):
            with self._lock:
                if (d, entry) in self._indexed:
                    return  # this client added it, and so every parent too
            entries = self._entries(d)
            if entry not in entries:
                self.kv.put(d + _INDEX, json.dumps(sorted([*entries, entry])).encode())
            with self._lock:
                self._indexed.add((d, entry))

    def _index_remove(self, key: str) -> None:
        d, entry = self._parents(key)[0]
        entries = self._entries(d)
        if entry in entries:
            entries.remove(entry)
            self.kv.put(d + _INDEX, json.dumps(entries).encode())
        with self._lock:
            self._indexed.discard((d, entry))

    def _keys_under(self, prefix: str) -> list[str]:
        d = prefix[: prefix.rfind("/") + 1]
        part = prefix[len(d) :]
        out = []
        for entry in self._entries(d):
            if not entry.startswith(part):
                continue
            if entry.endswith("/"):
                out += self._keys_under(d + entry)
            else:
                out.append(d + entry)
        return out

    # ------------------------------------------------------------------ what the store uses
    def get(self, key: str) -> bytes | None:
        got = self.get_rev(key)
        return None if got is None else got[0]

    def get_rev(self, key: str) -> tuple[bytes, int] | None:
        raw = self.kv.get(key)
        return None if raw is None else self._split(raw)

    def get_prefix_rev(self, prefix: str) -> dict[str, tuple[bytes, int]]:
        return self.get_prefix_at(prefix)[0]

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, tuple[bytes, int]], int]:
        out = {}
        for key in self._keys_under(prefix):
            got = self.get_rev(key)
            if got is not None:
                out[key] = got
        return out, self._revision()

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        rev = self._revision()
        self.kv.put(key, str(rev).encode() + b" " + value)
        self._index_add(key)
        return rev

    def put_under(self, key: str, value: bytes, lease_id: int, fallback: int | None) -> None:
        self.put(key, value)

    def put_guarded(
        self, guard: str, revision: int, key: str, value: bytes, lease: int | None = None
    ) -> bool:
        got = self.get_rev(guard)
        if got is None or got[1] != revision:
            return False
        self.put(key, value)
        return True

    def create_rev(self, key: str, value: bytes) -> int | None:
        if self.kv.get(key) is not None:
            return None
        return self.put(key, value)

    def replace_rev(self, key: str, value: bytes) -> int:
        return self.put(key, value)

    def delete(self, key: str) -> None:
        self.kv.delete(key)
        self._index_remove(key)

    def delete_guarded(self, key: str, revision: int) -> bool:
        got = self.get_rev(key)
        if got is None or got[1] != revision:
            return False
        self.delete(key)
        return True

    def delete_prefix(self, prefix: str) -> None:
        for key in self._keys_under(prefix):
            self.delete(key)

    def grant_lease(self, ttl: float) -> int:
        return 0  # no leases over HTTP: records live as long as the seeder's server

    def close(self) -> None:
        self.kv.close()
