"""P2P store with a real etcd and real processes: a swarm of readers, a holder killed in the
middle of a download, a shard corrupted in a holder's memory, lease expiry, unregister and
re-register during a download, bad input.

Every process here is a real one (this file is also the worker script: ``python
test_p2p.py worker``), talking over loopback through the transfer engine (TCP, or shared
memory where a test says so) and to the session's etcd.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.jsonpipe import JsonLinesProcess

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.etcd]


def blob(size: int, seed: int) -> bytearray:
    import numpy as np

    return bytearray(np.random.default_rng(seed).bytes(size))


# ---------------------------------------------------------------------- worker process side
def worker(url: str, shm: bool, ttl: float) -> None:
    from mooncake_core.config import load_config
    from mooncake_core.p2p import P2PStore, Progress

    cfg = load_config().replace(transfer={"shm": shm})
    store = P2PStore(url, config=cfg, lease_ttl=ttl)
    out_lock = threading.Lock()

    def say(d: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(d) + "\n")
            sys.stdout.flush()

    say({"segment": store.segment, "pid": os.getpid()})
    job: dict[str, Any] = {}
    paused, resume = threading.Event(), threading.Event()

    def get(name: str, pause_after: int | None, concurrency: int) -> None:
        def progress(p: Progress) -> None:
            if pause_after is not None and p.shards_done == pause_after:
                paused.set()
                resume.wait(60)

        try:
            rep = store.get_replica(name, concurrency=concurrency, progress=progress)
            job["result"] = {"sha": hashlib.sha256(rep.tobytes()).hexdigest(), "stats": rep.stats}
        except Exception as exc:
            job["result"] = {"exc": type(exc).__name__, "msg": str(exc)}

    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        try:
            if cmd == "register":
                store.register(
                    req["name"],
                    blob(req["size"], req["seed"]),
                    max_shard_size=req["shard"],
                    force=req.get("force", False),
                )
                say({"ok": True})
            elif cmd == "get":
                paused.clear()
                resume.clear()
                t = threading.Thread(
                    target=get, args=(req["name"], req.get("pause_after"), req.get("conc", 4))
                )
                job.clear()
                job["thread"] = t
                t.start()
                say({"ok": True})
            elif cmd == "wait_paused":
                say({"ok": paused.wait(30)})
            elif cmd == "resume":
                resume.set()
                say({"ok": True})
            elif cmd == "result":
                job["thread"].join(60)
                say(job.get("result", {"exc": "Timeout", "msg": "no result"}))
            elif cmd == "corrupt":
                rep = store._held[req["name"]].replica  # the holder's own memory
                off = req["shard"] * req["shard_size"]
                rep.buffers[0][off] ^= 0xFF
                say({"ok": True})
            elif cmd == "held":
                say({"held": store.held()})
            elif cmd == "reset":  # back to the pool: finish the download, hold nothing
                resume.set()
                if "thread" in job:
                    job["thread"].join(60)
                job.clear()
                for name in store.held():
                    store.delete_replica(name)
                say({"ok": True})
            elif cmd == "exit":
                say({"ok": True})
                break
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})
    store.close()


# ---------------------------------------------------------------------- test side
class Proc(JsonLinesProcess):
    """A worker process driven by JSON lines."""

    def __init__(self, url: str, *, shm: bool = False, ttl: float = 10.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        super().__init__(
            [sys.executable, __file__, "worker", url, "1" if shm else "0", str(ttl)],
            env=env,
            label="p2p worker",
        )
        self.segment: str = self.hello["segment"]


@pytest.fixture(scope="module")
def _idle(etcd_server: Any) -> Iterator[dict[tuple[Any, ...], list[Proc]]]:
    """Worker processes kept between this module's tests (each start costs about a second
    of CPU): idle ones, by the options they were started with."""
    idle: dict[tuple[Any, ...], list[Proc]] = {}
    yield idle
    for ps in idle.values():
        for p in ps:
            p.close()


@pytest.fixture()
def procs(etcd_server: Any, _idle: dict[tuple[Any, ...], list[Proc]]) -> Iterator[Any]:
    """``procs(n, **options)``: n worker processes on the session's etcd, idle ones first
    (reset: they hold nothing), the rest started together."""
    taken: list[tuple[tuple[Any, ...], Proc]] = []

    def make(n: int = 1, **kw: Any) -> list[Proc]:
        key = tuple(sorted(kw.items()))
        pool = _idle.setdefault(key, [])
        out: list[Proc] = [pool.pop() for _ in range(min(n, len(pool)))]
        new: list[Proc | None] = [None] * (n - len(out))

        def one(i: int) -> None:
            new[i] = Proc(etcd_server.url, **kw)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(new))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out += [p for p in new if p is not None]
        taken.extend((key, p) for p in out)
        assert len(out) == n, "a worker did not start"
        return out

    yield make
    for key, p in taken:
        try:
            if p.proc.poll() is None and p.call("reset", timeout=30)["ok"]:
                _idle[key].append(p)
                continue
        except (OSError, RuntimeError, TimeoutError, ValueError):
            pass
        p.kill()


@pytest.fixture()
def store(etcd_url: str) -> Iterator[Any]:
    from mooncake_core.p2p import P2PStore

    s = P2PStore(etcd_url)
    yield s
    s.close()


def sha(size: int, seed: int) -> str:
    return hashlib.sha256(blob(size, seed)).hexdigest()


def unique(tag: str) -> str:
    return f"test/{tag}-{os.getpid()}-{time.monotonic_ns()}"


# ---------------------------------------------------------------------- tests
@pytest.mark.slow
def test_six_readers_at_once_get_the_exact_bytes_and_a_later_one_spares_the_seeder(
    procs: Any, store: Any
) -> None:
    name, size = unique("swarm"), 12 << 20
    (seeder,) = procs(1)
    seeder.call("register", name=name, size=size, seed=1, shard="1MB")
    readers = procs(6)
    for r in readers:
        r.send("get", name=name)
    for r in readers:
        assert r.read(30) == {"ok": True}
    results = [r.call("result") for r in readers]
    want = sha(size, 1)
    assert [x.get("sha") for x in results] == [want] * 6, results
    assert max(x["stats"]["peak_parallel"] for x in results) >= 2  # shards fetched in parallel
    (info,) = [o for o in store.list("test/") if o.name == name]
    assert info.complete == 7 and info.size == size and info.shards == 12
    assert set(info.holders) == {seeder.segment} | {r.segment for r in readers}
    # a later reader takes every shard from readers' replicas, sparing the seeder
    late = procs(1)
    for r in late:
        r.send("get", name=name)
    for r in late:
        assert r.read(30) == {"ok": True}
    for r in late:
        res = r.call("result")
        assert res.get("sha") == want, res
        assert (res["stats"]["from_origin"], res["stats"]["from_peers"]) == (0, 12), res


@pytest.mark.slow
def test_holder_killed_mid_download_others_finish_and_its_entries_expire(
    procs: Any, store: Any
) -> None:
    name, size = unique("kill"), 8 << 20
    seeder, a = procs(2)
    (doomed,) = procs(1, ttl=2.0)  # its holder record vanishes 2 s after it dies
    seeder.call("register", name=name, size=size, seed=2, shard="512KB")
    doomed.call("get", name=name)
    assert doomed.call("result")["sha"] == sha(size, 2)
    b, c = procs(2)
    for r in (a, b, c):  # readers prefer doomed's replica over the seeder's
        r.call("get", name=name, pause_after=2, conc=1)
    for r in (a, b, c):
        assert r.call("wait_paused")["ok"]
    doomed.kill()
    for r in (a, b, c):
        r.call("resume")
    for r in (a, b, c):
        res = r.call("result")
        assert res.get("sha") == sha(size, 2), res
        assert res["stats"]["failed"] >= 1  # it did try the dead holder
        assert res["stats"]["from_origin"] + res["stats"]["from_peers"] == 16
    # lease expiry: the dead holder's record vanishes; the live ones stay
    end = time.monotonic() + 8
    while time.monotonic() < end:
        (info,) = store.list(name)
        if doomed.segment not in info.holders:
            break
        time.sleep(0.2)
    assert doomed.segment not in info.holders
    assert {seeder.segment, a.segment, b.segment, c.segment} <= set(info.holders)


def holder_record(store: Any, name: str, segment: str) -> Any:
    from mooncake_core.p2p.meta import Holder

    for raw, _ in store.etcd.get_prefix_rev(store.keys.holders(name)).values():
        h = Holder.from_json(raw)
        if h.segment == segment:
            return h
    return None


@pytest.mark.slow
def test_corrupted_shard_is_fetched_again_reported_and_dropped_by_its_holder(
    procs: Any, store: Any
) -> None:
    name, size, shard = unique("corrupt"), 4 << 20, 256 << 10
    seeder, a, b, c = procs(4)
    seeder.call("register", name=name, size=size, seed=3, shard=shard)
    a.call("get", name=name)
    assert a.call("result")["sha"] == sha(size, 3)
    a.call("corrupt", name=name, shard=5, shard_size=shard)  # a flipped byte in a's memory
    b.call("get", name=name)
    res = b.call("result")
    assert res.get("sha") == sha(size, 3), res
    st = res["stats"]
    # b preferred a (a reader) for every shard; shard 5 failed its checksum there and
    # came again from the seeder
    assert (st["corrupt"], st["from_origin"], st["from_peers"]) == (1, 1, 15), st
    # b reported it: a re-verified its copy and stopped listing shard 5; the report is gone
    end = time.monotonic() + 10
    while time.monotonic() < end:
        rec = holder_record(store, name, a.segment)
        if not rec.has(5):
            break
        time.sleep(0.05)
    assert not rec.has(5) and rec.count() == 15, rec
    reports = store.keys.reports(name, store.list(name)[0].version)
    while time.monotonic() < end and store.etcd.get_prefix_rev(reports):
        time.sleep(0.05)
    assert store.etcd.get_prefix_rev(reports) == {}
    # so a later reader never tries a's copy of shard 5
    c.call("get", name=name)
    res = c.call("result")
    assert res.get("sha") == sha(size, 3), res
    assert res["stats"]["corrupt"] == 0 and res["stats"]["failed"] == 0, res


def test_a_wrong_corruption_report_is_cleared_by_the_holder(store: Any) -> None:
    name = unique("falsereport")
    store.register(name, bytearray(blob(64 << 10, 9)), max_shard_size="16KB")
    (info,) = store.list(name)
    key = store.keys.report(name, info.version, store.segment, 2)
    store.etcd.put(key, b'{"by": "someone"}')  # the copy is intact: a wrong report
    end = time.monotonic() + 10
    while time.monotonic() < end and store.etcd.get(key) is not None:
        time.sleep(0.05)
    assert store.etcd.get(key) is None
    rec = holder_record(store, name, store.segment)
    assert rec.count() == 4 and rec.has(2)
    store.unregister(name)


def test_numpy_torch_mmap_and_file_buffers_round_trip_into_the_callers_memory(
    store: Any, etcd_url: str, tmp_path: Path
) -> None:
    """Every kind of memory ``register`` and ``get_replica(into=...)`` take: numpy, torch,
    an mmap, a file mapped from a path, bytes; ``list`` shows sizes, shard size, holders;
    ``delete_replica`` withdraws the holder record."""
    import mmap

    import numpy as np
    import torch

    from mooncake_core.cli.p2p import _write_out
    from mooncake_core.p2p import P2PStore

    arr = np.frombuffer(blob(100_000, 21), dtype=np.uint8).copy()
    ten = torch.frombuffer(blob(80_000, 22), dtype=torch.float32).clone()  # 20,000 floats
    anon = mmap.mmap(-1, 50_000)
    anon[:] = bytes(blob(50_000, 23))
    (tmp_path / "w.safetensors").write_bytes(bytes(blob(70_000, 24)))
    raw = bytes(blob(30_000, 25))
    parts = {"np": arr, "torch": ten, "mmap": anon, "file": tmp_path / "w.safetensors", "b": raw}
    want = [arr.tobytes(), ten.numpy().tobytes(), bytes(anon), bytes(blob(70_000, 24)), raw]
    sizes = [len(w) for w in want]
    name = unique("kinds")
    store.register(name, parts, max_shard_size="16KB")
    (info,) = store.list(name.rsplit("-", 1)[0])  # a prefix of the name
    assert (info.name, info.sizes, info.shard_size, info.labels) == (
        name,
        sizes,
        16 << 10,
        [*parts],
    )
    assert info.shards == sum(-(-n // (16 << 10)) for n in sizes) and info.size == sum(sizes)
    assert info.holders == [store.segment] and info.complete == 1
    with P2PStore(etcd_url) as other:
        flat = torch.zeros(sum(sizes) + 7, dtype=torch.uint8)  # one buffer, large enough
        rep = other.get_replica(name, into=flat)
        assert bytes(flat.numpy()[: sum(sizes)]) == b"".join(want)
        assert rep.stats["from_origin"] == info.shards and rep.stats["peak_parallel"] >= 1
        (info,) = store.list(name)
        assert info.holders == sorted([store.segment, other.segment]) and info.complete == 2
        # held already: into= still receives the bytes (a local copy, nothing fetched)
        per = [np.zeros(n, dtype=np.uint8) for n in sizes]
        rep = other.get_replica(name, into=per)
        assert [p.tobytes() for p in per] == want and rep.stats["local_copy"] == 1
        other.delete_replica(name)
        assert store.list(name)[0].holders == [store.segment]
        dest = mmap.mmap(-1, sum(sizes))  # fetched again, into an mmap
        rep = other.get_replica(name, into=dest)
        assert bytes(dest) == b"".join(want) and rep.labels == [*parts]
    # the CLI writes a single-file replica through a .part name
    (path,) = _write_out(tmp_path / "out.safetensors", ["file"], [rep.buffers[3]], "file")
    assert path.read_bytes() == want[3] and not list(tmp_path.glob("*.part"))
    store.unregister(name)


@pytest.mark.slow
def test_unregister_or_reregister_during_download_is_a_clear_error(procs: Any, store: Any) -> None:
    name, size = unique("unreg"), 4 << 20
    seeder, a, b = procs(3)
    seeder.call("register", name=name, size=size, seed=4, shard="256KB")
    # a new version while a reader is half way: it is told, and keeps nothing
    a.call("get", name=name, pause_after=3, conc=1)
    assert a.call("wait_paused")["ok"]
    seeder.call("register", name=name, size=size, seed=5, shard="256KB", force=True)
    a.call("resume")
    res = a.call("result")
    assert res["exc"] == "VersionChanged" and "during the download" in res["msg"], res
    assert a.call("held")["held"] == []
    # unregistered while a reader is half way: NameNotFound, nothing half-written kept
    b.call("get", name=name, pause_after=3, conc=1)
    assert b.call("wait_paused")["ok"]
    store.unregister(name)
    b.call("resume")
    res = b.call("result")
    assert res["exc"] == "NameNotFound" and "unregistered during the download" in res["msg"]
    assert b.call("held")["held"] == []
    assert store.list(name) == []


def test_bad_names_sizes_and_shard_sizes_are_one_line_errors(store: Any, etcd_url: str) -> None:
    from mooncake_core.p2p import BadName, NameExists, NameNotFound, P2PStore

    data = bytearray(b"x" * 100_000)
    for bad, why in [
        ("", "must not be empty"),
        ("a b", "use letters"),
        ("/abs", "use letters"),
        ("a//b", "use letters"),
        ("x" * 300, "at most 255"),
        (42, "must be a string"),
    ]:
        with pytest.raises(BadName, match=why):
            store.register(bad, data)
    for shard, why in [
        ("0", "between 4 KiB and 4 GiB"),
        ("1KB", "between 4 KiB and 4 GiB"),
        ("5GB", "between 4 KiB and 4 GiB"),
        ("lots", "cannot parse size"),
        (-1, "must not be negative"),
    ]:
        with pytest.raises(BadName, match=why):
            store.register("ok-name", data, max_shard_size=shard)
    with pytest.raises(BadName, match="nothing to publish"):
        store.register("ok-name", bytearray())
    with pytest.raises(BadName, match="give at least one buffer"):
        store.register("ok-name", [])
    with pytest.raises(BadName, match="neither a file nor a directory"):
        store.register("ok-name", "/no/such/file")
    with pytest.raises(BadName, match="cannot use int as memory"):
        store.register("ok-name", [data, 7])
    for e in [BadName("x"), NameNotFound("y")]:
        assert "\n" not in str(e)
    name = unique("bad")
    with pytest.raises(NameNotFound, match="no P2P object named"):
        store.get_replica(name)
    with pytest.raises(NameNotFound, match="holds no replica"):
        store.delete_replica(name)
    with pytest.raises(NameNotFound, match="no P2P object named"):
        store.unregister(name)
    store.register(name, data, max_shard_size="16KB")
    with P2PStore(etcd_url) as other:
        with pytest.raises(NameExists, match="already registered .*force=True"):
            other.register(name, bytearray(10))
        with pytest.raises(
            BadName, match=r"into: 1000 bytes in 1 buffer\(s\), but .* needs 100000"
        ):
            other.get_replica(name, into=bytearray(1000))
        target = bytearray(100_000)
        rep = other.get_replica(name, into=target)
        assert bytes(target) == bytes(data) and rep.size == 100_000
        other.register(name, bytearray(b"y" * 5000), force=True)  # a new version
    # `other` closed: the new version stays registered, with no live holder left
    (info,) = store.list(name)
    assert info.size == 5000 and info.holders == []
    store.unregister(name)


def test_two_processes_without_etcd_seeder_serves_the_coordination_itself() -> None:
    """One seeder, one reader, no etcd: the seeder keeps manifests and holder records in
    the metadata layer's HTTP server; the engines meet by the P2P handshake."""
    from mooncake_core.errors import ConfigError
    from mooncake_core.p2p import NameNotFound, P2PStore

    name, size = unique("direct"), 2 << 20
    with P2PStore("P2PHANDSHAKE") as seeder:
        assert seeder.address.startswith("p2p://127.0.0.1:")
        seeder.register(name, blob(size, 11), max_shard_size="256KB")
        reader = Proc(seeder.address)  # a second process, told only the seeder's address
        try:
            reader.call("get", name=name)
            res = reader.call("result")
            assert res.get("sha") == sha(size, 11), res
            assert (res["stats"]["from_origin"], res["stats"]["corrupt"]) == (8, 0), res
            (info,) = seeder.list(name)
            assert set(info.holders) == {seeder.segment, reader.segment} and info.complete == 2
            seeder.unregister(name)
            assert seeder.list(name) == []
            reader.call("get", name=name)
            res = reader.call("result")
            assert res["exc"] == "NameNotFound", res
        finally:
            reader.close()
        with pytest.raises(NameNotFound):
            seeder.get_replica(name)
    with pytest.raises(ConfigError, match="use p2p://host:port"):
        P2PStore("p2p://no-port")


@pytest.mark.slow
def test_cli_seeds_a_directory_and_a_file_and_get_writes_them_back_byte_for_byte(
    etcd_url: str, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cli = [sys.executable, "-m", "mooncake_core", "p2p", "--etcd", etcd_url]
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model-00001.safetensors").write_bytes(bytes(blob(3 << 20, 8)))
    (src / "sub" / "config.json").write_bytes(b'{"layers": 2}')

    def start_seed(args: list[str], ready: Path) -> subprocess.Popen[str]:
        """``p2p seed ARGS``, once its ready file says it serves (killed if it never does)."""
        proc = subprocess.Popen(
            [*cli, "seed", *args, "--ready-file", str(ready)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        end = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        if not ready.exists():
            proc.kill()
            proc.wait()
        assert ready.exists(), proc.stderr.read() if proc.stderr else ""
        return proc

    name = unique("cli")
    seed = start_seed([str(src), "--name", name, "--shard-size", "512KB"], tmp_path / "ready.json")
    try:
        out = tmp_path / "out"
        r = subprocess.run([*cli, "get", name, str(out)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "fetched" in r.stdout and "ETA" in r.stderr and "peers" in r.stderr
        for rel in ("model-00001.safetensors", "sub/config.json"):
            assert (out / rel).read_bytes() == (src / rel).read_bytes()
        r = subprocess.run([*cli, "ls", "--json", name], env=env, capture_output=True, text=True)
        (row,) = [json.loads(x) for x in r.stdout.splitlines()]
        assert row["files"] == ["model-00001.safetensors", "sub/config.json"]
        assert row["size"] == (3 << 20) + 13 and row["complete"] == 1
        r = subprocess.run(
            [*cli, "get", "no such", str(out)], env=env, capture_output=True, text=True
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.splitlines() == [
            "mooncake-core: error: name 'no such': use letters, digits and . _ - / : @ + = "
            "(starting with a letter or digit, no empty path part)"
        ]
        r = subprocess.run([*cli, "rm", name], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert seed.wait(15) == 0  # the seeder noticed and stopped serving
        assert "stopped serving" in (seed.stdout.read() if seed.stdout else "")
        # a single file seeds too, and get writes it to the file path OUT
        one, name1 = src / "model-00001.safetensors", unique("cli1")
        seed = start_seed([str(one), "--name", name1], tmp_path / "ready1.json")
        got = tmp_path / "one.safetensors"
        r = subprocess.run([*cli, "get", name1, str(got)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert got.read_bytes() == one.read_bytes()
        r = subprocess.run([*cli, "rm", name1], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert seed.wait(15) == 0
    finally:
        if seed.poll() is None:
            seed.kill()
            seed.wait()


class FlakyReads:
    """Fault injection on a reader's TCP transport (the engine's ``fault_hook``, run before
    each slice is sent): reads from ``flaky`` break their connection as the network would
    while ``fails(seconds since its first read)`` says so (the reader's engine retries
    nothing: a broken connection is a failed read); reads from ``slow`` first wait
    ``delay`` s (a slow origin, so the download outlasts a holder's backoff)."""

    def __init__(self, reader: Any, flaky: str, fails: Any, slow: str, delay: float) -> None:
        self.tcp = reader.engine.transports["tcp"]
        self.flaky, self.fails, self.slow, self.delay = flaky, fails, slow, delay
        self.reads: list[tuple[float, bool]] = []  # (when, failed) of each read from flaky
        self.lock = threading.Lock()

    def __call__(self, conn: Any) -> bool:
        if conn.peer == self.slow:
            time.sleep(self.delay)
            return False
        if conn.peer != self.flaky:
            return False
        with self.lock:
            now = time.monotonic()
            fail = bool(self.fails(now - self.reads[0][0] if self.reads else 0.0))
            self.reads.append((now, fail))
            return fail

    def __enter__(self) -> FlakyReads:
        self.tcp.fault_hook = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.tcp.fault_hook = None


def flaky_swarm(store: Any, etcd_url: str, tag: str, shards: int) -> tuple[str, bytes, Any, Any]:
    """``store`` seeds ``shards`` shards of 16 KiB; holder ``a`` fetches them all; reader
    ``b`` (TCP only, no slice retries) is ready to fetch: ``(name, bytes, a, b)``."""
    from mooncake_core.config import load_config
    from mooncake_core.p2p import P2PStore

    name, data = unique(tag), bytes(blob(shards << 14, shards))
    store.register(name, data, max_shard_size="16KB")
    a = P2PStore(etcd_url)
    b = P2PStore(etcd_url, config=load_config().replace(transfer={"shm": False, "retry_count": 0}))
    assert a.get_replica(name).tobytes() == data
    return name, data, a, b


def test_a_holder_whose_reads_fail_for_a_moment_is_read_from_again(
    store: Any, etcd_url: str
) -> None:
    name, data, a, b = flaky_swarm(store, etcd_url, "flaky", 48)
    with a, b:
        # reads from a fail during 0.2 s (a hiccup); the origin sends a shard per 40 ms
        with FlakyReads(b, a.segment, lambda t: t < 0.2, store.segment, 0.04) as f:
            rep = b.get_replica(name, concurrency=4, origin_streams=1)
        assert rep.tobytes() == data
        st = rep.stats
        failed = [t for t, bad in f.reads if bad]
        later = [t for t, bad in f.reads if not bad]
        # after its backoff (0.5 s) a was read from again, and served the rest
        assert failed and later and max(later) - max(failed) >= 0.45, (f.reads, st)
        # (a read queued behind a broken connection fails too, without reaching the hook)
        assert st["failed"] >= len(failed) and st["holders_dropped"] == 0, st
        assert st["from_peers"] == len(later) and st["from_origin"] == 48 - len(later), st
    store.unregister(name)


def test_a_holder_that_keeps_failing_is_tried_three_times_then_dropped(
    store: Any, etcd_url: str
) -> None:
    name, data, a, b = flaky_swarm(store, etcd_url, "failing", 64)
    with a, b:
        with FlakyReads(b, a.segment, lambda t: True, store.segment, 0.04) as f:
            rep = b.get_replica(name, concurrency=4, origin_streams=1)
        assert rep.tobytes() == data
        st = rep.stats
        # three rounds of reads from a (those in flight together count once), 0.5 s and
        # 1 s apart (the backoff doubles); none after the third
        starts = [t for i, (t, _) in enumerate(f.reads) if i == 0 or t - f.reads[i - 1][0] > 0.3]
        gaps = [round(y - x, 2) for x, y in zip(starts, starts[1:], strict=False)]
        assert len(starts) == 3 and gaps[0] >= 0.45 and gaps[1] >= 0.95, (gaps, f.reads)
        assert (st["from_origin"], st["from_peers"], st["holders_dropped"]) == (64, 0, 1), st
        assert st["failed"] >= len(f.reads) and all(bad for _, bad in f.reads), st
    store.unregister(name)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2], sys.argv[3] == "1", float(sys.argv[4]))
