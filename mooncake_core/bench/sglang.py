"""``mooncake-core bench sglang``: HiCache L3 page throughput through our SGLang backend.

A master and a store node run as their own processes. The measuring process is an SGLang
rank (SGLang's real MHA host pool, our ``MooncakeCoreStorage`` built by SGLang's backend
factory) that writes pages with ``batch_set_v1``; a second SGLang rank in another process
reads them with ``batch_get_v1`` and checks them. Pages: 64 tokens of a 32-layer model
(2 KV heads x 128 dims, bfloat16, page_first), 64 pages a batch. With ``--json`` the last
line is one JSON object (``set_gbps``, ``get_gbps``, ``pages_per_s``, ...).

The published Mooncake comparison (SGLang's built-in backend on the published wheel) is
not wired: it needs SGLang inside the published wheel's venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PAGES = 64


def _spec(master: str) -> Any:
    from mooncake_conformance.harness import HarnessSpec, KVLayout

    lay = KVLayout(name="page_first", num_layers=32, page_size=64, num_kv_heads=2, head_dim=128,
                   dtype="bfloat16", num_slots=PAGES + 1)
    return HarnessSpec(factory="mooncake_sglang.testing:make_harness", layout=lay, master=master,
                       model="bench/sglang-32l", options={"failover_timeout_s": 5.0})


def _harness(master: str) -> Any:
    from mooncake_sglang.testing import make_harness

    return make_harness(_spec(master))


def _wait(path: Path, proc: subprocess.Popen[Any], what: str) -> dict[str, Any]:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            out: dict[str, Any] = json.loads(path.read_text())
            return out
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within 60 s")


def reader_main(master: str) -> int:
    h = _harness(master)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "exit":
            break
        keys = msg["keys"]
        idx = h._indices(list(range(len(keys))))
        t = time.perf_counter()
        ok = h.backend.batch_get_v1(keys, idx)
        dt = time.perf_counter() - t
        digests = [hashlib.sha256(h.read(s)).hexdigest() for s in msg.get("check", [])]
        print(json.dumps({"s": dt, "ok": sum(bool(x) for x in ok), "digests": digests}), flush=True)
    h.close()
    return 0


def run(rounds: int) -> dict[str, Any]:
    py = sys.executable
    procs: list[subprocess.Popen[Any]] = []
    with tempfile.TemporaryDirectory(prefix="mc-bench-sglang-") as tmp:
        try:
            mready = Path(tmp) / "master.json"
            procs.append(subprocess.Popen([py, "-m", "mooncake_core", "--log-level", "WARNING", "master", "--rpc-port", "0",
                                           "--http-port", "0", "--ready-file", str(mready)]))
            master = f"127.0.0.1:{_wait(mready, procs[-1], 'master')['rpc_port']}"
            nready = Path(tmp) / "node.json"
            procs.append(subprocess.Popen([py, "-m", "mooncake_core", "--log-level", "WARNING", "store", "--master", master,
                                           "--segment-size", "1GB", "--prefault", "--ready-file", str(nready)]))
            _wait(nready, procs[-1], "store node")
            reader = subprocess.Popen([py, "-m", "mooncake_core.bench.sglang", "--reader", "--master", master],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(reader)
            assert reader.stdout is not None and reader.stdin is not None
            writer = _harness(master)
            json.loads(reader.stdout.readline())
            slots = list(range(PAGES))
            for s in slots:
                writer.fill(s, seed=s + 1)
            page_bytes = len(writer.read(0))
            want = [hashlib.sha256(writer.read(s)).hexdigest() for s in (0, PAGES // 2, PAGES - 1)]
            idx = writer._indices(slots)
            set_s: list[float] = []
            get_s: list[float] = []
            for r in range(rounds + 1):  # round 0 warms connections and page tables
                keys = [f"bench-{os.getpid()}-{r}-{i}" for i in slots]
                t = time.perf_counter()
                ok = writer.backend.batch_set_v1(keys, idx)
                dt = time.perf_counter() - t
                if not all(ok):
                    raise RuntimeError(f"batch_set_v1 stored {sum(ok)} of {len(ok)} pages")
                reader.stdin.write(json.dumps({"cmd": "get", "keys": keys, "check": [0, PAGES // 2, PAGES - 1]}) + "\n")
                reader.stdin.flush()
                res = json.loads(reader.stdout.readline())
                if res["ok"] != PAGES or res["digests"] != want:
                    raise RuntimeError(f"reader got {res['ok']} of {PAGES} pages, digests match: {res['digests'] == want}")
                if r:
                    set_s.append(dt)
                    get_s.append(float(res["s"]))
            writer.backend.clear()
            reader.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            reader.stdin.flush()
            reader.wait(30)
            writer.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    nbytes = PAGES * page_bytes
    set_med = sorted(set_s)[len(set_s) // 2]
    get_med = sorted(get_s)[len(get_s) // 2]
    return {"pages": PAGES, "page_bytes": page_bytes, "rounds": rounds,
            "set_gbps": round(nbytes / set_med / 1e9, 3), "get_gbps": round(nbytes / get_med / 1e9, 3),
            "pages_per_s": round(PAGES / get_med, 1), "set_pages_per_s": round(PAGES / set_med, 1),
            "set_ms": round(set_med * 1e3, 2), "get_ms": round(get_med * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mooncake-core bench sglang", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="measured batches (default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reader:
        return reader_main(args.master)
    if args.rounds < 1:
        raise SystemExit("mooncake-core: error: --rounds must be at least 1")
    print("bench sglang: master, store node, writer rank and reader rank on loopback ...", file=sys.stderr, flush=True)
    r = run(args.rounds)
    print(f"{'op':<14} {'pages':>6} {'MiB/page':>9} {'ms/batch':>9} {'GB/s':>7} {'pages/s':>9}")
    mib = r["page_bytes"] / (1 << 20)
    print(f"{'batch_set_v1':<14} {PAGES:>6} {mib:>9.2f} {r['set_ms']:>9.1f} {r['set_gbps']:>7.2f} {r['set_pages_per_s']:>9.0f}")
    print(f"{'batch_get_v1':<14} {PAGES:>6} {mib:>9.2f} {r['get_ms']:>9.1f} {r['get_gbps']:>7.2f} {r['pages_per_s']:>9.0f}")
    print("(reader verified every batch: page count and SHA-256 of three pages)")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
