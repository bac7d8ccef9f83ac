"""P2P store: a swarm versus every reader pulling from the seeder, on shaped "hosts".

Each host is a network namespace joined to one bridge by a veth pair; both directions of
every veth are shaped with ``tc tbf`` to ``--rate`` (default 400 Mbit/s), so each host has
a NIC limit as in a cluster. The rate is chosen so that the 2-core machine is not the
limit: the P2P path costs about 2.3 CPU-seconds per GiB moved (both ends together) on this
box, so 8 readers at 400 Mbit/s each use well under half of 2 cores (the run reports the
measured share as ``cpu_util_*``).

Host 0 runs etcd and the seeder, hosts 1..8 one reader each (long-lived processes). For
each N in 1, 2, 4, 8 (``--quick``: 1, 2, 4 and a smaller blob) the same N readers fetch the
blob at the same moment, once as a swarm and once from the seeder only
(``get_replica(swarm=False)``); the time is from the start until the last reader has every
shard verified (each reader then checks its bytes against the seeder's, untimed).
References measured in the same run: a raw TCP socket moving the blob
over one shaped link (``raw_link_s``) and the NIC bound ``ideal_s`` = blob / rate.

Needs root and iproute2 (``ip netns``, ``tc``) and Debian's etcd.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from mooncake_core.config import environment, parse_size
from mooncake_core.etcd import LocalEtcd
from mooncake_core.jsonpipe import JsonLinesProcess

__all__ = ["main"]

PY = sys.executable
DEFAULT_CONCURRENCY = 8
DEFAULT_ORIGIN_STREAMS = 2


# ---------------------------------------------------------------------- worker (in a namespace)
def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _raw_serve(srv: socket.socket, data: bytearray) -> None:
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(data)


def worker_main(url: str, ip: str) -> None:
    """One host's process: JSON commands on stdin, one JSON answer per line on stdout."""
    import logging

    from mooncake_core.config import load_config
    from mooncake_core.p2p import P2PStore

    logging.basicConfig(level=logging.WARNING)
    store = P2PStore(url, config=load_config().replace(local_hostname=ip), lease_ttl=5)
    raw: dict[str, Any] = {}

    def say(d: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    say({"segment": store.segment})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        try:
            if cmd == "seed":
                import numpy as np

                data = bytearray(np.random.default_rng(7).bytes(req["size"]))
                raw["blob"] = data
                store.register(req["name"], data, max_shard_size=req["shard"], force=True)
                say({"sha": hashlib.sha256(data).hexdigest()})
            elif cmd == "get":
                t0 = time.monotonic()
                rep = store.get_replica(
                    req["name"],
                    swarm=req["swarm"],
                    concurrency=req["conc"],
                    origin_streams=req["origin"],
                )
                end = time.monotonic()  # one clock for every namespace of the host
                cpu = _cpu_s()
                digest = hashlib.sha256(rep.buffers[0]).hexdigest()  # the check is not timed
                say({"s": end - t0, "end": end, "sha": digest, "stats": rep.stats, "cpu": cpu})
            elif cmd == "drop":
                store.delete_replica(req["name"])
                say({"ok": True})
            elif cmd == "cpu":
                say({"cpu": _cpu_s()})
            elif cmd == "raw_serve":  # a plain socket sending the blob, for the reference
                srv = socket.create_server((ip, 0))
                threading.Thread(target=_raw_serve, args=(srv, raw["blob"]), daemon=True).start()
                say({"port": srv.getsockname()[1]})
            elif cmd == "raw_get":
                buf = bytearray(req["size"])
                mv = memoryview(buf)
                t0 = time.monotonic()
                with socket.create_connection((req["host"], req["port"])) as s:
                    got = 0
                    while got < len(buf):
                        n = s.recv_into(mv[got:])
                        if not n:
                            break
                        got += n
                say({"s": time.monotonic() - t0, "bytes": got})
            elif cmd == "exit":
                say({"ok": True})
                break
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})
    store.close()


# ---------------------------------------------------------------------- hosts
def _sh(cmd: str) -> None:
    r = subprocess.run(cmd.split(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd}: {r.stderr.strip()}")


class Hosts:
    """``n`` namespaces on a bridge (in a switch namespace), every link shaped both ways."""

    def __init__(self, n: int, rate: str) -> None:
        self.tag = f"p2b{os.getpid() % 10000}"
        self.net = f"10.232.{os.getpid() % 250}"
        self.n = n
        self.rate = rate
        self.switch = f"{self.tag}sw"
        self.ns = [f"{self.tag}h{i}" for i in range(n)]
        self.ip = [f"{self.net}.{i + 1}" for i in range(n)]

    def setup(self) -> None:
        sw = self.switch
        _sh(f"ip netns add {sw}")
        _sh(f"ip -n {sw} link add br0 type bridge")
        _sh(f"ip -n {sw} link set br0 up")
        shape = f"root tbf rate {self.rate} burst 256kb latency 20ms"
        for i, ns in enumerate(self.ns):
            h, s = f"{self.tag}e{i}", f"{self.tag}s{i}"
            for c in (
                f"ip netns add {ns}",
                f"ip link add {h} type veth peer name {s}",
                f"ip link set {h} netns {ns}",
                f"ip link set {s} netns {sw}",
                f"ip -n {sw} link set {s} master br0",
                f"ip -n {sw} link set {s} up",
                f"ip -n {ns} addr add {self.ip[i]}/24 dev {h}",
                f"ip -n {ns} link set {h} up",
                f"ip -n {ns} link set lo up",
                f"ip netns exec {ns} tc qdisc add dev {h} {shape}",  # upload
                f"ip netns exec {sw} tc qdisc add dev {s} {shape}",  # download
            ):
                _sh(c)

    def exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def teardown(self) -> None:
        for ns in [*self.ns, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Worker(JsonLinesProcess):
    """One host's long-lived :func:`worker_main` process, inside its namespace."""

    def __init__(self, prefix: list[str], url: str, ip: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(environment())
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        super().__init__(
            [*prefix, PY, "-m", "mooncake_core.bench.p2p", "--worker", url, ip],
            env=env,
            label=f"bench worker {ip}",
            hello_timeout=90,
        )
        self.segment = self.hello["segment"]

    def read(self, timeout: float = 600) -> dict[str, Any]:
        return super().read(timeout)

    def call(self, cmd: str, timeout: float = 600, **kw: Any) -> dict[str, Any]:
        return super().call(cmd, timeout, **kw)


# ---------------------------------------------------------------------- the runs
def _one_run(
    seeder: Worker,
    readers: list[Worker],
    name: str,
    swarm: bool,
    sha: str,
    conc: int,
    origin: int,
) -> dict[str, Any]:
    cpu0 = [w.call("cpu")["cpu"] for w in [seeder, *readers]]
    t0 = time.monotonic()
    for r in readers:
        r.send("get", name=name, swarm=swarm, conc=conc, origin=origin)
    res = [r.read() for r in readers]
    wall = max(float(x["end"]) for x in res) - t0  # until the last reader had every shard
    cpu1 = [seeder.call("cpu")["cpu"]] + [x["cpu"] for x in res]
    for r in readers:
        r.call("drop", name=name)
    bad = [i for i, x in enumerate(res) if x["sha"] != sha]
    if bad:
        raise RuntimeError(f"readers {bad} got bytes that differ from the seeder's")
    cores = os.cpu_count() or 1
    return {
        "s": wall,
        "cpu_util": sum(b - a for a, b in zip(cpu0, cpu1, strict=True)) / (wall * cores),
        "from_peers": sum(int(x["stats"]["from_peers"]) for x in res),
        "from_origin": sum(int(x["stats"]["from_origin"]) for x in res),
    }


def run(
    rate: str,
    size: int,
    shard: int,
    ns_list: list[int],
    *,
    baseline: bool = True,
    conc: int = 4,
    origin: int = 2,
) -> dict[str, Any]:
    nmax = max(ns_list)
    hosts = Hosts(nmax + 1, rate)
    tmp = tempfile.mkdtemp(prefix="mc-p2p-bench-", dir="/dev/shm")
    etcd: LocalEtcd | None = None
    workers: list[Worker] = []
    try:
        hosts.setup()
        etcd = LocalEtcd(
            tmp,
            host=hosts.ip[0],
            client_port=2379,
            peer_port=2380,
            name="b",
            exec_prefix=hosts.exec(0),
        )
        url = etcd.url
        made: list[Worker | BaseException | None] = [None] * (nmax + 1)

        def start(i: int) -> None:
            try:
                made[i] = Worker(hosts.exec(i), url, hosts.ip[i])
            except BaseException as exc:
                made[i] = exc

        ts = [threading.Thread(target=start, args=(i,)) for i in range(nmax + 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        workers = [w for w in made if isinstance(w, Worker)]
        errs = [w for w in made if not isinstance(w, Worker)]
        if errs:
            raise RuntimeError(f"a bench worker did not start: {errs[0]}")
        seeder, readers = workers[0], workers[1:]
        name = "bench/blob"
        sha = seeder.call("seed", name=name, size=size, shard=shard)["sha"]
        print(
            f"bench p2p: {nmax} reader host(s) + seeder, {rate} per NIC, "
            f"{size >> 20} MiB blob in {shard >> 20} MiB shards",
            file=sys.stderr,
            flush=True,
        )
        port = seeder.call("raw_serve")["port"]
        raw = readers[0].call("raw_get", host=hosts.ip[0], port=port, size=size)
        out: dict[str, Any] = {"raw_link_s": round(raw["s"], 3)}
        for n in ns_list:
            for swarm in (True, False) if baseline else (True,):
                label = "swarm" if swarm else "seeder_only"
                key = f"{label}_s_n{n}"
                r = _one_run(seeder, readers[:n], name, swarm, sha, conc, origin)
                out[key] = round(r["s"], 3)
                out[f"{label}_cpu_util_n{n}"] = round(r["cpu_util"], 3)
                if swarm:
                    out[f"swarm_shards_from_peers_n{n}"] = r["from_peers"]
                    out[f"swarm_shards_from_seeder_n{n}"] = r["from_origin"]
                print(
                    f"  N={n} {'swarm' if swarm else 'seeder-only'}: {r['s']:.2f}s "
                    f"(cpu {100 * r['cpu_util']:.0f}% of {os.cpu_count()} cores; shards "
                    f"from peers {r['from_peers']}, from the seeder {r['from_origin']})",
                    file=sys.stderr,
                    flush=True,
                )
        return out
    finally:
        for w in workers:
            w.close()
        if etcd is not None:
            etcd.close()
        hosts.teardown()
        shutil.rmtree(tmp, ignore_errors=True)


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"--rate {rate!r}: use e.g. 400mbit or 1gbit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench p2p", description=__doc__.splitlines()[0] if __doc__ else ""
    )
    ap.add_argument("--quick", action="store_true", help="N up to 4, 64 MiB (about a minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--rate", default="400mbit", help="NIC rate of every host (tc tbf)")
    ap.add_argument("--size", default=None, help="blob size (default 512MiB, --quick 64MiB)")
    ap.add_argument("--shard-size", default="4MiB", help="shard size (default 4MiB)")
    ap.add_argument(
        "--readers", default=None, help="reader counts to run, e.g. 1,8 (default 1,2,4,8)"
    )
    ap.add_argument("--no-baseline", action="store_true", help="swarm only (no seeder-only runs)")
    ap.add_argument("--concurrency", type=int, default=None, help="shards fetched at once")
    ap.add_argument(
        "--origin-streams", type=int, default=None, help="of them, at most from the seeder"
    )
    ap.add_argument("--worker", nargs=2, metavar=("ETCD", "IP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return 0
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print(
            "mooncake-core: error: bench p2p needs root and iproute2 (ip netns, tc)",
            file=sys.stderr,
        )
        return 2
    try:
        bits = _rate_bits(args.rate)
    except ValueError as exc:
        print(f"mooncake-core: error: {exc}", file=sys.stderr)
        return 2
    size = parse_size(args.size or ("64MiB" if args.quick else "512MiB"), "--size")
    shard = parse_size(args.shard_size, "--shard-size")
    ns_list = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    if args.readers:
        try:
            ns_list = sorted({int(x) for x in args.readers.split(",")})
        except ValueError:
            ns_list = []
        if not ns_list or ns_list[0] < 1 or ns_list[-1] > 16:
            print(
                f"mooncake-core: error: --readers {args.readers!r}: give counts in 1..16, e.g. 1,8",
                file=sys.stderr,
            )
            return 2
    t0 = time.time()
    r = run(
        args.rate,
        size,
        shard,
        ns_list,
        baseline=not args.no_baseline,
        conc=args.concurrency or DEFAULT_CONCURRENCY,
        origin=args.origin_streams or DEFAULT_ORIGIN_STREAMS,
    )
    nmax = max(ns_list)
    r.update(
        {
            "mode": "quick" if args.quick else "full",
            "rate_mbit": round(bits / 1e6, 1),
            "blob_mib": size >> 20,
            "shard_mib": round(shard / (1 << 20), 3),
            "ideal_s": round(size * 8 / bits, 3),
            "concurrency": args.concurrency or DEFAULT_CONCURRENCY,
            "origin_streams": args.origin_streams or DEFAULT_ORIGIN_STREAMS,
            "wall_s": round(time.time() - t0, 1),
        }
    )
    if "swarm_s_n1" in r:
        r[f"swarm_scaling_n{nmax}"] = round(r[f"swarm_s_n{nmax}"] / r["swarm_s_n1"], 3)
    if f"seeder_only_s_n{nmax}" in r:
        r[f"speedup_vs_seeder_only_n{nmax}"] = round(
            r[f"seeder_only_s_n{nmax}"] / r[f"swarm_s_n{nmax}"], 3
        )
    print(f"{'N':>3} | {'swarm s':>8} | {'seeder-only s':>13} | {'speedup':>7}")
    for n in ns_list:
        sw, so = r[f"swarm_s_n{n}"], r.get(f"seeder_only_s_n{n}")
        so_text = f"{so:13.2f} | {so / sw:7.2f}" if so else f"{'-':>13} | {'-':>7}"
        print(f"{n:>3} | {sw:8.2f} | {so_text}")
    line = (
        f"NIC {r['rate_mbit']} Mbit/s; blob {r['blob_mib']} MiB: ideal {r['ideal_s']:.2f}s, "
        f"raw socket {r['raw_link_s']:.2f}s"
    )
    if f"swarm_scaling_n{nmax}" in r:
        line += f"; swarm_scaling_n{nmax} {r[f'swarm_scaling_n{nmax}']:.2f} (target <= 1.5)"
    if f"speedup_vs_seeder_only_n{nmax}" in r:
        line += (
            f", speedup_vs_seeder_only_n{nmax} {r[f'speedup_vs_seeder_only_n{nmax}']:.2f} "
            "(target >= 4 at N=8)"
        )
    print(line)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
