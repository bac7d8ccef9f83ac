"""Store round trips across processes: a real master and separate client processes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_support import Agent, AgentError, Master, payload

from mooncake_core.errors import MasterUnavailable
from mooncake_core.store import StoreClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Master, Agent, Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("store-rt")
    m = Master(tmp)
    agents: list[Agent] = []
    try:
        agents = [
            Agent(m.address, segment_size=24 << 20, log=tmp / f"agent{i}.log") for i in range(3)
        ]
        yield m, agents[0], agents[1], agents[2]
    finally:
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.parametrize("size", [1, 4097, 1 << 20, (5 << 20) + 3])
def test_put_get_byte_exact_across_processes(
    cluster: tuple[Master, Agent, Agent, Agent], size: int
) -> None:
    _m, a, b, _c = cluster
    key = f"rt/{size}"
    a.call("put", key=key, size=size, preferred_segment=b.segment)
    assert b.call("get", key=key) == {"size": size, "match": True}
    assert a.call("get", key=key) == {"size": size, "match": True}
    assert b.call("get_into", key=key, cap=size + 100) == {"size": size, "match": True}
    assert b.call("call", method="get_size", args=[key]) == size


def _method_count(m: Master, method: str) -> int:
    status, body = m.http("/metrics")
    assert status == 200
    prefix = f'mooncake_master_request_seconds_count{{method="{method}"}} '
    return next(
        (int(float(line[len(prefix) :])) for line in body.splitlines() if line.startswith(prefix)),
        0,
    )


def test_small_puts_take_one_master_call_through_a_reservation(
    cluster: tuple[Master, Agent, Agent, Agent],
) -> None:
    """Single-replica puts up to 4 MiB allocate from an extent the master lent the writer:
    write, then one ``put_commit``; no ``put_start``/``put_end``."""
    m, a, b, c = cluster
    before = json.loads(m.http("/stats")[1])
    starts, commits = _method_count(m, "put_start"), _method_count(m, "put_commit")
    for i in range(10):
        a.call("put", key=f"res/{i}", size=100_000 + i, preferred_segment=c.segment)
    for i in range(10):
        assert b.call("get", key=f"res/{i}") == {"size": 100_000 + i, "match": True}
        assert [
            r[0]["segment"] for r in b.call("call", method="query", args=[f"res/{i}"])["replicas"]
        ] == [c.segment]
    after = json.loads(m.http("/stats")[1])
    assert after["reserved_puts"] - before["reserved_puts"] == 10
    assert (
        after["reservations_granted"] - before["reservations_granted"] == 1
    )  # 1.5 MiB extent: all ten fit
    assert (
        _method_count(m, "put_commit") - commits == 10 and _method_count(m, "put_start") == starts
    )
    # a bad put through the same path still gets the master's clear error, and changes nothing
    with pytest.raises(AgentError, match="ObjectExists"):
        a.call("put", key="res/3", size=10, preferred_segment=c.segment)
    assert b.call("get", key="res/3") == {"size": 100_003, "match": True}


def test_remembered_locations_serve_gets_and_never_return_replaced_bytes(
    cluster: tuple[Master, Agent, Agent, Agent], tmp_path: Path
) -> None:
    """A client remembers where it put or read a key and reads there while the master answers.
    Whatever another client does to the key meanwhile (replace it elsewhere, replace it at the
    very same offset, remove it), the get returns the current object's bytes or its error."""
    m, a, b, c = cluster
    hits = a.call("attr", name="location_hits")
    for i in range(3):
        a.call("put", key=f"loc/{i}", size=300_000, preferred_segment=c.segment)
    for i in range(3):
        assert a.call("get", key=f"loc/{i}") == {"size": 300_000, "match": True}
        assert a.call("get_into", key=f"loc/{i}", cap=400_000) == {"size": 300_000, "match": True}
    assert a.call("attr", name="location_hits") - hits == 6  # every get read the remembered replica
    # replaced by another client (elsewhere: its own extent), then removed
    b.call("call", method="remove", args=["loc/0"], kwargs={"force": True})
    b.call("put", key="loc/0", size=300_000, salt="v2", preferred_segment=c.segment)
    b.call("call", method="remove", args=["loc/1"], kwargs={"force": True})
    hits = a.call("attr", name="location_hits")
    assert a.call("get", key="loc/0", salt="v2") == {"size": 300_000, "match": True}
    with pytest.raises(AgentError, match="ObjectNotFound"):
        a.call("get", key="loc/1")
    assert a.call("attr", name="location_hits") == hits
    # replaced at the very same offset (two-phase puts, no extents: best fit puts both at offset 0)
    two_phase = {"MOONCAKE_STORE_CLIENT_RESERVATIONS": "false"}
    holder = Agent(m.address, segment_size=4 << 20, env=two_phase, log=tmp_path / "holder.log")
    reader = Agent(m.address, segment_size=0, env=two_phase, log=tmp_path / "reader.log")
    try:
        reader.call("put", key="loc/same", size=100_000, preferred_segment=holder.segment)
        where = reader.call("call", method="query", args=["loc/same"])["replicas"]
        hits = reader.call("attr", name="location_hits")
        assert reader.call("get", key="loc/same") == {"size": 100_000, "match": True}
        assert reader.call("attr", name="location_hits") == hits + 1
        holder.call("call", method="remove", args=["loc/same"], kwargs={"force": True})
        holder.call(
            "put", key="loc/same", size=100_000, salt="v2", preferred_segment=holder.segment
        )
        assert (
            holder.call("call", method="query", args=["loc/same"])["replicas"] == where
        )  # same offset
        assert reader.call("get", key="loc/same", salt="v2") == {"size": 100_000, "match": True}
        assert (
            reader.call("attr", name="location_hits") == hits + 1
        )  # the version told the bytes apart
        assert reader.call("get", key="loc/same", salt="v2") == {"size": 100_000, "match": True}
        assert (
            reader.call("attr", name="location_hits") == hits + 2
        )  # and the new version is remembered
    finally:
        reader.stop()
        holder.stop()


def test_zero_copy_registered_addresses(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, c = cluster
    a.call("put_from_registered", key="zc/1", size=3 << 20, preferred_segment=c.segment)
    assert b.call("get_into_registered", key="zc/1") == {"size": 3 << 20, "match": True}


def test_batches(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, _c = cluster
    keys = [f"batch/{i}" for i in range(20)]
    assert a.call("put_batch", keys=keys, size=70_000) == [None] * 20
    assert b.call("get_batch", keys=keys + ["batch/missing"]) == [True] * 20 + [None]
    got = b.call("batch_get_into", keys=keys[:5] + ["batch/missing"], cap=80_000)
    assert got[:5] == [True] * 5 and got[5] == "ObjectNotFound"
    # a second put of the same keys: every key reports ObjectExists, nothing changes
    assert a.call("put_batch", keys=keys[:3], size=10) == ["ObjectExists"] * 3
    assert b.call("call", method="batch_exists", args=[keys[:2] + ["nope"]]) == [True, True, False]


def test_typed_values(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, _c = cluster
    a.call("put_array", key="np/1", n=24, dtype="<f4", shape=[2, 3, 4])
    assert b.call("get_array", key="np/1") == {
        "dtype": "<f4",
        "shape": [2, 3, 4],
        "sum": float(sum(range(24))),
    }
    a.call("put_tensor", key="pt/1", n=12, shape=[3, 4])
    assert b.call("get_tensor", key="pt/1") == {
        "dtype": "torch.bfloat16",
        "shape": [3, 4],
        "sum": 66.0,
    }


def test_replicas_land_on_distinct_segments(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, _c = cluster
    for i in range(10):
        a.call("put", key=f"rep/{i}", size=100_000, replica_num=3)
        q = b.call("call", method="query", args=[f"rep/{i}"])
        segs = [s["segment"] for rep in q["replicas"] for s in rep]
        assert len(q["replicas"]) == 3 and len(set(segs)) == 3


def test_striping_across_segments(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, _c = cluster
    size = 30 << 20  # larger than any one 24 MiB segment
    # pinned: striping fills segments past the high watermark, and the watermark check
    # would otherwise be free to evict this (only) object before we look at it
    a.call("put", key="stripe/1", size=size, hard_pin=True)
    q = b.call("call", method="query", args=["stripe/1"])
    assert len(q["replicas"]) == 1 and len(q["replicas"][0]) >= 2
    assert b.call("get", key="stripe/1") == {"size": size, "match": True}
    a.call("call", method="remove", args=["stripe/1"], kwargs={"force": True})


def test_remove_regex_and_leases(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    _m, a, b, _c = cluster
    for i in range(6):
        a.call("put", key=f"rx/keep{i}" if i % 2 else f"rx/drop{i}", size=1000)
    assert sorted(b.call("call", method="keys_by_regex", args=["^rx/drop"])) == [
        "rx/drop0",
        "rx/drop2",
        "rx/drop4",
    ]
    # reading grants a lease: a plain remove is refused, a forced one works
    b.call("get", key="rx/drop0")
    with pytest.raises(AgentError) as ei:
        a.call("call", method="remove", args=["rx/drop0"])
    assert ei.value.type == "ObjectBusy" and "leased" in ei.value.msg
    assert (
        a.call("call", method="remove_by_regex", args=["^rx/drop"]) == 2
    )  # the leased one is skipped
    assert a.call("call", method="remove_by_regex", args=["^rx/drop"], kwargs={"force": True}) == 1
    assert (
        b.call("call", method="batch_exists", args=[[f"rx/drop{i}" for i in (0, 2, 4)]])
        == [False] * 3
    )
    assert b.call("call", method="exists", args=["rx/keep1"]) is True


def test_http_metrics_health_and_query(cluster: tuple[Master, Agent, Agent, Agent]) -> None:
    m, a, _b, _c = cluster
    a.call("put", key="http/1", size=5000, replica_num=2)
    status, body = m.http("/health")
    assert status == 200 and json.loads(body)["role"] == "leader"
    status, text = m.http("/metrics")
    assert status == 200
    for name in (
        "mooncake_master_objects",
        "mooncake_master_segment_used_bytes",
        "mooncake_master_evictions_total",
        "mooncake_master_leased_objects",
        'mooncake_master_request_seconds_bucket{le="+Inf",method="put_start"}',
    ):
        assert name in text
    status, body = m.http("/query_key?key=http/1")
    q = json.loads(body)
    assert status == 200 and q["size"] == 5000 and len(q["replicas"]) == 2
    assert m.http("/query_key?key=none")[0] == 404
    # the embedded HTTP metadata server
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{m.http_port}/metadata?key=k", data=b"v", method="PUT"
    )
    urllib.request.urlopen(req, timeout=5).close()
    assert m.http("/metadata?key=k") == (200, "v")


def test_master_log_has_no_tracebacks(
    cluster: tuple[Master, Agent, Agent, Agent], tmp_path: Path
) -> None:
    m, *_ = cluster
    log = Path(m.log.name).read_text()
    assert "Traceback" not in log


def test_store_node_command_contributes_memory(
    cluster: tuple[Master, Agent, Agent, Agent], tmp_path: Path
) -> None:
    import subprocess
    import sys
    import time

    m, a, b, _c = cluster
    ready = tmp_path / "node.json"
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake_core",
            "store",
            "--master",
            m.address,
            "--segment-size",
            "8MB",
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline and node.poll() is None:
            time.sleep(0.05)
        seg = json.loads(ready.read_text())["segments"][0]
        a.call("put", key="node/1", size=3 << 20, preferred_segment=seg)
        q = b.call("call", method="query", args=["node/1"])
        assert q["replicas"][0][0]["segment"] == seg
        assert b.call("get", key="node/1") == {"size": 3 << 20, "match": True}
        assert any(
            s["name"] == seg and s["size"] == 8 << 20 for s in json.loads(m.http("/segments")[1])
        )
    finally:
        node.terminate()
        assert node.wait(timeout=15) == 0
    assert b.call("call", method="exists", args=["node/1"]) is False  # its segment left with it


def test_batch_gets_read_remembered_locations_and_never_return_replaced_bytes(
    cluster: tuple[Master, Agent, Agent, Agent], tmp_path: Path
) -> None:
    """Batch puts and batch gets remember where each key lives; the next batch get of them
    reads there while the master answers, and keeps only what the answer confirms."""
    m, a, b, c = cluster
    keys = [f"bloc/{i}" for i in range(5)]
    assert a.call("put_batch", keys=keys, size=120_000, preferred_segment=c.segment) == [None] * 5
    hits, misses = a.call("attr", name="location_hits"), a.call("attr", name="location_misses")
    assert a.call("batch_get_into", keys=keys, cap=130_000) == [True] * 5
    assert a.call("attr", name="location_hits") - hits == 5  # remembered from the put
    # another client: replaces bloc/0 (elsewhere), removes bloc/1
    b.call("call", method="remove", args=["bloc/0"], kwargs={"force": True})
    b.call("put", key="bloc/0", size=120_000, salt="v2", preferred_segment=c.segment)
    b.call("call", method="remove", args=["bloc/1"], kwargs={"force": True})
    hits, misses = a.call("attr", name="location_hits"), a.call("attr", name="location_misses")
    got = a.call("batch_get_into", keys=keys, cap=130_000, salts={"bloc/0": "v2"})
    assert got == [True, "ObjectNotFound", True, True, True]
    assert a.call("attr", name="location_hits") - hits == 3
    assert (
        a.call("attr", name="location_misses") - misses == 2
    )  # read in vain, then the answer decided
    # a reader that remembers nothing learns the locations with its first batch get
    hits_b = b.call("attr", name="location_hits")
    assert b.call("batch_get_into", keys=keys[2:], cap=130_000) == [True] * 3
    assert b.call("batch_get_into", keys=keys[2:], cap=130_000) == [True] * 3
    assert b.call("attr", name="location_hits") - hits_b == 3
    # replaced at the very same offset (two-phase puts, best fit): only the version tells
    two_phase = {"MOONCAKE_STORE_CLIENT_RESERVATIONS": "false"}
    holder = Agent(m.address, segment_size=4 << 20, env=two_phase, log=tmp_path / "holder.log")
    reader = Agent(m.address, segment_size=0, env=two_phase, log=tmp_path / "reader.log")
    try:
        for k in ("bsame/0", "bsame/1"):
            reader.call("put", key=k, size=100_000, preferred_segment=holder.segment)
        where = reader.call("call", method="query", args=["bsame/0"])["replicas"]
        hits = reader.call("attr", name="location_hits")
        assert reader.call("batch_get_into", keys=["bsame/0", "bsame/1"], cap=100_000) == [
            True,
            True,
        ]
        assert reader.call("attr", name="location_hits") == hits + 2
        holder.call("call", method="remove", args=["bsame/0"], kwargs={"force": True})
        holder.call("put", key="bsame/0", size=100_000, salt="v2", preferred_segment=holder.segment)
        assert (
            holder.call("call", method="query", args=["bsame/0"])["replicas"] == where
        )  # same offset
        assert reader.call(
            "batch_get_into", keys=["bsame/0", "bsame/1"], cap=100_000, salts={"bsame/0": "v2"}
        ) == [True, True]
        assert reader.call("attr", name="location_hits") == hits + 3  # bsame/1 only
    finally:
        reader.stop()
        holder.stop()


def _in_thread(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_early_commit_makes_readers_wait_for_the_write_and_a_failed_write_leaves_nothing(
    cluster: tuple[Master, Agent, Agent, Agent],
) -> None:
    """A one-RPC put sends its commit before the write. Until the writer confirms, requests of
    that key from other clients wait at the master (they never see an object whose bytes have
    not landed); a write that fails closes the connection and the master drops the commit."""
    m, a, b, c = cluster
    gate = threading.Event()
    entered = threading.Event()
    fail = {"on": False}
    with StoreClient(master=m.address, segment_size=0) as w:
        assert w._early  # a master without HA takes early commits
        real_move = w._move

        def held_move(*args: Any, **kw: Any) -> Any:
            entered.set()
            assert gate.wait(30)
            if fail["on"]:
                raise OSError("write failed (injected)")
            return real_move(*args, **kw)

        w._move = held_move  # type: ignore[method-assign]
        size = 200_000
        for key, failing in (("early/ok", False), ("early/failed", True)):
            gate.clear()
            entered.clear()
            fail["on"] = failing
            commits = _method_count(m, "put_commit")
            confirms = _method_count(m, "put_confirm")
            put_t, put_out = _in_thread(w.put, key, payload(key, size), preferred_segment=c.segment)
            assert entered.wait(30)
            deadline = time.monotonic() + 30
            while (
                _method_count(m, "put_commit") == commits
            ):  # the master has the commit; no byte is written
                assert time.monotonic() < deadline
                time.sleep(0.01)
            get_t, get_out = _in_thread(b.call, "get", key=key)
            exists_t, exists_out = _in_thread(a.call, "call", method="exists", args=[key])
            get_t.join(0.5)
            exists_t.join(0.1)
            assert get_t.is_alive() and exists_t.is_alive()  # both wait for the writer
            gate.set()
            put_t.join(30)
            get_t.join(30)
            exists_t.join(30)
            assert not put_t.is_alive() and not get_t.is_alive() and not exists_t.is_alive()
            if failing:
                assert isinstance(put_out.get("error"), OSError)
                assert (
                    isinstance(get_out.get("error"), AgentError)
                    and get_out["error"].type == "ObjectNotFound"
                )
                assert exists_out["result"] is False
                assert _method_count(m, "put_confirm") == confirms  # the closed connection said it
            else:
                assert "error" not in put_out
                assert get_out["result"] == {"size": size, "match": True}
                assert exists_out["result"] is True
                assert _method_count(m, "put_confirm") == confirms + 1
        w._move = real_move  # type: ignore[method-assign]
        # the client carries on: its next put takes a fresh extent (the failed one may hold a
        # dead holder)
        w.put("early/after", payload("early/after", size), preferred_segment=c.segment)
        assert b.call("get", key="early/after") == {"size": size, "match": True}


def test_batch_puts_go_through_reservations_with_early_commits(
    cluster: tuple[Master, Agent, Agent, Agent],
) -> None:
    """A batch of small single-replica objects: one ``batch_put_commit`` sent before the write and
    one one-way ``batch_put_confirm``, no ``batch_put_start``/``batch_put_end``. Readers of its keys
    wait for the confirm; keys whose write failed are dropped, the rest of the batch stands."""
    m, a, b, c = cluster
    starts, ends = _method_count(m, "batch_put_start"), _method_count(m, "batch_put_end")
    commits, confirms = _method_count(m, "batch_put_commit"), _method_count(m, "batch_put_confirm")
    keys = [f"bres/{i}" for i in range(10)]
    assert a.call("put_batch", keys=keys, size=150_000, preferred_segment=c.segment) == [None] * 10
    assert b.call("get_batch", keys=keys) == [True] * 10
    assert b.call("batch_get_into", keys=keys, cap=200_000) == [True] * 10
    assert (
        _method_count(m, "batch_put_commit") == commits + 1
        and _method_count(m, "batch_put_confirm") == confirms + 1
    )
    assert (
        _method_count(m, "batch_put_start") == starts and _method_count(m, "batch_put_end") == ends
    )
    # per-key errors: an existing key and a key twice in one batch; the others land
    res = a.call(
        "put_batch",
        keys=["bres/3", "bres/new", "bres/dup", "bres/dup"],
        size=1000,
        preferred_segment=c.segment,
    )
    assert res == ["ObjectExists", None, None, "ObjectBusy"]
    assert b.call("get", key="bres/3") == {"size": 150_000, "match": True}  # unchanged
    assert b.call("get", key="bres/new") == {"size": 1000, "match": True}
    assert b.call("get", key="bres/dup") == {"size": 1000, "match": True}
    # held and partly failed writes, from a client in this process
    gate = threading.Event()
    entered = threading.Event()
    with StoreClient(master=m.address, segment_size=0) as w:
        real = w._batch_write

        def held(jobs: Any, out: Any) -> set[int]:
            entered.set()
            assert gate.wait(30)
            failed = real(jobs, out)
            failed.add(1)  # as if the second object's bytes never landed
            out[1] = OSError("write failed (injected)")
            return failed

        w._batch_write = held  # type: ignore[method-assign]
        bk = [f"bheld/{i}" for i in range(3)]
        put_t, put_out = _in_thread(
            w.put_batch, bk, [payload(k, 70_000) for k in bk], preferred_segment=c.segment
        )
        assert entered.wait(30)
        deadline = time.monotonic() + 30
        while _method_count(m, "batch_put_commit") == commits + 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        get_t, get_out = _in_thread(b.call, "get_batch", keys=bk)
        get_t.join(0.5)
        assert get_t.is_alive()  # waits for the confirm
        gate.set()
        put_t.join(30)
        get_t.join(30)
        assert not put_t.is_alive() and not get_t.is_alive()
        assert [type(r).__name__ if r is not None else None for r in put_out["result"]] == [
            None,
            "OSError",
            None,
        ]
        assert get_out["result"] == [True, None, True]
        assert b.call("call", method="exists", args=["bheld/1"]) is False
        # an exception in the write closes the commit's connection: nothing of the batch stays
        gate.set()

        def broken(jobs: Any, out: Any) -> set[int]:
            raise OSError("the engine broke (injected)")

        w._batch_write = broken  # type: ignore[method-assign]
        with pytest.raises(OSError, match="injected"):
            w.put_batch(
                ["bgone/0", "bgone/1"], [b"x" * 5000, b"y" * 5000], preferred_segment=c.segment
            )
        assert b.call("call", method="batch_exists", args=[["bgone/0", "bgone/1"]]) == [
            False,
            False,
        ]
        w._batch_write = real  # type: ignore[method-assign]
        assert w.put_batch(
            ["bgone/0"], [payload("bgone/0", 5000)], preferred_segment=c.segment
        ) == [None]
        assert b.call("get", key="bgone/0") == {"size": 5000, "match": True}


def test_a_client_that_was_not_started_starts_on_its_first_operation(
    cluster: tuple[Master, Agent, Agent, Agent],
) -> None:
    """``StoreClient(...)`` without ``start()`` or ``with``: the first operation starts it (once,
    even when several threads make their first operation at the same time); after ``close()``
    every operation gets a clear error."""
    m, _a, b, c = cluster
    data = payload("lazy/0", 300_000)
    lazy = StoreClient(master=m.address, segment_size=0)
    try:
        lazy.put("lazy/0", data, preferred_segment=c.segment)
        assert b.call("get", key="lazy/0") == {"size": len(data), "match": True}
        assert lazy.get("lazy/0") == data
    finally:
        lazy.close()
    with pytest.raises(MasterUnavailable, match="closed"):
        lazy.get("lazy/0")
    with pytest.raises(MasterUnavailable, match="closed"):
        lazy.start()

    registered = _method_count(m, "register_client")
    racy = StoreClient(master=m.address, segment_size=4 << 20)
    try:
        go = threading.Barrier(4)
        errors: list[BaseException] = []

        def first_op(i: int) -> None:
            try:
                go.wait(10)
                racy.put(f"lazy/r{i}", payload(f"lazy/r{i}", 70_000), preferred_segment=c.segment)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=first_op, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert _method_count(m, "register_client") - registered == 1
        assert racy.segment_names  # its segment was lent on the way
        for i in range(4):
            assert b.call("get", key=f"lazy/r{i}") == {"size": 70_000, "match": True}
    finally:
        racy.close()


def test_batch_gets_of_a_key_with_several_replicas_spread_over_them(
    cluster: tuple[Master, Agent, Agent, Agent],
) -> None:
    """A batch get that read a key's remembered replica picks among the key's replicas again for
    the next read, as a single get does (a hot key's reads spread over its copies)."""
    m, a, _b, _c = cluster
    data = payload("spread/0", 50_000)
    a.call("put", key="spread/0", size=len(data), replica_num=3)
    with StoreClient(master=m.address, segment_size=0) as reader:  # no segment: no own replica
        buf = bytearray(len(data))
        for _ in range(30):
            assert reader.batch_get_into(["spread/0"], [buf]) == [len(data)]
            assert buf == data
        assert reader.location_hits >= 20  # most reads started at a remembered replica
        used = [s for s, n in reader.reads_by_segment.items() if n]
    assert len(used) >= 2, reader.reads_by_segment
