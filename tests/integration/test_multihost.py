"""More than one host: listen addresses derived from ``local_hostname``, HA masters that
publish reachable addresses, and docs/deploy.md's store and transfer part across three
network namespaces (three "hosts" on one bridge, with a real etcd).

Layout of the namespace test (the guide's, scaled down)::

    host 1  10.231.86.1   etcd :2379, HA master A (0.0.0.0 + --advertise)
    host 2  10.231.86.2   HA master B (standby), store node, a store client
    host 3  10.231.86.3   a store client (it contributes memory too)

The namespaces (and their bridge, in a fourth "switch" namespace) are the test's own and
are deleted whatever happens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.errors import ConfigError
from mooncake_core.store.ha import check_listen, leader_addresses
from mooncake_core.store.master import MasterServer
from mooncake_core.transfer import TransferEngine
from mooncake_core.transfer.topology import plan_listen

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
STORE_SUPPORT = Path(__file__).resolve().parent / "store_support.py"
NET = "10.231.86"
ETCD = f"etcd://{NET}.1:2379"


# ---------------------------------------------------------------------- no namespaces needed
def test_unresolvable_name_listens_on_loopback_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mooncake_core.transfer")
    with TransferEngine(local_hostname="no-such-host.invalid") as eng:
        assert eng.describe()["addresses"] == [["127.0.0.1", eng.port]]
    assert "'no-such-host.invalid' does not resolve" in caplog.text
    assert "other hosts cannot reach" in caplog.text


def test_foreign_ip_literal_is_refused_in_one_line() -> None:
    eng = TransferEngine(local_hostname="203.0.113.77")  # TEST-NET-3: never ours
    with pytest.raises(ConfigError, match=r"203\.0\.113\.77 is not an address of this host"):
        eng.start()
    eng.close()
    with pytest.raises(ConfigError, match="not an address peers can connect to"):
        plan_listen("0.0.0.0")


def test_wildcard_listen_with_loopback_name_warns_and_explicit_listen_host_wins() -> None:
    plan = plan_listen("127.0.0.1", "0.0.0.0")
    assert plan.listen == ["0.0.0.0"] and plan.advertise == ["127.0.0.1"]
    assert any("cannot reach" in w for w in plan.warnings)
    assert plan_listen("127.0.0.1") == plan_listen("localhost")
    assert plan_listen("127.0.0.1").listen == ["127.0.0.1"]
    assert plan_listen("no-such-host.invalid", "127.0.0.2").listen == ["127.0.0.2"]


def test_ha_master_on_a_wildcard_without_advertise_is_refused() -> None:
    with pytest.raises(ConfigError, match="--advertise"):
        check_listen("0.0.0.0", "", "etcd://10.0.0.1:2379")
    with pytest.raises(ConfigError, match="not a wildcard"):
        check_listen("10.0.0.5", "0.0.0.0:50051", "etcd://10.0.0.1:2379")
    check_listen("0.0.0.0", "10.0.0.5:50051", "etcd://10.0.0.1:2379")
    check_listen("10.0.0.5", "", "etcd://10.0.0.1:2379")
    # the master refuses before it binds or talks to etcd (none runs at this address)
    server = MasterServer(host="0.0.0.0", rpc_port=0, http_port=-1, ha_url="etcd://10.0.0.1:1")
    with pytest.raises(ConfigError, match="would be published as the leader"):
        server.start_in_thread()


def test_leader_record_addresses(caplog: pytest.LogCaptureFixture) -> None:
    rpc, http = leader_addresses("0.0.0.0", 50051, "0.0.0.0", 9003, "10.0.0.5:50051", "etcd://e:1")
    assert (rpc, http) == ("10.0.0.5:50051", "10.0.0.5:9003")
    caplog.set_level(logging.WARNING, logger="mooncake_core.store.ha")
    assert leader_addresses("127.0.0.1", 1, "127.0.0.1", 2, "", "etcd://127.0.0.1:9") == (
        "127.0.0.1:1",
        "127.0.0.1:2",
    )
    assert "loopback" not in caplog.text
    leader_addresses("127.0.0.1", 1, "127.0.0.1", 2, "", "etcd://10.0.0.1:2379")
    assert "clients on other hosts cannot reach it" in caplog.text


# ---------------------------------------------------------------------- three hosts (netns)
class Hosts:
    """Three network namespaces on one bridge, each with its own /etc/hosts."""

    def __init__(self) -> None:
        tag = f"mh{os.getpid() % 100000}"
        self.tag = tag
        self.switch = f"{tag}sw"
        self.ns = [f"{tag}h{i}" for i in (1, 2, 3)]
        self.ip = [f"{NET}.{i}" for i in (1, 2, 3)]
        self.names = ["host-a", "host-b", "host-c"]
        self.tmp = Path(tempfile.mkdtemp(prefix="mc-multihost-", dir="/dev/shm"))
        self.procs: list[subprocess.Popen[Any]] = []
        self.made_etc_netns = False

    def setup(self) -> None:
        sw = self.switch
        cmds = [
            f"ip netns add {sw}",
            f"ip -n {sw} link add br0 type bridge",
            f"ip -n {sw} link set br0 up",
        ]
        for i, ns in enumerate(self.ns):
            host_end, sw_end = f"{self.tag}e{i}", f"{self.tag}s{i}"
            cmds += [
                f"ip netns add {ns}",
                f"ip link add {host_end} type veth peer name {sw_end}",
                f"ip link set {host_end} netns {ns}",
                f"ip link set {sw_end} netns {sw}",
                f"ip -n {sw} link set {sw_end} master br0",
                f"ip -n {sw} link set {sw_end} up",
                f"ip -n {ns} addr add {self.ip[i]}/24 dev {host_end}",
                f"ip -n {ns} link set {host_end} up",
                f"ip -n {ns} link set lo up",
            ]
        for c in cmds:
            r = subprocess.run(c.split(), capture_output=True, text=True)
            if r.returncode != 0:
                raise OSError(f"{c}: {r.stderr.strip()}")
        # `ip netns exec NS` shows /etc/netns/NS/hosts as /etc/hosts: the hosts' DNS
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{ip} {name}\n" for ip, name in zip(self.ip, self.names, strict=True)
        )
        self.made_etc_netns = not Path("/etc/netns").exists()
        for ns in self.ns:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)

    def popen(
        self, host: int, args: list[str], env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], *args], cwd=ROOT, env=e, **kw
        )
        self.procs.append(proc)
        return proc

    def run_py(self, host: int, code: str, timeout: float = 60) -> Any:
        """Run ``code`` with Python on ``host``; its last stdout line is JSON."""
        e = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[host], PY, "-c", code],
            cwd=ROOT,
            env=e,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for ns in [*self.ns, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if self.made_etc_netns:
            with contextlib.suppress(OSError):
                Path("/etc/netns").rmdir()  # only when empty: another user may have added one
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture()
def three_hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    hosts = Hosts()
    try:
        try:
            hosts.setup()
        except OSError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")
        yield hosts
    finally:
        hosts.close()


def _wait_file(path: Path, proc: subprocess.Popen[Any], what: str, timeout: float = 30) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within {timeout}s")


class NsAgent:
    """store_support's client agent, run on one of the hosts (JSON lines on stdin/stdout)."""

    def __init__(self, hosts: Hosts, host: int, segment_size: int) -> None:
        env = {"MOONCAKE_LOCAL_HOSTNAME": hosts.ip[host]}  # no listen host: derived
        log = open(hosts.tmp / f"agent{host}.log", "ab")  # noqa: SIM115
        self.proc = hosts.popen(
            host,
            [
                PY,
                str(STORE_SUPPORT),
                "agent",
                "--master",
                ETCD,
                "--segment-size",
                str(segment_size),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
        )
        log.close()
        hello = self._read()
        assert "error" not in hello, hello
        self.segment: str = hello["segment"]
        self.peer: str = hello["peer"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent exited ({self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        res = self._read()
        assert "error" not in res, res
        return res.get("result")


_LEADER = (
    "import json; from mooncake_core.store.ha import resolve_leader; "
    f"i = resolve_leader({ETCD!r}); print(json.dumps(i and i.rpc))"
)


def _leader(hosts: Hosts, want_prefix: str, timeout: float = 30) -> str:
    end = time.monotonic() + timeout
    got = None
    while time.monotonic() < end:
        got = hosts.run_py(2, _LEADER)  # asked from host 3: what a client there sees
        if got and got.startswith(want_prefix):
            return str(got)
        time.sleep(0.3)
    raise AssertionError(f"leader is {got!r}, expected {want_prefix}...")


def _master(hosts: Hosts, host: int, *args: str) -> subprocess.Popen[Any]:
    ready = hosts.tmp / f"master{host}.json"
    log = open(hosts.tmp / f"master{host}.log", "ab")  # noqa: SIM115
    proc = hosts.popen(
        host,
        [PY, "-m", "mooncake_core", "master", "--ready-file", str(ready), "--ha", ETCD, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    _wait_file(ready, proc, f"master on host {host + 1}")
    return proc


@pytest.mark.netns
@pytest.mark.etcd
@pytest.mark.slow
def test_deploy_guide_store_across_three_hosts(three_hosts: Hosts) -> None:
    hosts = three_hosts
    exe = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.path.exists(exe):
        pytest.skip("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")
    h1 = hosts.ip[0]
    log = open(hosts.tmp / "etcd.log", "ab")  # noqa: SIM115
    hosts.popen(
        0,
        [
            exe,
            "--name",
            "e1",
            "--data-dir",
            str(hosts.tmp / "etcd"),
            "--listen-client-urls",
            f"http://{h1}:2379",
            "--advertise-client-urls",
            f"http://{h1}:2379",
            "--listen-peer-urls",
            f"http://{h1}:2380",
            "--initial-advertise-peer-urls",
            f"http://{h1}:2380",
            "--initial-cluster",
            f"e1=http://{h1}:2380",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    health = (
        "import json, time, urllib.request\n"
        "for _ in range(200):\n"
        "    try:\n"
        f"        r = urllib.request.urlopen('http://{h1}:2379/health', timeout=1).read()\n"
        "        if json.loads(r).get('health') == 'true': break\n"
        "    except OSError: pass\n"
        "    time.sleep(0.1)\n"
        "print(json.dumps(True))\n"
    )
    hosts.run_py(2, health)  # etcd answers host 3 over the bridge

    # an HA master on 0.0.0.0 without --advertise is refused, in one line
    r = subprocess.run(
        ["ip", "netns", "exec", hosts.ns[1], PY, "-m", "mooncake_core", "master"]
        + ["--rpc-address", "0.0.0.0", "--http-port", "-1", "--ha", ETCD],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mooncake-core: error: ") and "--advertise" in last, r.stderr
    assert "Traceback" not in r.stderr

    master_a = _master(
        hosts, 0, "--rpc-address", "0.0.0.0", "--advertise", f"{h1}:50051", "--rpc-port", "50051"
    )
    assert _leader(hosts, f"{h1}:") == f"{h1}:50051"
    _master(hosts, 1, "--rpc-address", hosts.ip[1], "--rpc-port", "50051")

    # a store node on host 2: local_hostname only, it listens there by itself
    node_ready = hosts.tmp / "node.json"
    node_log = open(hosts.tmp / "node.log", "ab")  # noqa: SIM115
    node = hosts.popen(
        1,
        [PY, "-m", "mooncake_core", "store", "--master", ETCD, "--segment-size", "64MiB"]
        + ["--ready-file", str(node_ready)],
        env={"MOONCAKE_LOCAL_HOSTNAME": hosts.ip[1]},
        stdout=node_log,
        stderr=subprocess.STDOUT,
    )
    node_log.close()
    node_info = _wait_file(node_ready, node, "store node")
    assert node_info["peer"].startswith(f"{hosts.ip[1]}:")
    node_segment = node_info["segments"][0]

    c3 = NsAgent(hosts, 2, 32 << 20)  # client on host 3, contributing memory
    c2 = NsAgent(hosts, 1, 0)  # client on host 2, contributing none
    assert c3.peer.startswith(f"{hosts.ip[2]}:")

    # host 3 writes into host 2's node; both clients read it back byte-exact
    size = 3 << 20
    c3.call("put", key="on-node", size=size, preferred_segment=node_segment)
    where = c3.call("call", method="query", args=["on-node"])
    assert node_segment in json.dumps(where)
    assert c3.call("get", key="on-node") == {"size": size, "match": True}
    assert c2.call("get", key="on-node") == {"size": size, "match": True}
    # host 3 keeps one in its own memory; host 2 reads it across the bridge
    c3.call("put", key="on-c3", size=1 << 20, preferred_segment=c3.segment)
    assert c3.segment in json.dumps(c3.call("call", method="query", args=["on-c3"]))
    assert c2.call("get", key="on-c3") == {"size": 1 << 20, "match": True}

    # the leader's host goes away: master B on host 2 takes over, data stays readable
    master_a.kill()
    master_a.wait(10)
    assert _leader(hosts, f"{hosts.ip[1]}:") == f"{hosts.ip[1]}:50051"
    assert c2.call("get", key="on-c3") == {"size": 1 << 20, "match": True}
    assert c3.call("get", key="on-node") == {"size": size, "match": True}
    c2.call("put", key="after-failover", size=200_000, preferred_segment=c3.segment)
    assert c3.call("get", key="after-failover") == {"size": 200_000, "match": True}


@pytest.mark.netns
@pytest.mark.slow
def test_transfer_engines_across_hosts_listen_where_local_hostname_says(
    three_hosts: Hosts, spawn_peer: Any
) -> None:
    hosts = three_hosts
    prefix = ["ip", "netns", "exec"]
    # host 2 by address, host 3 by a name its /etc/hosts resolves; no listen host given
    b = spawn_peer(env={"MOONCAKE_LOCAL_HOSTNAME": hosts.ip[1]}, prefix=[*prefix, hosts.ns[1]])
    c = spawn_peer(env={"MOONCAKE_LOCAL_HOSTNAME": "host-c"}, prefix=[*prefix, hosts.ns[2]])
    assert b.name.startswith(f"{hosts.ip[1]}:") and c.name.startswith("host-c:")
    size = 4 << 20
    raddr = c.call("alloc", size=size)["addr"]
    c.call("fill", addr=raddr, length=size, seed=21)
    laddr = b.call("alloc", size=size)["addr"]
    b.call("read", peer=c.name, local=laddr, remote=raddr, length=size)
    assert (
        b.call("digest", addr=laddr, length=size)["sha"]
        == c.call("digest", addr=raddr, length=size)["sha"]
    )
    b.call("fill", addr=laddr, length=1 << 20, seed=22)
    b.call("write", peer=c.name, local=laddr, remote=raddr + 7, length=1 << 20)
    want = b.call("digest", addr=laddr, length=1 << 20)["sha"]
    assert c.call("digest", addr=raddr + 7, length=1 << 20)["sha"] == want
    assert want != hashlib.sha256(bytes(1 << 20)).hexdigest()
