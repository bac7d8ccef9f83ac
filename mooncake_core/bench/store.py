"""``mooncake-core bench store``: our store across processes, with raw-TCP and memcpy references.

Processes (all on loopback): a master (``mooncake-core master``), one *holder* that lends
a pre-faulted segment and also runs a plain Python socket server for the raw-TCP
reference, and this process, the *reader*, which contributes no memory. Every object is
placed on the holder's segment, so each put and get really crosses processes (over TCP,
or over shared memory with ``--transport shm``).

Figures (medians over rounds; each round runs the references next to the store so
machine drift hits both): put/get GB/s at 64 KiB, 1 MiB, 16 MiB, 64 MiB (``put_from`` /
``get_into``, zero-copy); batches of 32 x 1 MiB; 64 KiB ``get_into`` p50/p99; metadata
ops/s (``batch_exists`` over 10k keys, plus single ``exists``). Our client remembers where
the objects it put live, so its gets overlap the master's answer with the read;
``get_uncached_gbps_1m`` repeats the 1 MiB gets with nothing remembered (what a reader of
keys that another client put sees at first). With ``--json`` the last
line is one JSON object. ``get_vs_memcpy_16m`` compares 16 MiB gets with a numpy copy of
the same bytes in the same pattern (as many distinct 16 MiB sources, read as often);
``get_vs_memcpy_hot_16m`` with copying one cache-resident buffer again and again.
``put_gbps_1m_ratio_vs_socket`` / ``get_gbps_1m_ratio_vs_socket``: 1 MiB puts and gets
against the bare-socket reference of the same round (at 1 MiB over loopback the bare socket,
not another store, is the limit), median over rounds. The socket reference does as many
operations as the store's loop and runs before and after it (the mean of the two), so drift
within a round hits both sides.

``--compare-mooncake PYTHON`` uses the hook :func:`run_mooncake`, which runs the same
workload on the published Mooncake store through
``run_mooncake_store_bench(python, quick)`` of ``benchmarks/published/mooncake_peer.py``
(:mod:`mooncake_core.bench.published`; needs the source checkout); ours and theirs alternate
round by round, and the JSON adds ``mooncake_<key>`` and ``<key>_ratio_vs_mooncake`` (ours /
theirs; for the latency keys lower is better) for each figure both report, and
``raw_tcp_<key>_ratio_vs_mooncake``: the raw-TCP reference (a bare Python socket, no store)
against the published store, i.e. the ceiling any store reaching the holder through Python
sockets could score in that run.
Comparisons should use ``--transport tcp``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_core import config
from mooncake_core.bench import rawtcp, store_hot

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
BATCH_N, BATCH_SZ = 32, 1 << 20


def _mv(a: np.ndarray) -> memoryview:
    """A flat byte view of a numpy array (typed for mypy)."""
    return memoryview(a.data).cast("B")


def _label(n: int) -> str:
    return f"{n >> 20}m" if n >= 1 << 20 else f"{n >> 10}k"


# ---------------------------------------------------------------------- holder process
def _holder(master: str, segment_size: int, ready: str) -> int:
    from mooncake_core.store import StoreClient

    with StoreClient(master=master, segment_size=segment_size, prefault=True) as client:
        raw = np.ones(64 << 20, dtype=np.uint8)
        raw_port = rawtcp.start_server(_mv(raw))
        with open(ready + ".tmp", "w") as f:
            json.dump({"segment": client.segment_names[0], "raw_port": raw_port}, f)
        os.replace(ready + ".tmp", ready)
        try:
            sys.stdin.read()  # until the parent closes our stdin
        except KeyboardInterrupt:
            pass
    return 0


# ---------------------------------------------------------------------- references
def _rotating_memcpy(big: np.ndarray, dst: np.ndarray, sources: int, copies: int) -> float:
    """GB/s of ``copies`` 16 MiB copies into ``dst`` from ``sources`` distinct 16 MiB chunks of
    ``big``, in turn."""
    n = 16 << 20
    sources = min(sources, len(big) // n)
    t0 = time.perf_counter()
    for i in range(copies):
        np.copyto(dst[:n], big[(i % sources) * n : (i % sources + 1) * n])
    return copies * n / (time.perf_counter() - t0) / 1e9


def _cold_memcpy(big: np.ndarray, dst: np.ndarray) -> float:
    """memcpy of 16 MiB chunks rotating over a 256 MiB source (cache-cold, like reading many
    objects)."""
    chunks = len(big) // (16 << 20)
    return _rotating_memcpy(big, dst, chunks, 2 * chunks)


def _gbps(nbytes: int, fn: Callable[[], None], reps: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def _socket_ref(
    raw: rawtcp.RawClient, src: np.ndarray, dst: np.ndarray, sizes: tuple[int, ...], quick: bool
) -> dict[str, float]:
    """The bare-socket reference: 1 MiB and 16 MiB writes and reads, as many of each as the
    store's loop at that size does (at least 64 MiB of either)."""
    out: dict[str, float] = {}
    budget = (48 << 20) if quick else (192 << 20)
    for size in sizes:
        reps = max(2, (64 << 20) // size, min(300 if not quick else 100, budget // size))
        sv, dv = _mv(src)[:size], _mv(dst)[:size]
        out[f"raw_tcp_put_gbps_{_label(size)}"] = _gbps(
            size, functools.partial(raw.write, sv), reps
        )
        out[f"raw_tcp_get_gbps_{_label(size)}"] = _gbps(size, functools.partial(raw.read, dv), reps)
    return out


# ---------------------------------------------------------------------- store rounds
def _store_round(
    client: Any,
    seg: str,
    src: np.ndarray,
    dst: np.ndarray,
    quick: bool,
    rnd: int,
    big: np.ndarray | None = None,
    only_1m: bool = False,
) -> dict[str, float]:
    out: dict[str, float] = {}
    budget = (48 << 20) if quick else (192 << 20)
    for size in [1 << 20] if only_1m else SIZES:
        n = max(3, min(300 if not quick else 100, budget // size))
        keys = [f"r{rnd}/s{size}/{i}" for i in range(n)]
        sv, dv = _mv(src)[:size], _mv(dst)[:size]
        client.put_from(f"r{rnd}/warm{size}", sv, preferred_segment=seg)  # connections, mappings
        client.get_into(f"r{rnd}/warm{size}", dv)
        client.remove(f"r{rnd}/warm{size}", force=True)
        t0 = time.perf_counter()
        for k in keys:
            client.put_from(k, sv, preferred_segment=seg)
        out[f"put_gbps_{_label(size)}"] = size * n / (time.perf_counter() - t0) / 1e9
        reads = max(1, 12 // n)  # large objects: read each a few times for a stable figure
        t0 = time.perf_counter()
        for _ in range(reads):
            for k in keys:
                client.get_into(k, dv)
        out[f"get_gbps_{_label(size)}"] = size * n * reads / (time.perf_counter() - t0) / 1e9
        if size == 1 << 20 and hasattr(client, "_forget"):
            # the same gets by a client that remembers nothing (as for keys another client put):
            # the master's answer first, then the read
            t0 = time.perf_counter()
            for k in keys:
                client._forget(None)
                client.get_into(k, dv)
            out["get_uncached_gbps_1m"] = size * n / (time.perf_counter() - t0) / 1e9
        if (
            size == 16 << 20 and big is not None
        ):  # memcpy with the get loop's own pattern: n distinct sources
            out["memcpy_pattern_gbps_16m"] = _rotating_memcpy(big, dst, n, n * reads)
        if rnd == 0 and size == 1 << 20 and not np.array_equal(src[:size], dst[:size]):
            raise AssertionError("store bench read back wrong bytes")
        client.remove_by_regex(f"^r{rnd}/s{size}/", force=True)
    if only_1m:
        return out
    reps = 3 if quick else 8
    bviews = [_mv(src)[i * BATCH_SZ : (i + 1) * BATCH_SZ] for i in range(BATCH_N)]
    dviews = [_mv(dst)[i * BATCH_SZ : (i + 1) * BATCH_SZ] for i in range(BATCH_N)]
    tput = tget = 0.0
    for r in range(reps):
        keys = [f"r{rnd}/b{r}/{i}" for i in range(BATCH_N)]
        t0 = time.perf_counter()
        res = client.batch_put_from(keys, bviews, preferred_segment=seg)
        tput += time.perf_counter() - t0
        if any(x is not None for x in res):
            raise AssertionError(f"batch put failed: {next(x for x in res if x is not None)}")
        t0 = time.perf_counter()
        got = client.batch_get_into(keys, dviews)
        tget += time.perf_counter() - t0
        if any(not isinstance(x, int) for x in got):
            raise AssertionError(
                f"batch get failed: {next(x for x in got if not isinstance(x, int))}"
            )
    out["batch_put_gbps_32x1m"] = BATCH_N * BATCH_SZ * reps / tput / 1e9
    out["batch_get_gbps_32x1m"] = BATCH_N * BATCH_SZ * reps / tget / 1e9
    client.remove_by_regex(f"^r{rnd}/b", force=True)
    # 64 KiB get latency
    lk = [f"r{rnd}/lat/{i}" for i in range(16)]
    for k in lk:
        client.put_from(k, _mv(src)[: 64 << 10], preferred_segment=seg)
    lat = []
    dv = _mv(dst)[: 64 << 10]
    for i in range(400 if quick else 2000):
        t0 = time.perf_counter()
        client.get_into(lk[i % 16], dv)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    out["get64k_p50_us"] = lat[len(lat) // 2] * 1e6
    out["get64k_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
    out["get64k_ops_per_s"] = len(lat) / sum(lat)
    client.remove_by_regex(f"^r{rnd}/lat/", force=True)
    return out


def _meta(client: Any, seg: str, quick: bool) -> dict[str, float]:
    keys = [f"meta/{i}" for i in range(10_000)]
    tiny = memoryview(bytearray(64))
    for i in range(0, len(keys), 1000):
        res = client.batch_put_from(keys[i : i + 1000], [tiny] * 1000, preferred_segment=seg)
        if any(x is not None for x in res):
            raise AssertionError(f"meta put failed: {next(x for x in res if x is not None)}")
    reps = 3 if quick else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        ok = client.batch_exists(keys)
    batch_rate = len(keys) * reps / (time.perf_counter() - t0)
    if not all(ok):
        raise AssertionError("batch_exists missed keys")
    n = 500 if quick else 2000
    t0 = time.perf_counter()
    for i in range(n):
        client.exists(keys[i])
    single = n / (time.perf_counter() - t0)
    client.remove_by_regex("^meta/", force=True)
    return {"meta_ops_per_s": batch_rate, "meta_single_ops_per_s": single}


# ---------------------------------------------------------------------- --compare-mooncake hook
def run_mooncake(python: str, quick: bool) -> dict[str, Any]:
    """HOOK for ``--compare-mooncake PYTHON``: one run of the same workload on the published store.

    Calls ``run_mooncake_store_bench(python, quick)`` of ``benchmarks/published/mooncake_peer.py``
    (found by :func:`mooncake_core.bench.published.peer`; it starts the published
    ``mooncake_master`` with its embedded HTTP metadata server, a holder and a reader over TCP)
    and returns its figures, which use our key names. On failure returns
    ``{"mooncake_error": "..."}``.
    """
    from mooncake_core.bench.published import peer
    from mooncake_core.errors import ConfigError

    try:
        mooncake_peer = peer()
    except (ConfigError, ImportError) as exc:
        return {"mooncake_error": f"benchmarks/published/mooncake_peer.py is not available: {exc}"}
    runner = getattr(mooncake_peer, "run_mooncake_store_bench", None)
    if runner is None:
        return {"mooncake_error": "mooncake_peer has no run_mooncake_store_bench(python, quick)"}
    if os.sep in python:
        python = os.path.abspath(python)  # the runner starts processes in other directories
    try:
        return dict(runner(python, quick))
    except Exception as exc:  # report, do not lose our own figures
        return {"mooncake_error": f"{type(exc).__name__}: {exc}"}


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``mooncake_<key>`` and ``<key>_ratio_vs_mooncake`` (ours / theirs; lower is better for
    latencies)."""
    out: dict[str, Any] = {}
    for k, v in theirs.items():
        out[f"mooncake_{k}"] = v
        mine = ours.get(k)
        if (
            k not in ("rounds", "wall_s")
            and isinstance(mine, (int, float))
            and isinstance(v, (int, float))
            and v
        ):
            out[f"{k}_ratio_vs_mooncake"] = round(mine / v, 3)
        if k == "get_gbps_1m" and isinstance(ours.get("get_uncached_gbps_1m"), (int, float)) and v:
            out["get_uncached_gbps_1m_ratio_vs_mooncake"] = round(
                ours["get_uncached_gbps_1m"] / v, 3
            )
        # the ceiling: what a bare Python socket (no store at all) scores against the published
        # store
        raw = ours.get(f"raw_tcp_{k}")
        if isinstance(raw, (int, float)) and isinstance(v, (int, float)) and v:
            out[f"raw_tcp_{k}_ratio_vs_mooncake"] = round(raw / v, 3)
    return out


def compare_with_mooncake(python: str, quick: bool, ours: dict[str, Any]) -> dict[str, Any]:
    """Single-shot hook: run the published store once and return the keys to merge into ``ours``."""
    theirs = run_mooncake(python, quick)
    return theirs if "mooncake_error" in theirs else ratios(ours, theirs)


def _median_dicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        vals = [
            r[k]
            for r in rows
            if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
        ]
        out[k] = round(statistics.median(vals), 3) if vals and len(vals) == len(rows) else v
    return out


# ---------------------------------------------------------------------- driver
def _wait_file(
    path: str, proc: subprocess.Popen[Any], what: str, timeout: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                data: dict[str, Any] = json.load(f)
            return data
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{what} was not ready within {timeout:.0f}s")


def run_bench(quick: bool, transport: str, rounds: int, only_1m: bool = False) -> dict[str, Any]:
    from mooncake_core.store import StoreClient

    tmp = tempfile.mkdtemp(prefix="mc-bench-store-")
    env = dict(config.environment(), MOONCAKE_LOG_LEVEL="WARNING")
    procs: list[subprocess.Popen[Any]] = []
    try:
        mready = os.path.join(tmp, "master.json")
        master = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_core",
                "--log-level",
                "WARNING",
                "master",
                "--rpc-port",
                "0",
                "--http-port",
                "-1",
                "--ready-file",
                mready,
            ],
            env=env,
        )
        procs.append(master)
        addr = f"127.0.0.1:{_wait_file(mready, master, 'master')['rpc_port']}"
        hready = os.path.join(tmp, "holder.json")
        seg_size = (256 << 20) if quick else (768 << 20)
        holder = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_core.bench.store",
                "--role",
                "holder",
                "--master",
                addr,
                "--segment-size",
                str(seg_size),
                "--ready-file",
                hready,
            ],
            env=env,
            stdin=subprocess.PIPE,
        )
        procs.append(holder)
        info = _wait_file(hready, holder, "holder")
        seg = str(info["segment"])
        src = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
        dst = np.ones(64 << 20, dtype=np.uint8)
        a = np.ones(64 << 20, dtype=np.uint8)
        big = np.ones(256 << 20, dtype=np.uint8)
        raw = rawtcp.RawClient(int(info["raw_port"]))
        rows: list[dict[str, float]] = []
        with StoreClient(master=addr, segment_size=0, transport=transport) as client:
            ref_sizes = (1 << 20,) if only_1m else (1 << 20, 16 << 20)
            for rnd in range(rounds):
                # the socket reference runs before and after the store's own part of the round
                # (the mean of the two), so drift during the round hits both sides alike
                before = _socket_ref(raw, src, dst, ref_sizes, quick)
                row: dict[str, float] = {}
                row.update(_store_round(client, seg, src, dst, quick, rnd, big, only_1m))
                after = _socket_ref(raw, src, dst, ref_sizes, quick)
                for k, v in before.items():
                    row[k] = (v + after[k]) / 2
                for op in ("put", "get"):
                    row[f"{op}_gbps_1m_ratio_vs_socket"] = (
                        row[f"{op}_gbps_1m"] / row[f"raw_tcp_{op}_gbps_1m"]
                    )
                rows.append(row)
                if only_1m:
                    continue
                row["memcpy_gbps_16m"] = _gbps(
                    16 << 20, lambda: np.copyto(a[: 16 << 20], src[: 16 << 20]), 8
                )
                row["memcpy_cold_gbps_16m"] = _cold_memcpy(big, a)
                row["memcpy_gbps_64m"] = _gbps(64 << 20, lambda: np.copyto(a, src), 4)
            meta = {} if only_1m else _meta(client, seg, quick)
        result: dict[str, Any] = {
            k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]
        }
        result["transport"] = transport
        result["rounds"] = rounds
        if only_1m:
            return result
        result.update({k: round(v, 1) for k, v in meta.items()})
        # the shm target's reference: a memcpy of the same bytes in the same pattern (n distinct
        # 16 MiB sources, each read as often as the gets read them); hot = one source again and
        # again (cache-resident)
        result["get_vs_memcpy_16m"] = round(
            result["get_gbps_16m"] / result["memcpy_pattern_gbps_16m"], 3
        )
        result["get_vs_memcpy_hot_16m"] = round(
            result["get_gbps_16m"] / result["memcpy_gbps_16m"], 3
        )
        result["get_vs_memcpy_cold_16m"] = round(
            result["get_gbps_16m"] / result["memcpy_cold_gbps_16m"], 3
        )
        result["get_vs_raw_tcp_16m"] = round(
            result["get_gbps_16m"] / result["raw_tcp_get_gbps_16m"], 3
        )
        return result
    finally:
        store_hot.stop_processes(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench store", description=__doc__.splitlines()[0] if __doc__ else None
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations and rounds")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--transport", choices=["tcp", "shm"], default="tcp", help="path between holder and reader"
    )
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 2)")
    ap.add_argument(
        "--hot",
        action="store_true",
        help="also the hot-key phase: Zipf reads, hot-key replication on vs off (store_hot.py)",
    )
    ap.add_argument(
        "--compare-mooncake",
        metavar="PYTHON",
        default=None,
        help="a Python with mooncake-transfer-engine-non-cuda installed: also run the published "
        "store",
    )
    ap.add_argument(
        "--only-1m",
        action="store_true",
        help="only the 1 MiB puts and gets against the bare socket (the *_ratio_vs_socket "
        "figures; the quickest check of the client's hot path)",
    )
    ap.add_argument("--role", default="reader", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--segment-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "holder":
        return _holder(args.master, args.segment_size, args.ready_file)
    rounds = args.rounds or (2 if args.quick else 3)
    if args.only_1m:
        res = run_bench(args.quick, args.transport, rounds, only_1m=True)
        print(
            f"store bench 1m only ({res['transport']}, median of {rounds} rounds): "
            f"put {res['put_gbps_1m']:.2f} GB/s, {res['put_gbps_1m_ratio_vs_socket']:.2f}x "
            f"the bare socket ({res['raw_tcp_put_gbps_1m']:.2f} GB/s); get "
            f"{res['get_gbps_1m']:.2f} GB/s, {res['get_gbps_1m_ratio_vs_socket']:.2f}x "
            f"({res['raw_tcp_get_gbps_1m']:.2f} GB/s); get with no remembered locations "
            f"{res['get_uncached_gbps_1m']:.2f} GB/s"
        )
        if args.json:
            print(json.dumps(res))
        return 0
    if not args.compare_mooncake:
        res = run_bench(args.quick, args.transport, rounds)
    else:  # alternate ours and theirs, one round each, so machine drift hits both
        mine: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        for _ in range(rounds):
            mine.append(run_bench(args.quick, args.transport, 1))
            t = run_mooncake(args.compare_mooncake, args.quick)
            if "mooncake_error" in t:
                theirs = [t]
                break
            theirs.append(t)
        res = _median_dicts(mine)
        res["rounds"] = len(mine)
        res.update(
            theirs[0] if "mooncake_error" in theirs[0] else ratios(res, _median_dicts(theirs))
        )
    print(
        f"store bench ({res['transport']}, reader and holder in separate processes, "
        f"median of {rounds} rounds)"
    )
    for size in SIZES:
        lb = _label(size)
        print(
            f"  {lb:>4}: put {res[f'put_gbps_{lb}']:7.2f} GB/s   "
            f"get {res[f'get_gbps_{lb}']:7.2f} GB/s"
        )
    print(
        f"  batch 32x1m: put {res['batch_put_gbps_32x1m']:.2f} GB/s   "
        f"get {res['batch_get_gbps_32x1m']:.2f} GB/s"
    )
    print(
        f"  get 64k: p50 {res['get64k_p50_us']:.0f} us  p99 {res['get64k_p99_us']:.0f} us  "
        f"({res['get64k_ops_per_s']:.0f} ops/s)"
    )
    print(
        f"  exists: {res['meta_ops_per_s']:.0f} keys/s batched, "
        f"{res['meta_single_ops_per_s']:.0f} ops/s single"
    )
    print(
        f"  references: raw TCP get 16m {res['raw_tcp_get_gbps_16m']:.2f} GB/s, put 16m "
        f"{res['raw_tcp_put_gbps_16m']:.2f} GB/s; memcpy 16m {res['memcpy_gbps_16m']:.2f} GB/s"
    )
    print(
        f"  get 16m vs memcpy {res['get_vs_memcpy_16m']:.2f}x (same pattern: "
        f"{res['memcpy_pattern_gbps_16m']:.2f} GB/s), "
        f"{res['get_vs_memcpy_hot_16m']:.2f}x (one cache-resident buffer), "
        f"{res['get_vs_memcpy_cold_16m']:.2f}x (cold: {res['memcpy_cold_gbps_16m']:.2f} GB/s); "
        f"vs raw TCP {res['get_vs_raw_tcp_16m']:.2f}x"
    )
    print(
        f"  1m vs a bare Python socket (same round): put {res['put_gbps_1m_ratio_vs_socket']:.2f}x "
        f"(socket {res['raw_tcp_put_gbps_1m']:.2f} GB/s), get "
        f"{res['get_gbps_1m_ratio_vs_socket']:.2f}x (socket {res['raw_tcp_get_gbps_1m']:.2f} GB/s)"
    )
    if "get_uncached_gbps_1m" in res:
        print(
            "  get 1m by a client that remembers no locations: "
            f"{res['get_uncached_gbps_1m']:.2f} GB/s"
        )
    if "raw_tcp_put_gbps_1m_ratio_vs_mooncake" in res:
        print(
            "  vs published: "
            + ", ".join(
                f"{op} {lb} {res[f'{op}_gbps_{lb}_ratio_vs_mooncake']:.2f}x "
                f"(bare Python TCP {res[f'raw_tcp_{op}_gbps_{lb}_ratio_vs_mooncake']:.2f}x)"
                for lb in ("1m", "16m")
                for op in ("put", "get")
            )
            + (
                "; get 1m, no remembered locations "
                f"{res['get_uncached_gbps_1m_ratio_vs_mooncake']:.2f}x"
                if "get_uncached_gbps_1m_ratio_vs_mooncake" in res
                else ""
            )
        )
    if args.hot:  # after the main figures, so it cannot disturb them
        res.update(store_hot.run_hot(args.quick))
        print(store_hot.format_hot(res))
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
