"""Transfer engine against real infrastructure: etcd, the HTTP metadata server, network
namespaces, fuzzed input on the listening port, RDMA detection."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_core.errors import PeerUnreachable
from mooncake_core.metadata.http import HTTPMetadata, MetadataServer
from mooncake_core.transfer import TransferEngine
from mooncake_core.transfer.protocol import GREETING, MAGIC, REQ, RESP, Op
from mooncake_core.transfer.transports.rdma import (
    detect_devices,
    rdma_available,
    request_queue_pair,
)

pytestmark = pytest.mark.timeout(180)


def sha(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


# ---------------------------------------------------------------------- fuzzing
@pytest.fixture(scope="module")
def target() -> Any:
    eng = TransferEngine(transfer={"timeout_s": 5}).start()
    buf = eng.allocate(1 << 16)
    buf.view[:] = b"\xab" * (1 << 16)
    yield eng, buf
    eng.close()


def _poke(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.settimeout(0.5)
        try:
            s.recv(GREETING.size)
            s.sendall(data)
            s.recv(1 << 16)
        except OSError:
            pass


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.one_of(
        st.binary(min_size=0, max_size=300),
        # well-formed headers with random fields: exercises every op with garbage arguments
        st.builds(
            lambda op, rid, aux, addr, n, tail: REQ.pack(MAGIC, op, 0, 0, rid, aux, addr, n) + tail,
            st.integers(0, 255),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**64 - 1),
            st.binary(max_size=64),
        ),
    )
)
def test_fuzzed_bytes_never_crash_or_corrupt(target: Any, data: bytes) -> None:
    eng, buf = target
    _poke(eng.port, data)
    assert bytes(buf.view[:16]) == b"\xab" * 16


def test_listener_survives_fuzzing_and_still_serves(target: Any) -> None:
    eng, buf = target
    for n in (0, 1, 31, 32, 33, 1000):
        _poke(eng.port, os.urandom(n))
    with TransferEngine(transfer={"timeout_s": 5}) as client:
        out = bytearray(1 << 16)
        client.read(eng.name, out, buf.addr)
        assert out == b"\xab" * (1 << 16)
    assert sha(buf.view) == sha(b"\xab" * (1 << 16))


def test_unauthenticated_request_is_refused(target: Any) -> None:
    eng, buf = target
    with socket.create_connection(("127.0.0.1", eng.port), timeout=2) as s:
        s.recv(GREETING.size, socket.MSG_WAITALL)
        s.sendall(REQ.pack(MAGIC, Op.READ, 0, 0, 1, 0, buf.addr, 16))
        head = s.recv(RESP.size, socket.MSG_WAITALL)
        assert RESP.unpack(head)[1] < 0
        assert s.recv(16) == b""  # and the connection is closed without data


# ---------------------------------------------------------------------- metadata backends
def test_http_metadata_server_and_named_peers() -> None:
    with MetadataServer() as srv:
        cfg = {"metadata_server": srv.url, "protocol": "tcp"}
        with (
            TransferEngine(local_hostname="node-a", **cfg) as a,
            TransferEngine(local_hostname="node-b", **cfg) as b,
        ):
            assert a.name == "node-a"
            md = HTTPMetadata(srv.url)
            rpc = md.resolve("node-b")
            assert rpc["rpc_port"] == b.port
            buf = b.allocate(1 << 20, name="kv")
            seg = md.segment("node-b")
            assert seg is not None and any(x["name"] == "kv" for x in seg["buffers"])
            data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
            a.write("node-b", data, buf.addr, transport="tcp")
            assert sha(buf.view) == sha(data)
            # segment-relative addressing by region name
            a.write("node-b", bytearray(b"xyz"), segment="kv", offset=10)
            assert bytes(buf.view[10:13]) == b"xyz"
            with pytest.raises(PeerUnreachable, match="node-c"):
                a.write("node-c", data, 0)
        assert md.get("mooncake/rpc_meta/node-a") is None  # withdrawn on close


@pytest.mark.etcd
def test_etcd_metadata_with_leases(etcd_url: str, spawn_peer: Any) -> None:
    from mooncake_core.etcd import EtcdClient

    env = {
        "MOONCAKE_METADATA_SERVER": etcd_url,
        "MOONCAKE_LOCAL_HOSTNAME": "etcd-peer",
        "MOONCAKE_METADATA_TTL_S": "2",
        "MOONCAKE_METADATA_PREFIX": "mctest",
    }
    peer = spawn_peer(env=env)
    assert peer.name == "etcd-peer"
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    cli = EtcdClient(etcd_url)
    try:
        assert cli.get("mctest/rpc_meta/etcd-peer") is not None
        with TransferEngine(
            metadata_server=etcd_url, local_hostname="etcd-client", metadata={"prefix": "mctest"}
        ) as eng:
            data = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8)
            eng.write("etcd-peer", data, raddr, transport="tcp")
            assert peer.call("digest", addr=raddr, length=len(data))["sha"] == sha(data)
            assert set(cli.get_prefix("mctest/rpc_meta/")) == {
                "mctest/rpc_meta/etcd-peer",
                "mctest/rpc_meta/etcd-client",
            }
        # a dead peer's keys disappear with its lease
        peer.kill()
        end = time.monotonic() + 10
        while cli.get("mctest/rpc_meta/etcd-peer") is not None and time.monotonic() < end:
            time.sleep(0.2)
        assert cli.get("mctest/rpc_meta/etcd-peer") is None
        assert cli.get("mctest/ram/etcd-peer") is None
    finally:
        cli.close()


# ---------------------------------------------------------------------- RDMA detection
def test_rdma_detection_and_fallback_to_tcp(spawn_peer: Any, caplog: Any) -> None:
    ok, why = rdma_available()
    if detect_devices():
        pytest.skip("this machine has RDMA devices; the fallback path is not exercised")
    assert not ok and "RDMA device" in why
    peer = spawn_peer(env={"MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_TRANSFER_SHM": "0"})
    raddr = peer.call("alloc", size=1 << 16)["addr"]
    with TransferEngine(protocol="rdma", transfer={"shm": False}) as eng:
        assert not eng.transports["rdma"].available
        eng.write(peer.name, bytearray(b"via tcp"), raddr)
        assert peer.call("digest", addr=raddr, length=7)["sha"] == sha(b"via tcp")


# ---------------------------------------------------------------------- two hosts (netns)
def _can_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


@pytest.fixture()
def two_hosts() -> Any:
    why = _can_netns()
    if why:
        pytest.skip(why)
    tag = f"mc{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    cmds = [
        f"ip netns add {a}",
        f"ip netns add {b}",
        f"ip link add {tag}va type veth peer name {tag}vb",
        f"ip link set {tag}va netns {a}",
        f"ip link set {tag}vb netns {b}",
        f"ip -n {a} addr add 10.231.77.1/24 dev {tag}va",
        f"ip -n {b} addr add 10.231.77.2/24 dev {tag}vb",
        f"ip -n {a} link set {tag}va up",
        f"ip -n {b} link set {tag}vb up",
        f"ip -n {a} link set lo up",
        f"ip -n {b} link set lo up",
    ]
    try:
        for c in cmds:
            r = subprocess.run(c.split(), capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {c}: {r.stderr.strip()}")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.netns
def test_two_hosts_in_network_namespaces(two_hosts: Any, spawn_peer: Any) -> None:
    a, b = two_hosts
    env = {"MOONCAKE_TRANSFER_LISTEN_HOST": "10.231.77.2", "MOONCAKE_LOCAL_HOSTNAME": "10.231.77.2"}
    server = spawn_peer(env=env, prefix=["ip", "netns", "exec", b])
    assert server.name.startswith("10.231.77.2:")
    raddr = server.call("alloc", size=4 << 20)["addr"]
    server.call("fill", addr=raddr, length=4 << 20, seed=9)
    env2 = {
        "MOONCAKE_TRANSFER_LISTEN_HOST": "10.231.77.1",
        "MOONCAKE_LOCAL_HOSTNAME": "10.231.77.1",
    }
    client = spawn_peer(env=env2, prefix=["ip", "netns", "exec", a])
    laddr = client.call("alloc", size=4 << 20)["addr"]
    # different network namespace = different host: the engine must pick TCP by itself
    client.call("read", peer=server.name, local=laddr, remote=raddr, length=4 << 20)
    assert (
        client.call("digest", addr=laddr, length=4 << 20)["sha"]
        == server.call("digest", addr=raddr, length=4 << 20)["sha"]
    )
    client.call("fill", addr=laddr, length=1 << 20, seed=10)
    client.call("write", peer=server.name, local=laddr, remote=raddr + 5, length=1 << 20)
    assert (
        client.call("digest", addr=laddr, length=1 << 20)["sha"]
        == server.call("digest", addr=raddr + 5, length=1 << 20)["sha"]
    )


@pytest.fixture()
def two_hosts_two_links() -> Any:
    why = _can_netns()
    if why:
        pytest.skip(why)
    tag = f"ms{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    cmds = [f"ip netns add {a}", f"ip netns add {b}"]
    for k, net in ((1, 78), (2, 79)):
        cmds += [
            f"ip link add {tag}a{k} type veth peer name {tag}b{k}",
            f"ip link set {tag}a{k} netns {a}",
            f"ip link set {tag}b{k} netns {b}",
            f"ip -n {a} addr add 10.231.{net}.1/24 dev {tag}a{k}",
            f"ip -n {b} addr add 10.231.{net}.2/24 dev {tag}b{k}",
            f"ip -n {a} link set {tag}a{k} up",
            f"ip -n {b} link set {tag}b{k} up",
        ]
    cmds += [f"ip -n {a} link set lo up", f"ip -n {b} link set lo up"]
    try:
        for c in cmds:
            r = subprocess.run(c.split(), capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {c}: {r.stderr.strip()}")
        yield a, b, tag
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.netns
def test_striping_one_peer_over_two_interfaces(two_hosts_two_links: Any, spawn_peer: Any) -> None:
    a, b, tag = two_hosts_two_links
    server = spawn_peer(
        env={
            "MOONCAKE_TRANSFER_INTERFACES": f"{tag}b1,{tag}b2",
            "MOONCAKE_LOCAL_HOSTNAME": "10.231.78.2",
        },
        prefix=["ip", "netns", "exec", b],
    )
    client = spawn_peer(
        env={
            "MOONCAKE_TRANSFER_INTERFACES": f"{tag}a1,{tag}a2",
            "MOONCAKE_TRANSFER_STRIPE_INTERFACES": "1",
            "MOONCAKE_LOCAL_HOSTNAME": "10.231.78.1",
            "MOONCAKE_TRANSFER_CONNECTIONS_PER_PEER": "2",
            "MOONCAKE_TRANSFER_SLICE_SIZE": "256KiB",
        },
        prefix=["ip", "netns", "exec", a],
    )
    size = 16 << 20
    raddr = server.call("alloc", size=size)["addr"]
    laddr = client.call("alloc", size=size)["addr"]
    client.call("fill", addr=laddr, length=size, seed=4)
    before = [_tx_bytes(a, f"{tag}a1"), _tx_bytes(a, f"{tag}a2")]
    client.call("write", peer=server.name, local=laddr, remote=raddr, length=size)
    sent = [_tx_bytes(a, f"{tag}a1") - before[0], _tx_bytes(a, f"{tag}a2") - before[1]]
    assert (
        client.call("digest", addr=laddr, length=size)["sha"]
        == server.call("digest", addr=raddr, length=size)["sha"]
    )
    # both links carried a real share of the 16 MiB
    assert min(sent) > size // 4, sent


def test_rdma_queue_pair_exchange_is_refused_clearly_without_a_device(spawn_peer: Any) -> None:
    if detect_devices():
        pytest.skip("this machine has RDMA devices")
    from mooncake_core.errors import TransportError

    peer = spawn_peer()
    with TransferEngine() as eng:
        info = eng.peer(peer.name)
        with pytest.raises(
            TransportError, match="refused the RDMA connection: RDMA is not available on engine"
        ):
            qp = {"qpn": 1, "lid": 0, "gid": "::", "psn": 0}
            request_queue_pair(eng, info, qp, time.monotonic() + 5)
        assert eng.ping(peer.name)  # the listener still serves
