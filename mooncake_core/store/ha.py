"""High availability through etcd: leader election and a replicated metadata log.

Design choice: **the leader replicates its metadata log through etcd** (not a rebuild
from clients' reports). Every change a standby must know (client and segment registry,
each committed object with its replica locations, removals, evictions) becomes an
entry; entries produced by concurrent RPCs are group-committed as one etcd key
``<prefix>/oplog/<seq>`` in a transaction that only succeeds while our leader key
still holds our id (fencing a deposed leader). The master answers an RPC only after
its entries are durable, so an acknowledged ``put_end`` survives a leader crash.
Standbys tail the log; on winning the election they read to its end and take over.

Layout under ``mooncake-store/<cluster_id>/``:

- ``leader``: JSON ``{"id", "rpc", "http"}`` of the leader, attached to its etcd lease
  (TTL ``ha_lease_ttl_s``): it disappears when the leader dies.
- ``oplog/<%016d seq>``: msgpack list of entries (see ``MasterState.apply``).
- ``snap/latest`` and ``snap/<seq>/<part>``: compaction (:class:`Snapshots`); every
  ``snapshot_every`` batches the leader writes its state and trims the log below it.

Clients configured with ``master_server_address = "etcd://host:port"`` read ``leader``
to find the RPC address and re-read it when the connection fails, so the address a master
publishes must be one other hosts reach: :func:`check_listen` refuses a wildcard listen
address (``0.0.0.0``) without ``--advertise``, and :func:`leader_addresses` warns when a
loopback address is published to an etcd on another host.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import Any

import msgspec

from mooncake_core.errors import ConfigError, MetadataError
from mooncake_core.etcd import EtcdClient, parse_etcd_url

__all__ = [
    "StoreEtcd",
    "Snapshots",
    "LeaderInfo",
    "prefix_for",
    "resolve_leader",
    "MAX_BATCH_BYTES",
    "check_listen",
    "leader_addresses",
]

logger = logging.getLogger(__name__)
MAX_BATCH_BYTES = 1 << 20  # etcd's default request limit is 1.5 MiB


def prefix_for(cluster_id: str) -> str:
    return f"mooncake-store/{cluster_id}/"


class LeaderInfo(msgspec.Struct, frozen=True):
    id: str
    rpc: str
    http: str = ""


class StoreEtcd(EtcdClient):
    """:class:`EtcdClient` plus the range reads and fenced writes the store needs."""

    def __init__(self, url: str, cluster_id: str = "default", timeout: float = 5.0) -> None:
        super().__init__(url, timeout=timeout)
        self.prefix = prefix_for(cluster_id)
        self.leader_key = self.prefix + "leader"
        self.oplog_prefix = self.prefix + "oplog/"

    def _seq_key(self, seq: int) -> str:
        return f"{self.oplog_prefix}{seq:016d}"

    # ------------------------------------------------------------------ election
    def leader(self) -> LeaderInfo | None:
        raw = self.get(self.leader_key)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=LeaderInfo)
        except msgspec.DecodeError:
            logger.warning("ignoring a malformed leader record %r", raw[:200])
            return None

    def campaign(self, me: LeaderInfo, lease: int) -> bool:
        """Try to become leader once; True on success."""
        return self.create_if_absent(self.leader_key, msgspec.json.encode(me), lease)

    def still_leader(self, me: LeaderInfo) -> bool:
        cur = self.leader()
        return cur is not None and cur.id == me.id

    def fenced_put(self, me: LeaderInfo, key: str, value: bytes) -> bool:
        """Put ``key`` only while ``me`` holds the leader key (one etcd transaction)."""
        mine = msgspec.json.encode(me)

        async def txn() -> bool:
            c = self._client
            ok, _ = await c.transaction(
                compare=[c.transactions.value(self.leader_key.encode()) == mine],
                success=[c.transactions.put(key.encode(), value)],
                failure=[],
            )
            return bool(ok)

        return bool(self._run(txn()))

    # ------------------------------------------------------------------ oplog
    def append(self, me: LeaderInfo, seq: int, entries: list[Any]) -> int:
        """Write ``entries`` at ``seq`` (split when large) while we lead; returns the next seq.

        Raises MetadataError when we are no longer the leader or etcd fails.
        """
        mine = msgspec.json.encode(me)
        for body in _chunks(entries):
            key = self._seq_key(seq)

            async def txn(k: str = key, v: bytes = body) -> bool:
                c = self._client
                cmp = [
                    c.transactions.value(self.leader_key.encode()) == mine,
                    c.transactions.create(k.encode()) == 0,
                ]
                ok, _ = await c.transaction(
                    compare=cmp, success=[c.transactions.put(k.encode(), v)], failure=[]
                )
                return bool(ok)

            if not self._run(txn()):
                raise MetadataError(
                    f"oplog append at seq {seq} refused: this master is no longer the leader"
                )
            seq += 1
        return seq

    def read_log(self, start_seq: int, limit: int = 512) -> list[tuple[int, list[Any]]]:
        """Log batches with seq >= ``start_seq`` (at most ``limit``), in order."""
        lo = self._seq_key(start_seq).encode()
        hi = (self.oplog_prefix[:-1] + "0").encode()  # '/' + 1

        async def f() -> list[tuple[int, list[Any]]]:
            r = await self._client.get_range(lo, hi, sort_order="ascend", sort_target="key")
            out = []
            for kv in list(r)[:limit]:
                seq = int(kv.key.decode()[len(self.oplog_prefix) :])
                out.append((seq, msgspec.msgpack.decode(bytes(kv.value))))
            return out

        return self._run(f())


def _chunks(entries: list[Any]) -> list[bytes]:
    chunks: list[bytes] = []
    cur: list[Any] = []
    size = 0
    for e in entries:
        b = len(msgspec.msgpack.encode(e))
        if cur and size + b > MAX_BATCH_BYTES:
            chunks.append(msgspec.msgpack.encode(cur))
            cur, size = [], 0
        cur.append(e)
        size += b
    if cur:
        chunks.append(msgspec.msgpack.encode(cur))
    return chunks


class Snapshots:
    """Snapshots of the master's state in etcd, and oplog compaction.

    The leader writes its whole state as of ``seq`` as ``snap/<seq>/<part>`` chunks (each
    under :data:`MAX_BATCH_BYTES`, below etcd's request limit), then ``snap/latest`` =
    ``{"seq", "parts"}``; every write is fenced on the leader key (a deposed master writes
    nothing). Then all but the newest ``retention`` snapshots are deleted, and the oplog
    below the oldest one kept: every kept snapshot can be restored and the log after it
    replayed. :meth:`load` returns the newest complete snapshot (a damaged or half-deleted
    one is skipped with a warning). A master starting with HA (a standby, or a new master
    after the whole group was lost) loads it and replays the log from its seq; one that
    finds a gap in the log (it fell behind a trim) reloads.
    """

    def __init__(self, etcd: StoreEtcd, retention: int = 2) -> None:
        if retention < 1:
            raise ConfigError(f"snapshot retention must be at least 1, got {retention}")
        self.etcd = etcd
        self.prefix = etcd.prefix + "snap/"
        self.retention = retention

    def write(self, me: LeaderInfo, seq: int, entries: list[Any]) -> None:
        # Every part is fenced like the ``latest`` switch: a master that lost the leader key
        # cannot overwrite (or half-overwrite) the parts of the new leader's snapshot at the
        # same seq.
        etcd = self.etcd
        parts = _chunks(entries)
        for i, body in enumerate(parts):
            if not etcd.fenced_put(me, f"{self.prefix}{seq:016d}/{i:06d}", body):
                raise MetadataError(
                    f"snapshot at seq {seq} refused at part {i}: "
                    "this master is no longer the leader"
                )
        value = msgspec.json.encode({"seq": seq, "parts": len(parts)})
        ok = etcd.fenced_put(me, f"{self.prefix}{seq:016d}/parts", value)
        if not ok or not etcd.fenced_put(me, self.prefix + "latest", value):
            raise MetadataError(
                f"snapshot at seq {seq} refused: this master is no longer the leader"
            )
        kept = [s for s in self.seqs() if s <= seq][-self.retention :]
        oldest = kept[0] if kept else seq

        async def trim() -> None:
            c = etcd._client
            await c.delete_range(etcd._seq_key(0).encode(), etcd._seq_key(oldest).encode())
            await c.delete_range(self.prefix.encode(), f"{self.prefix}{oldest:016d}".encode())

        etcd._run(trim())

    def seqs(self) -> list[int]:
        """The seqs of the snapshots in etcd, oldest first (complete or not)."""
        etcd = self.etcd

        async def f() -> list[bytes]:
            r = await etcd._client.get_prefix(self.prefix.encode(), keys_only=True)
            return [bytes(kv.key) for kv in r]

        n = len(self.prefix)
        heads = {k.decode()[n:].split("/")[0] for k in etcd._run(f())}
        return sorted(int(h) for h in heads if h.isdigit())

    def previous(self, seq: int) -> int | None:
        older = [s for s in self.seqs() if s < seq]
        return older[-1] if older else None

    def load(self) -> tuple[int, list[Any]] | None:
        """The newest complete snapshot as (seq, entries), or None when there is none.

        Raises MetadataError when snapshots exist but none of them is complete."""
        raw = self.etcd.get(self.prefix + "latest")
        if raw is None:
            return None
        try:
            latest = int(msgspec.json.decode(raw)["seq"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            logger.warning("ignoring a malformed snap/latest record %r", raw[:200])
            latest = -1
        why = "none found"
        for seq in reversed(self.seqs()):
            if 0 <= latest < seq:
                continue  # being written: not switched to yet
            got = self.etcd.get_prefix(f"{self.prefix}{seq:016d}/")
            try:
                meta = got.pop(f"{self.prefix}{seq:016d}/parts", None)
                if meta is None and seq == latest:  # written before per-snapshot part counts
                    meta = raw
                if meta is None:
                    raise ValueError("its part count was never written")
                parts = int(msgspec.json.decode(meta)["parts"])
                if parts != len(got):
                    raise ValueError(f"{len(got)} of {parts} parts")
                entries: list[Any] = []
                for k in sorted(got):
                    entries.extend(msgspec.msgpack.decode(got[k]))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                why = f"snapshot {seq}: {exc}"
                logger.warning("skipping snapshot %d: %s", seq, exc)
                continue
            return seq, entries
        raise MetadataError(f"no complete snapshot in etcd ({why})")


def resolve_leader(
    url: str, cluster_id: str = "default", timeout: float = 3.0
) -> LeaderInfo | None:
    """One-shot look-up of the leader (for clients and tools)."""
    c = StoreEtcd(url, cluster_id, timeout=timeout)
    try:
        return c.leader()
    finally:
        c.close()


def leader_json(info: LeaderInfo | None) -> str:
    return json.dumps(None if info is None else {"id": info.id, "rpc": info.rpc, "http": info.http})


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _split_host(address: str) -> str:
    host, sep, port = address.rpartition(":")
    return (host if sep and port.isdigit() else address).strip("[]")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(host: str, advertise: str, ha_url: str) -> None:
    """Refuse an HA master whose published address other hosts could not use.

    Raises ConfigError when the RPC listen address is a wildcard and no ``advertise``
    address is given (``0.0.0.0`` would be published as the leader), or when ``advertise``
    is a wildcard itself.
    """
    if advertise and _split_host(advertise) in _WILDCARDS:
        raise ConfigError(
            f"--advertise {advertise}: give the address other hosts reach this master at, "
            "not a wildcard"
        )
    if host in _WILDCARDS and not advertise:
        raise ConfigError(
            f"master --ha {ha_url}: the RPC address {host or '(all)'} is a wildcard and would be "
            "published as the leader; add --advertise HOST:PORT (this host's address) or "
            "listen on that address with --rpc-address"
        )


def leader_addresses(
    host: str, rpc_port: int, http_host: str, http_port: int, advertise: str, ha_url: str
) -> tuple[str, str]:
    """The RPC and HTTP addresses an HA master publishes in its leader record.

    RPC: ``advertise`` or ``host:rpc_port``. HTTP: ``http_host:http_port``, with the
    advertised host in place of a wildcard ``http_host``. Logs a warning when the RPC
    address is loopback while etcd is on another host (clients there cannot connect).
    """
    rpc = advertise or f"{host}:{rpc_port}"
    rpc_host = _split_host(rpc)
    http = f"{rpc_host if http_host in _WILDCARDS else http_host}:{http_port}"
    try:
        etcd_hosts = [h for h, _ in parse_etcd_url(ha_url)]
    except ConfigError:  # reported by the etcd client, one line
        etcd_hosts = []
    if _loopback(rpc_host) and any(not _loopback(h) for h in etcd_hosts):
        logger.warning(
            "store master publishes %s as its address, a loopback one, in an etcd on another "
            "host: clients on other hosts cannot reach it (use --rpc-address or --advertise)",
            rpc,
        )
    return rpc, http
