"""Store benchmark for the PUBLISHED Mooncake store (run by its own Python).

Executed by ``run_mooncake_store_bench`` (``mooncake_peer.py`` next to this file) with the
interpreter of a venv holding ``mooncake-transfer-engine-non-cuda``; a
``mooncake_master`` with its embedded HTTP metadata server must already listen. It
imports nothing from ``mooncake_core``.

    python _mooncake_store.py holder MASTER METADATA_URL SEGMENT_BYTES
        # prints "ready"; serves until stdin closes
    python _mooncake_store.py reader MASTER METADATA_URL [--quick]
        # last stdout line: results JSON

The holder contributes the memory; the reader contributes none, so every put and get
crosses processes (protocol tcp, ``MC_TCP_BIND_ADDRESS=127.0.0.1``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
BUF = 96 << 20
META_KEYS = 10_000
WARM_OBJECTS = 7  # x 64 MiB: most of the 512 MiB segment the holder mounts


def _label(n: int) -> str:
    return f"{n >> 20}m" if n >= 1 << 20 else f"{n >> 10}k"


def _store(master: str, metadata: str, segment: int, local_buffer: int) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", metadata, segment, local_buffer, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"MooncakeDistributedStore.setup returned {rc}")
    return s


def holder(master: str, metadata: str, segment: int) -> None:
    s = _store(master, metadata, segment, 16 << 20)
    print("ready", flush=True)
    sys.stdin.read()
    s.close()


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise SystemExit(f"{what} returned {rc}")


def reader(master: str, metadata: str, quick: bool) -> dict[str, Any]:
    s = _store(master, metadata, 0, 16 << 20)
    buf = np.random.default_rng(0).integers(0, 255, BUF, dtype=np.uint8)
    dst = np.ones(BUF, dtype=np.uint8)  # pages touched before timing
    src_ptr, dst_ptr = int(buf.ctypes.data), int(dst.ctypes.data)
    _check(s.register_buffer(src_ptr, BUF), "register_buffer(src)")
    _check(s.register_buffer(dst_ptr, BUF), "register_buffer(dst)")
    # First touch of the holder's segment is slow: fill it once before timing.
    warm = [f"warm-{i}" for i in range(WARM_OBJECTS)]
    for k in warm:
        _check(s.put_from(k, src_ptr, 64 << 20), "put_from warm-up")
    _check(s.remove_all(force=True), "remove_all")
    budget = (48 << 20) if quick else (192 << 20)
    rounds = 2 if quick else 3
    res: dict[str, list[float]] = {}
    seq = 0
    for _ in range(rounds):
        for n in SIZES:
            iters = max(3, budget // n)
            keys = [f"b{seq}-{n}-{i}" for i in range(iters)]
            seq += 1
            t = time.perf_counter()
            for k in keys:
                _check(s.put_from(k, src_ptr, n), f"put_from {n}")
            put = time.perf_counter() - t
            t = time.perf_counter()
            for k in keys:
                _check(s.get_into(k, dst_ptr, n), f"get_into {n}")
            get = time.perf_counter() - t
            if not np.array_equal(buf[:n], dst[:n]):
                raise SystemExit(f"get_into {n}: bytes differ")
            res.setdefault(f"put_gbps_{_label(n)}", []).append(iters * n / put / 1e9)
            res.setdefault(f"get_gbps_{_label(n)}", []).append(iters * n / get / 1e9)
            _check(s.remove_all(force=True), "remove_all")
        mb = 1 << 20
        ptrs_src = [src_ptr + i * mb for i in range(32)]
        ptrs_dst = [dst_ptr + i * mb for i in range(32)]
        iters = max(2, budget // (32 * mb))
        put = get = 0.0
        for j in range(iters):
            keys = [f"batch{seq}-{j}-{i}" for i in range(32)]
            t = time.perf_counter()
            rcs = s.batch_put_from(keys, ptrs_src, [mb] * 32)
            put += time.perf_counter() - t
            _check(min(rcs), "batch_put_from")
            t = time.perf_counter()
            rcs = s.batch_get_into(keys, ptrs_dst, [mb] * 32)
            get += time.perf_counter() - t
            _check(min(rcs), "batch_get_into")
        seq += 1
        if not np.array_equal(buf[: 32 * mb], dst[: 32 * mb]):
            raise SystemExit("batch_get_into: bytes differ")
        res.setdefault("batch_put_gbps_32x1m", []).append(iters * 32 * mb / put / 1e9)
        res.setdefault("batch_get_gbps_32x1m", []).append(iters * 32 * mb / get / 1e9)
        _check(s.remove_all(force=True), "remove_all")
    out: dict[str, Any] = {k: round(float(np.median(v)), 3) for k, v in res.items()}
    # 64 KiB get latency
    _check(s.put_from("lat64k", src_ptr, 64 << 10), "put_from lat64k")
    xs = []
    for _ in range(300 if quick else 2000):
        t = time.perf_counter()
        _check(s.get_into("lat64k", dst_ptr, 64 << 10), "get_into lat64k")
        xs.append(time.perf_counter() - t)
    us = np.array(xs) * 1e6
    out["get64k_p50_us"] = round(float(np.percentile(us, 50)), 1)
    out["get64k_p99_us"] = round(float(np.percentile(us, 99)), 1)
    # metadata ops: is_exist over 10k keys
    keys = [f"meta-{i}" for i in range(META_KEYS)]
    for i in range(0, META_KEYS, 500):
        chunk = keys[i : i + 500]
        _check(
            min(
                s.batch_put_from(
                    chunk, [src_ptr + 64 * j for j in range(len(chunk))], [64] * len(chunk)
                )
            ),
            "batch_put_from meta",
        )
    t = time.perf_counter()
    hits = sum(1 for k in keys if s.is_exist(k) == 1)
    dt = time.perf_counter() - t
    if hits != META_KEYS:
        raise SystemExit(f"is_exist found {hits} of {META_KEYS} keys")
    out["meta_ops_per_s"] = round(META_KEYS / dt)
    s.remove_all(force=True)
    out["rounds"] = rounds
    s.unregister_buffer(src_ptr)
    s.unregister_buffer(dst_ptr)
    s.close()
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["holder"] and len(argv) >= 4:
        holder(argv[1], argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["reader"] and len(argv) >= 3:
        print(json.dumps(reader(argv[1], argv[2], "--quick" in argv)), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
