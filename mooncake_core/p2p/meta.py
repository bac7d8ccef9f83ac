"""What the P2P store keeps in etcd, and the etcd operations it needs.

Keys (``P`` is ``<metadata.prefix>/p2p``; names are percent-quoted so ``/`` in a name
cannot be confused with the key structure)::

    P/objects/<name>                        manifest (JSON, no lease: lives until unregister)
    P/holders/<name>/<version>/<segment>    one holder's record (JSON, under the holder's lease)
    P/reports/<name>/<version>/<segment>/<shard>
                                            a reader's report that this holder's copy of the
                                            shard failed its checksum (under the holder's
                                            lease); the holder re-verifies and deletes it

A *manifest* names the version (a random id), the buffers (sizes and optional labels such
as file names) and every shard: the buffer it lies in, its offset, length and xxhash
(xxh3-64) checksum. A *holder record* names the holder's transfer-engine segment, the
base address of each buffer in its memory, whether it is the original copy, and a bitmap
of the shards it has. A holder only ever writes its own record, and only while the
manifest is still the version it holds (a transaction comparing the manifest's revision),
so a holder of an old version can never be listed under a new one.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncake_core.config import parse_size
from mooncake_core.errors import ConfigError, MetadataError
from mooncake_core.etcd import EtcdClient
from mooncake_core.p2p.errors import BadName

__all__ = [
    "Manifest",
    "Shard",
    "Holder",
    "P2PEtcd",
    "Coordinator",
    "Keys",
    "check_name",
    "check_shard_size",
    "MIN_SHARD",
    "MAX_SHARD",
]

MIN_SHARD = 4 << 10
MAX_SHARD = 4 << 30
MAX_NAME = 255
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@+=]*$")


def check_name(name: object) -> str:
    """The name itself, or :class:`BadName` saying what is wrong with it."""
    if not isinstance(name, str):
        raise BadName(f"name must be a string, got {type(name).__name__}")
    if not name:
        raise BadName("name must not be empty")
    if len(name) > MAX_NAME:
        raise BadName(f"name {name[:40]!r}... is {len(name)} characters long (at most {MAX_NAME})")
    if not _NAME_RE.match(name) or "//" in name or name.endswith("/"):
        raise BadName(
            f"name {name!r}: use letters, digits and . _ - / : @ + = (starting with a letter "
            "or digit, no empty path part)"
        )
    return name


def check_shard_size(value: object) -> int:
    """``max_shard_size`` in bytes (``"64MB"``, ``1 << 20``), or :class:`BadName`."""
    try:
        n = parse_size(value, "max_shard_size")
    except ConfigError as exc:
        raise BadName(str(exc)) from None
    if not MIN_SHARD <= n <= MAX_SHARD:
        raise BadName(f"max_shard_size {value!r} ({n} bytes) must be between 4 KiB and 4 GiB")
    return n


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix."""

    base: str  # e.g. "mooncake/p2p"

    def obj(self, name: str) -> str:
        return f"{self.base}/objects/{_q(name)}"

    def objects(self, prefix: str = "") -> str:
        return f"{self.base}/objects/{_q(prefix)}"

    def name_of(self, key: str) -> str:
        return urllib.parse.unquote(key[len(self.base) + len("/objects/") :])

    def holders(self, name: str, version: str = "") -> str:
        if not version:
            return f"{self.base}/holders/{_q(name)}/"
        return f"{self.base}/holders/{_q(name)}/{version}/"

    def holder(self, name: str, version: str, segment: str) -> str:
        return f"{self.holders(name, version)}{_q(segment)}"

    def reports(self, name: str, version: str, segment: str = "") -> str:
        base = f"{self.base}/reports/{_q(name)}/{version}/"
        return f"{base}{_q(segment)}/" if segment else base

    def report(self, name: str, version: str, segment: str, shard: int) -> str:
        return f"{self.reports(name, version, segment)}{shard}"

    @staticmethod
    def last_parts(key: str, n: int) -> list[str]:
        """The last ``n`` parts of ``key``, unquoted (e.g. a report's segment and shard)."""
        return [urllib.parse.unquote(x) for x in key.rsplit("/", n)[-n:]]


@dataclass(frozen=True)
class Shard:
    """One shard: ``length`` bytes at ``offset`` of buffer ``buf``, with its checksum."""

    index: int
    buf: int
    offset: int
    length: int
    xxh: str  # xxh3-64, hex


@dataclass
class Manifest:
    """A registered name at one version."""

    name: str
    version: str
    shard_size: int
    sizes: list[int]
    labels: list[str]
    shards: list[Shard]
    origin: str  # segment of the original holder
    created: float = 0.0
    meta: dict[str, str] = field(default_factory=dict)  # the registrant's own (e.g. layout)
    revision: int = 0  # etcd mod revision of the manifest key (not stored)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "version": self.version,
                "shard_size": self.shard_size,
                "sizes": self.sizes,
                "labels": self.labels,
                "shards": [[s.buf, s.offset, s.length, s.xxh] for s in self.shards],
                "origin": self.origin,
                "created": self.created,
                "meta": self.meta,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> Manifest:
        d = json.loads(raw)
        shards = [
            Shard(i, int(b), int(o), int(n), str(x)) for i, (b, o, n, x) in enumerate(d["shards"])
        ]
        return cls(
            name=str(d["name"]),
            version=str(d["version"]),
            shard_size=int(d["shard_size"]),
            sizes=[int(s) for s in d["sizes"]],
            labels=[str(x) for x in d.get("labels", [])],
            shards=shards,
            origin=str(d.get("origin", "")),
            created=float(d.get("created", 0.0)),
            meta={str(k): str(v) for k, v in dict(d.get("meta", {})).items()},
            revision=revision,
        )


@dataclass
class Holder:
    """One holder of a version: its segment, buffer addresses and the shards it has."""

    segment: str
    addrs: list[int]
    origin: bool
    mask: int = 0  # bit i: has shard i
    pending: int = 0  # bit i: fetching shard i from the original copy (a claim)
    pid: int = 0
    host: str = ""
    lease: int = 0  # the holder's etcd lease (reports about it are put under it)
    extra: dict[str, Any] = field(default_factory=dict)

    def has(self, shard: int) -> bool:
        return bool(self.mask >> shard & 1)

    def count(self) -> int:
        return bin(self.mask).count("1")

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "segment": self.segment,
                "addrs": self.addrs,
                "origin": self.origin,
                "mask": format(self.mask, "x"),
                "pend": format(self.pending, "x"),
                "pid": self.pid,
                "host": self.host,
                "lease": self.lease,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Holder:
        d = json.loads(raw)
        return cls(
            segment=str(d["segment"]),
            addrs=[int(a) for a in d["addrs"]],
            origin=bool(d.get("origin", False)),
            mask=int(str(d.get("mask", "0")) or "0", 16),
            pending=int(str(d.get("pend", "0")) or "0", 16),
            pid=int(d.get("pid", 0)),
            host=str(d.get("host", "")),
            lease=int(d.get("lease", 0)),
        )


class Coordinator(Protocol):
    """What the store needs from its coordination service: :class:`P2PEtcd` (a swarm), or
    :class:`~mooncake_core.p2p.direct.HTTPCoordinator` (two processes, no etcd). A
    coordinator that also has ``watch`` (etcd) is followed by watches instead of polls."""

    def get(self, key: str) -> bytes | None: ...

    def get_rev(self, key: str) -> tuple[bytes, int] | None: ...

    def get_prefix_rev(self, prefix: str) -> dict[str, tuple[bytes, int]]: ...

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, tuple[bytes, int]], int]: ...

    def put_under(self, key: str, value: bytes, lease_id: int, fallback: int | None) -> None: ...

    def put_guarded(
        self, guard: str, revision: int, key: str, value: bytes, lease: int | None = None
    ) -> bool: ...

    def create_rev(self, key: str, value: bytes) -> int | None: ...

    def replace_rev(self, key: str, value: bytes) -> int: ...

    def delete(self, key: str) -> None: ...

    def delete_guarded(self, key: str, revision: int) -> bool: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def grant_lease(self, ttl: float) -> int: ...

    def close(self) -> None: ...


class P2PEtcd(EtcdClient):
    """:class:`~mooncake_core.etcd.EtcdClient` plus the revision-guarded operations the P2P
    store needs (reads with revisions, writes guarded by another key's revision)."""

    def get_rev(self, key: str) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key``, or None."""

        async def f() -> tuple[bytes, int] | None:
            r = await self._client.get(key.encode())
            return None if r is None else (bytes(r.value), int(r.mod_revision))

        return self._run(f())

    def get_prefix_rev(self, prefix: str) -> dict[str, tuple[bytes, int]]:
        return self.get_prefix_at(prefix)[0]

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, tuple[bytes, int]], int]:
        """``{key: (value, mod_revision)}`` under ``prefix``, and the store's revision at
        the read (watch from the next one to miss nothing)."""

        async def f() -> tuple[dict[str, tuple[bytes, int]], int]:
            r = await self._client.get_prefix(prefix.encode())
            kvs = {kv.key.decode(): (bytes(kv.value), int(kv.mod_revision)) for kv in r}
            return kvs, int(r.header.revision)

        return self._run(f())

    def put_under(self, key: str, value: bytes, lease_id: int, fallback: int | None) -> None:
        """Put ``key`` under another process's lease ``lease_id`` (it vanishes with that
        process); under this client's lease ``fallback`` when that lease is gone."""

        async def f(lid: int | None) -> None:
            await self._client.put(key.encode(), value, lease=lid)

        if lease_id:
            try:
                self._run(f(lease_id))
                return
            except MetadataError:
                pass  # that lease expired: the holder is gone or going
        self._run(f(fallback))

    def put_guarded(
        self, guard: str, revision: int, key: str, value: bytes, lease: int | None = None
    ) -> bool:
        """Put ``key`` only while ``guard`` is still at mod revision ``revision``."""

        async def f() -> bool:
            c = self._client
            cmp = [c.transactions.mod(guard.encode()) == revision]
            put = [
                c.transactions.put(
                    key.encode(), value, lease=self._leases.get(lease) if lease else None
                )
            ]
            ok, _ = await c.transaction(compare=cmp, success=put, failure=[])
            return bool(ok)

        return self._run(f())

    def create_rev(self, key: str, value: bytes) -> int | None:
        """Create ``key`` when absent; its mod revision, or None when it existed."""

        async def f() -> int | None:
            c = self._client
            cmp = [c.transactions.create(key.encode()) == 0]
            ok, _ = await c.transaction(
                compare=cmp, success=[c.transactions.put(key.encode(), value)], failure=[]
            )
            if not ok:
                return None
            r = await c.get(key.encode())
            return None if r is None else int(r.mod_revision)

        return self._run(f())

    def replace_rev(self, key: str, value: bytes) -> int:
        """Put ``key`` unconditionally; its new mod revision."""

        async def f() -> int:
            await self._client.put(key.encode(), value)
            r = await self._client.get(key.encode())
            return int(r.mod_revision)

        return self._run(f())

    def delete_guarded(self, key: str, revision: int) -> bool:
        """Delete ``key`` only while it is at mod revision ``revision``."""

        async def f() -> bool:
            c = self._client
            ok, _ = await c.transaction(
                compare=[c.transactions.mod(key.encode()) == revision],
                success=[c.transactions.delete(key.encode())],
                failure=[],
            )
            return bool(ok)

        return self._run(f())
