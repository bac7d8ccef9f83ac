"""The soak benchmark, one minute of it: real etcd, two HA masters, store nodes and four worker
processes under faults; and the HA fault the soak found (a standby whose etcd lease expired)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from store_support import Master

from conftest import ROOT, EtcdServer
from mooncake_core.metrics import parse

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


@pytest.mark.timeout(300)
def test_one_minute_soak_loses_corrupts_hangs_and_leaks_nothing(tmp_path: Path) -> None:
    png = tmp_path / "rss.png"
    cmd = [sys.executable, "-m", "mooncake_core", "bench", "soak", "--minutes", "1", "--json"]
    proc = subprocess.Popen(
        [*cmd, "--plot", str(png)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its etcd, masters, nodes and workers share its process group
    )
    try:
        stdout, stderr = proc.communicate(timeout=280)
    finally:  # whatever happened, nothing it started outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = json.loads(stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (out["failed"], stdout[-3000:], stderr[-3000:])
    assert out["minutes"] == 1
    assert out["lost_acked"] == 0
    assert out["corrupted_reads"] == 0
    assert out["hung_ops"] == 0
    assert out["workers_failed"] == 0
    assert out["rss_growth_pct_max"] < 5.0
    assert out["dead_peer_mapped_mib"] == {}  # no killed store node's segment stays mapped
    assert {g["label"] for g in out["rss"]} >= {f"worker{i}" for i in range(4)} | {"store-stable"}
    # the load and the faults really happened
    assert out["ops"] > 1000 and out["get_hits"] > 100 and out["pd_transfers"] > 100
    assert out["pd_verified"] >= out["pd_transfers"]
    assert out["durable_checked"] > 0
    assert out["evictions"] > 0
    assert out["node_kills"] >= 2 and out["leader_failovers"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"RSS plot: {png}" in stdout


def _gw(etcd: EtcdServer, path: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(f"{etcd.http}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def _role(m: Master) -> str:
    try:
        return str(json.loads(m.http("/role")[1])["role"])
    except OSError:
        return "down"


def _roles(m: Master) -> tuple[str, float]:
    """The role a master's /metrics shows (mooncake_master_role), and its is_leader gauge."""
    samples = parse(m.http("/metrics")[1])
    on = [s.labels["role"] for s in samples if s.sample == "mooncake_master_role" and s.value == 1]
    leader = [s.value for s in samples if s.sample == "mooncake_master_is_leader"]
    assert len(on) == 1 and len(leader) == 1, (on, leader)
    return on[0], leader[0]


def _wait_role(m: Master, role: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _role(m) == role:
            return
        time.sleep(0.05)
    raise AssertionError(f"master is {_role(m)}, not {role}, after {timeout}s")


@pytest.mark.timeout(90)
def test_a_standby_whose_lease_expired_still_takes_over(tmp_path: Path) -> None:
    """On a loaded host the standby's keep-alives can miss and etcd drops its lease; it used to
    campaign with the dead lease forever ("requested lease not found"), so when the leader then
    died no master ever led again. It must take a new lease and take over."""
    from mooncake_core.store.ha import StoreEtcd

    etcd = EtcdServer()
    masters: list[Master] = []
    try:
        cluster = f"lease-{uuid.uuid4().hex[:8]}"
        ha = ["--ha", etcd.url, "--cluster-id", cluster, "--ha-lease-ttl", "2"]
        m1 = Master(tmp_path, *ha, name="m1")
        masters.append(m1)
        _wait_role(m1, "leader", 20)
        m2 = Master(tmp_path, *ha, name="m2")
        masters.append(m2)
        _wait_role(m2, "standby", 20)
        assert _roles(m1) == ("leader", 1.0) and _roles(m2) == ("standby", 0.0)  # HA role metrics
        # revoke every lease but the one holding the leader key: the standby's, as if it expired
        se = StoreEtcd(etcd.url, cluster)
        try:
            key = base64.b64encode(se.leader_key.encode()).decode()
        finally:
            se.close()
        kvs = _gw(etcd, "/v3/kv/range", {"key": key})["kvs"]
        assert isinstance(kvs, list) and len(kvs) == 1
        leader_lease = kvs[0]["lease"]
        leases = _gw(etcd, "/v3/lease/leases", {})["leases"]
        assert isinstance(leases, list)
        others = [x["ID"] for x in leases if x["ID"] != leader_lease]
        assert others, leases
        for lid in others:
            _gw(etcd, "/v3/lease/revoke", {"ID": lid})
        m1.kill()
        _wait_role(m2, "leader", 20)
        assert "campaigning with a new one" in Path(m2.log.name).read_text()
        assert _roles(m2) == ("leader", 1.0)
    finally:
        for m in masters:
            m.stop()
        etcd.close()
