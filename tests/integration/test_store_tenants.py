"""Tenants and per-tenant quotas against a real master process (``--tenant-quota``).

Clients of different tenants share one pool: the same key names different objects, a key
of one tenant is invisible to the others (get, exists, regex scans, removals), and a
tenant's quota is enforced at put by evicting only that tenant's objects (or refusing).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from store_support import Master, free_port

from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.client import StoreClient
from mooncake_core.store.protocol import InvalidArgument

pytestmark = [pytest.mark.timeout(120)]

KB = 1 << 10


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Master, str]]:
    tmp = tmp_path_factory.mktemp("tenants")
    quotas = tmp / "quotas.json"
    quotas.write_text(json.dumps({"capped": "256KB"}))
    ep = f"tcp://127.0.0.1:{free_port()}"
    m = Master(
        tmp,
        "--tenant-quotas",
        str(quotas),
        "--tenant-quota",
        "strict=128KB:refuse",
        "--kv-events-endpoint",
        ep,
        "--default-kv-lease-ttl",
        "0.5",  # exists and get lease objects; quota eviction skips leased ones
    )
    try:
        yield m, ep
    finally:
        m.stop()


def client(m: Master, tenant: str = "", seg: int = 4 << 20) -> StoreClient:
    return StoreClient(master=m.address, segment_size=seg, tenant=tenant).start()


def test_a_key_in_one_tenant_is_invisible_to_another(master: tuple[Master, str]) -> None:
    m, _ = master
    a, b, plain = client(m, "team-a"), client(m, "team-b"), client(m)
    try:
        for c, v in ((a, b"from a"), (b, b"from b"), (plain, b"from nobody")):
            c.put("shared/k", v)
        assert a.get("shared/k") == b"from a" and b.get("shared/k") == b"from b"
        assert plain.get("shared/k") == b"from nobody"
        a.put("only-a", b"secret")
        assert not b.exists("only-a") and not plain.exists("only-a")
        assert b.batch_exists(["only-a", "shared/k"]) == [False, True]
        with pytest.raises(ObjectNotFound):
            b.get("only-a")
        assert sorted(a.keys_by_regex(".*")) == ["only-a", "shared/k"]
        assert b.keys_by_regex("^shared") == ["shared/k"]
        assert plain.keys_by_regex("^(shared|only)") == ["shared/k"]
        assert a.query("only-a")["key"] == "only-a"
        # removals stay inside the tenant
        b.remove("only-a", force=True) if b.exists("only-a") else None
        assert a.exists("only-a")
        assert b.remove_all(force=True) == 1
        assert a.get("shared/k") == b"from a" and plain.get("shared/k") == b"from nobody"
        assert a.remove_by_regex("^only", force=True) == 1 and a.exists("shared/k")
        # batch puts (extents, one RPC per batch) are namespaced the same way
        assert a.put_batch(["p1", "p2"], [b"1", b"2"]) == [None, None]
        assert not plain.exists("p1") and a.get("p2") == b"2"
    finally:
        for c in (a, b, plain):
            c.remove_all(force=True)
            c.close()


def _tenants(m: Master) -> dict[str, dict[str, Any]]:
    code, body = m.http("/tenants")
    assert code == 200
    out: dict[str, dict[str, Any]] = json.loads(body)
    return out


def test_quota_evicts_only_the_tenants_own_objects(master: tuple[Master, str]) -> None:
    m, _ = master
    capped, other = client(m, "capped"), client(m, "other")
    try:
        for i in range(4):
            other.put(f"o{i}", bytes([i]) * (64 * KB))
        for i in range(10):
            capped.put(f"c{i}", bytes([i]) * (64 * KB))
            st = _tenants(m)["capped"]
            assert int(st["bytes"]) <= 256 * KB
        # the newest four fit; the oldest went, and nothing of the other tenant did
        assert [capped.exists(f"c{i}") for i in range(10)] == [False] * 6 + [True] * 4
        assert all(other.get(f"o{i}") == bytes([i]) * (64 * KB) for i in range(4))
        assert capped.get("c9") == bytes([9]) * (64 * KB)
        time.sleep(0.6)  # the leases of the reads above run out
        # a batch: the tenant's older objects make room
        errs = capped.put_batch([f"b{i}" for i in range(4)], [b"x" * (64 * KB)] * 4)
        assert errs == [None] * 4 and not any(capped.exists(f"c{i}") for i in range(10))
        # a batch bigger than the quota: its own objects are still being written, so the
        # ones that do not fit fail, one clear error each
        errs = capped.put_batch([f"d{i}" for i in range(6)], [b"y" * (64 * KB)] * 6)
        assert errs[:4] == [None] * 4
        assert all(isinstance(e, NoSpace) and "tenant 'capped'" in str(e) for e in errs[4:])
        assert int(_tenants(m)["capped"]["bytes"]) <= 256 * KB
        st = _tenants(m)
        assert st["capped"]["quota"] == 256 * KB and st["capped"]["on_full"] == "evict"
        assert st["capped"]["evictions"] == 14 and st["capped"]["refused"] == 2
        assert st["other"]["quota"] is None and st["other"]["objects"] == 4
        assert st["other"]["evictions"] == 0
        # bigger than the whole quota: one clear line
        with pytest.raises(NoSpace, match="tenant 'capped'.*256.0 KiB quota") as exc:
            capped.put("huge", b"h" * (300 * KB))
        assert "\n" not in str(exc.value)
    finally:
        for c in (capped, other):
            c.remove_all(force=True)
            c.close()


def test_a_refusing_quota_refuses_and_keeps_what_it_has(master: tuple[Master, str]) -> None:
    m, _ = master
    strict = client(m, "strict")
    try:
        strict.put("s0", b"0" * (64 * KB))
        strict.put("s1", b"1" * (64 * KB))
        with pytest.raises(NoSpace, match="tenant 'strict' holds 128.0 KiB of its 128.0 KiB"):
            strict.put("s2", b"2" * (64 * KB))
        assert strict.get("s0") == b"0" * (64 * KB) and strict.exists("s1")
        assert not strict.exists("s2")
        st = _tenants(m)["strict"]
        assert st["refused"] == 1 and st["on_full"] == "refuse" and st["objects"] == 2
        strict.remove("s0", force=True)
        strict.put("s2", b"2" * (64 * KB))  # room again
        assert strict.exists("s2")
    finally:
        strict.remove_all(force=True)
        strict.close()


def test_events_name_the_tenant_and_the_clients_key(master: tuple[Master, str]) -> None:
    import zmq

    m, ep = master
    sock: Any = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(ep)
    time.sleep(0.3)
    a = client(m, "team-a")
    try:
        a.put("ev-key", b"e")
        assert sock.poll(5000)
        events = msgspec.msgpack.decode(sock.recv_multipart()[-1])[1]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored[0]["object_key"] == "ev-key" and stored[0]["tenant"] == "team-a"
    finally:
        a.remove_all(force=True)
        a.close()
        sock.close(linger=0)


def test_bad_tenants_and_keys_are_one_line_errors(master: tuple[Master, str]) -> None:
    m, _ = master
    for bad in ("a b", "x" * 65, "t\x00", "a/b"):
        with pytest.raises(InvalidArgument, match="tenant"):
            StoreClient(master=m.address, segment_size=0, tenant=bad)
    with StoreClient(master=m.address, segment_size=1 << 20) as c:
        with pytest.raises(InvalidArgument, match="NUL character"):
            c.put("a\x00b\x00c", b"x")
        with pytest.raises(InvalidArgument, match="NUL character"):
            c.put("\x00k", b"x")


def test_bad_quota_flags_are_one_line_errors(tmp_path: Path) -> None:
    for flag, needle in (
        (["--tenant-quota", "a=lots"], "is not a size"),
        (["--tenant-quota", "a"], "is not NAME=SIZE"),
        (["--tenant-quota", "a b=1MB"], "tenant 'a b'"),
        (["--tenant-quotas", str(tmp_path / "missing.json")], "cannot read a JSON object"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "mooncake_core", "master", "--rpc-port", "0", *flag],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


# ---------------------------------------------------------------------- compat entry points
def _compat(m: Master, *args: Any, **kw: Any) -> Any:
    """A compat ``MooncakeDistributedStore`` set up against ``m`` (positional form)."""
    from mooncake_core.compat.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "", m.address, *args, **kw)
    assert rc == 0
    return s


def test_compat_setup_tenant_id_and_mooncake_json(
    master: tuple[Master, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The published entry points: ``setup(..., tenant_id=)``, ``setup({"tenant_id": ...})``
    and a ``MOONCAKE_CONFIG_PATH`` file read by ``mooncake_config``, each put in its tenant."""
    from mooncake_core.compat.mooncake_config import MooncakeConfig
    from mooncake_core.compat.store import MooncakeDistributedStore, ReplicateConfig

    m, _ = master
    a = _compat(m, tenant_id="compat-a")
    b = MooncakeDistributedStore()
    assert (
        b.setup(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 4 << 20,
                "local_buffer_size": 1 << 20,
                "master_server_addr": m.address,
                "tenant_id": "compat-b",
            }
        )
        == 0
    )
    plain = _compat(m)  # tenant_id "default": the default tenant, as before
    cfg_file = tmp_path / "mooncake.json"
    cfg_file.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": m.address,
                "global_segment_size": 0,
                "local_buffer_size": 1 << 20,
                "tenant_id": "compat-b",
            }
        )
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(cfg_file))
    c = MooncakeConfig.load_from_env()
    from_file = MooncakeDistributedStore()
    assert (
        from_file.setup(
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device_name,
            c.master_server_address,
            tenant_id=c.tenant_id,
        )
        == 0
    )
    try:
        assert a.put("k", b"from-a") == 0
        assert b.is_exist("k") == 0 and plain.is_exist("k") == 0 and b.get("k") == b""
        assert b.put("k", b"from-b") == 0 and plain.put("k", b"plain") == 0
        assert a.get("k") == b"from-a" and b.get("k") == b"from-b"
        assert plain.get("k") == b"plain"
        assert from_file.get("k") == b"from-b"  # mooncake.json's tenant_id: compat-b
        # ReplicateConfig.tenant_id: a put naming another tenant than the store's is refused
        cfg = ReplicateConfig()
        cfg.tenant_id = "compat-a"
        assert a.put("k2", b"x", cfg) == 0 and a.get("k2") == b"x"
        with caplog.at_level(logging.ERROR):
            assert b.put("k3", b"y", cfg) < 0
        assert "not this store's tenant 'compat-b'" in caplog.text
        assert a.is_exist("k3") == 0 and b.is_exist("k3") == 0
        # a bad tenant name: setup fails with one line naming it
        caplog.clear()
        bad = MooncakeDistributedStore()
        with caplog.at_level(logging.ERROR):
            assert (
                bad.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", m.address, tenant_id="a b")
                < 0
            )
        assert "tenant_id 'a b'" in caplog.text
    finally:
        for s in (a, b, plain, from_file):
            s.remove_all()
            s.close()


def test_compat_store_is_held_to_its_tenants_quota(
    master: tuple[Master, str], caplog: pytest.LogCaptureFixture
) -> None:
    m, _ = master
    strict = _compat(m, tenant_id="strict")  # --tenant-quota strict=128KB:refuse
    try:
        with caplog.at_level(logging.ERROR):
            assert strict.put("too-big", b"z" * (200 * KB)) < 0
        assert "tenant 'strict'" in caplog.text and "128.0 KiB quota" in caplog.text
        assert strict.is_exist("too-big") == 0
    finally:
        strict.close()
