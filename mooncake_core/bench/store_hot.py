"""The hot-key phase of ``mooncake-core bench store --hot``: Zipf reads, hot-key replication on
against off, in the same run.

Each mode starts its own master (``store.hot_key_replicas`` 3, or 0 = off), three holder
processes (one segment each) and four reader processes (no memory). The bench process puts
32 objects of 256 KiB with one replica each, so the hottest key lives on one holder. The
readers then ``get_into`` keys with Zipf(1.1) popularity for a warm-up (replication on: the
hot keys gain their replicas) and a measured period. Figures, per mode: read throughput on
the 4 hottest keys (``hot_get_gbps_top4_{on,off}``, all readers together), on all keys, and
the largest share of the hottest keys' reads one segment served
(``hot_max_segment_share_{on,off}``); ``hot_get_speedup_top4`` = on / off. Off runs first,
then on; ``rounds`` alternates them again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

from mooncake_core import config

__all__ = ["format_hot", "run_hot"]

OBJ = 256 << 10
KEYS = 32
TOP = 4
READERS = 4
HOLDERS = 3


def _wait_json(path: str, proc: subprocess.Popen[Any], what: str, timeout: float = 60) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path):
            try:
                with open(path) as f:
                    return json.load(f)
            except json.JSONDecodeError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{what} was not ready within {timeout:.0f}s")


def _holder(master: str, ready: str) -> int:
    from mooncake_core.store import StoreClient

    with StoreClient(master=master, segment_size=64 << 20) as client:
        with open(ready + ".tmp", "w") as f:
            json.dump({"segment": client.segment_names[0]}, f)
        os.replace(ready + ".tmp", ready)
        sys.stdin.read()  # until the bench closes our stdin
    return 0


def _reader(master: str, seed: int, warmup: float, measure: float, start_at: float) -> int:
    import numpy as np

    from mooncake_core.store import StoreClient

    keys = [f"hot/{i}" for i in range(KEYS)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(KEYS)]
    rng = random.Random(seed)
    buf = np.empty(OBJ, dtype=np.uint8)
    with StoreClient(master=master, segment_size=0) as client:
        client.register_buffer(buf)
        addr = int(buf.ctypes.data)
        while time.time() < start_at:
            time.sleep(0.01)
        end_warm = time.monotonic() + warmup
        while time.monotonic() < end_warm:
            client.get_into(keys[rng.choices(range(KEYS), weights)[0]], addr, OBJ)
        per_key = [0] * KEYS
        top_segs: dict[str, int] = {}
        t0 = time.monotonic()
        end = t0 + measure
        while time.monotonic() < end:
            i = rng.choices(range(KEYS), weights)[0]
            if i < TOP:
                snap = dict(client.reads_by_segment)
            client.get_into(keys[i], addr, OBJ)
            per_key[i] += 1
            if i < TOP:
                for s, n in client.reads_by_segment.items():
                    if n != snap.get(s, 0):
                        top_segs[s] = top_segs.get(s, 0) + 1
        secs = time.monotonic() - t0
    print(json.dumps({"secs": secs, "per_key": per_key, "top_segs": top_segs}), flush=True)
    return 0


def _mode(hot: bool, quick: bool) -> dict[str, float]:
    from mooncake_core.store import StoreClient

    tmp = tempfile.mkdtemp(prefix="mc-bench-hot-")
    env = dict(config.environment(), MOONCAKE_LOG_LEVEL="WARNING")
    cfg = os.path.join(tmp, "mooncake.json")
    store = {"hot_key_replicas": 3 if hot else 0, "hot_key_reads": 50, "hot_key_window_s": 1.0}
    with open(cfg, "w") as f:
        json.dump({"store": store}, f)
    procs: list[subprocess.Popen[Any]] = []
    me = [sys.executable, "-m", "mooncake_core.bench.store_hot"]
    try:
        mready = os.path.join(tmp, "master.json")
        master = subprocess.Popen(
            [sys.executable, "-m", "mooncake_core", "--log-level", "WARNING", "master"]
            + ["--rpc-port", "0", "--http-port", "-1", "--ready-file", mready, "--config", cfg],
            env=env,
        )
        procs.append(master)
        addr = f"127.0.0.1:{_wait_json(mready, master, 'master')['rpc_port']}"
        holders = []
        for i in range(HOLDERS):
            ready = os.path.join(tmp, f"holder{i}.json")
            p = subprocess.Popen(
                [*me, "--role", "holder", "--master", addr, "--ready-file", ready],
                env=env,
                stdin=subprocess.PIPE,
            )
            procs.append(p)
            holders.append((p, ready))
        for p, ready in holders:
            _wait_json(ready, p, "holder")
        data = os.urandom(OBJ)
        with StoreClient(master=addr, segment_size=0) as client:
            for i in range(KEYS):
                client.put(f"hot/{i}", data, replica_num=1)
        warmup, measure = (2.0, 3.0) if quick else (3.0, 6.0)
        start_at = time.time() + 4.0  # every reader is up by then
        readers = [
            subprocess.Popen(
                [*me, "--role", "reader", "--master", addr, "--seed", str(100 + i)]
                + ["--warmup", str(warmup), "--measure", str(measure), "--start-at", str(start_at)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(READERS)
        ]
        procs += readers
        outs = []
        for r in readers:
            out, _ = r.communicate(timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"hot-key reader exited with status {r.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        secs = max(o["secs"] for o in outs)
        top = sum(sum(o["per_key"][:TOP]) for o in outs)
        allr = sum(sum(o["per_key"]) for o in outs)
        segs: dict[str, int] = {}
        for o in outs:
            for s, n in o["top_segs"].items():
                segs[s] = segs.get(s, 0) + n
        share = max(segs.values()) / max(1, sum(segs.values())) if segs else 0.0
        return {
            "top4": top * OBJ / secs / 1e9,
            "all": allr * OBJ / secs / 1e9,
            "share": share,
            "segments": float(len(segs)),
        }
    finally:
        stop_processes(procs)


def run_hot(quick: bool, rounds: int = 1) -> dict[str, Any]:
    """Both modes, off then on, ``rounds`` times; medians of the figures."""
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for hot in (False, True):
            rows[hot].append(_mode(hot, quick))
    res: dict[str, Any] = {}
    for hot, tag in ((False, "off"), (True, "on")):
        for k, name in (
            ("top4", "hot_get_gbps_top4"),
            ("all", "hot_get_gbps_all"),
            ("share", "hot_max_segment_share"),
            ("segments", "hot_segments_serving_top4"),
        ):
            vals = sorted(r[k] for r in rows[hot])
            res[f"{name}_{tag}"] = round(vals[len(vals) // 2], 3)
    res["hot_get_speedup_top4"] = round(
        res["hot_get_gbps_top4_on"] / max(1e-9, res["hot_get_gbps_top4_off"]), 3
    )
    return res


def format_hot(res: dict[str, Any]) -> str:
    return (
        f"  hot keys (Zipf 1.1, {READERS} readers, {HOLDERS} holders, {KEYS} x 256k): "
        f"top-{TOP} reads {res['hot_get_gbps_top4_on']:.2f} GB/s with hot-key replication, "
        f"{res['hot_get_gbps_top4_off']:.2f} GB/s without ({res['hot_get_speedup_top4']:.2f}x); "
        f"largest segment share of them {res['hot_max_segment_share_on']:.2f} vs "
        f"{res['hot_max_segment_share_off']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--role", default="bench")
    ap.add_argument("--master", default="")
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--measure", type=float, default=3.0)
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.role == "holder":
        return _holder(a.master, a.ready_file)
    if a.role == "reader":
        return _reader(a.master, a.seed, a.warmup, a.measure, a.start_at)
    res = run_hot(a.quick)
    print(format_hot(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def stop_processes(procs: list[subprocess.Popen[Any]]) -> None:
    """Close the bench's worker processes: stdin closed and SIGTERM in reverse start order,
    then each waited for (SIGKILL after 10 s). Also used by :mod:`mooncake_core.bench.store`."""
    for p in reversed(procs):
        if p.stdin is not None:
            p.stdin.close()
        p.terminate()  # a no-op for a process that already exited
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
