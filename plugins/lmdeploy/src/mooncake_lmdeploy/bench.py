"""``mooncake-core bench lmdeploy``: KV blocks migrated between two processes by our backend.

Two engine ranks, each a process of its own (``python -m mooncake_lmdeploy.testing``):
LMDeploy's real ``CacheEngine`` with its block pools on the CPU, linked as LMDeploy's proxy
links a prefill and a decode engine (``p2p_initialize`` then ``p2p_connect`` on both).
The decode rank runs ``await CacheEngine.migrate(MigrationExecutionBatch)``: LMDeploy
builds the byte assignments (``build_cache_pool_assignments``: one segment per layer and
block) and calls ``p2p_migrate`` of the backend registered as ``Mooncake`` (ours, via
``mooncake_lmdeploy.pth``). Blocks are a random sample on both sides, as a running engine's
block tables are. Before timing, the decode blocks are checked against the prefill blocks
(SHA-256 per block).

Reference, same run, same processes: the same number of bytes read over one plain Python
TCP connection from the prefill pool into the decode pool (:mod:`mooncake_core.bench.rawtcp`).
Rounds alternate ours / raw; figures are medians.

Transports: ``tcp`` (our engine with shared memory off: what crosses hosts without RDMA;
``migrate_gbps`` and ``migrate_ratio_vs_raw_tcp`` come from it) and ``auto`` (what the
engine picks between two processes on one host: shared memory by cross-memory attach;
``migrate_shm_gbps``). ``--json`` prints one JSON object as the last line.

Geometry (default): a Llama-3-8B-like KV cache, 32 layers x 8 KV heads x 128 dims,
bfloat16, 64-token blocks (8 MiB a block, 256 KiB a layer), 16 blocks a migration.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
from typing import Any

from mooncake_lmdeploy.testing import RankProcess, link_pair

__all__ = ["main", "run"]

logger = logging.getLogger(__name__)

P_ID, D_ID = "http://127.0.0.1:23333", "http://127.0.0.1:23334"


def _pair(
    transport: str, geometry: dict[str, Any], pool_blocks: int
) -> tuple[RankProcess, RankProcess]:
    env = {"MOONCAKE_TRANSFER_SHM": "0" if transport == "tcp" else "1"}
    p = RankProcess("prefill", env)
    try:
        d = RankProcess("decode", env)
    except BaseException:
        p.close()
        raise
    try:
        for r in (p, d):
            out = r.call("setup", blocks=pool_blocks, **geometry)
            if not out["backend"].startswith("mooncake_lmdeploy."):
                raise RuntimeError(
                    f"LMDeploy's Mooncake backend is {out['backend']}, not ours "
                    "(is mooncake-lmdeploy installed? MOONCAKE_LMDEPLOY_AUTOLOAD=0?)"
                )
        link_pair(
            p, d, blocks_p=pool_blocks, blocks_d=pool_blocks, block_size=geometry["block_size"]
        )
    except BaseException:
        p.close()
        d.close()
        raise
    return p, d


def run(
    *,
    transports: list[str],
    blocks: int = 16,
    rounds: int = 5,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark; the result dict (see the module doc)."""
    from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol

    geometry = {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": "bfloat16",
    }
    pool_blocks = blocks * 2
    block_bytes = layers * block_size * kv_heads * head_dim * 2 * 2
    total = blocks * block_bytes
    rng = random.Random(seed)
    result: dict[str, Any] = {
        "blocks": blocks,
        "block_bytes": block_bytes,
        "migrate_bytes": total,
        "layers": layers,
        "rounds": rounds,
        "segments_per_migration": layers * blocks,
    }
    for transport in transports:
        p, d = _pair(transport, geometry, pool_blocks)
        try:
            p.call("fill", blocks=list(range(pool_blocks)), seed=seed + 1)
            port = p.call("raw_serve")["port"]
            ours: list[float] = []
            raw: list[float] = []
            verified = False
            for i in range(rounds + 1):  # round 0 warms up (connections, page faults)
                src = rng.sample(range(pool_blocks), blocks)
                dst = rng.sample(range(pool_blocks), blocks)
                batch = {
                    "protocol": MigrationProtocol.RDMA.value,
                    "requests": [[P_ID, [[s, t] for s, t in zip(src, dst, strict=True)]]],
                }
                order = ("ours", "raw") if i % 2 == 0 else ("raw", "ours")
                for which in order:
                    if which == "ours":
                        if not verified:
                            d.call("zero")
                        sec = d.call("migrate", batch=batch)["seconds"]
                        if not verified:
                            want = p.call("digest", blocks=src)["sha"]
                            got = d.call("digest", blocks=dst)["sha"]
                            if want != got:
                                raise RuntimeError(
                                    f"{transport}: migrated blocks differ from the prefill blocks"
                                )
                            verified = True
                        if i:
                            ours.append(sec)
                    else:
                        sec = d.call("raw_read", port=port, nbytes=total)["seconds"]
                        if i:
                            raw.append(sec)
                logger.info("%s round %d done", transport, i)
            stats = d.call("stats")["stats"]
        finally:
            p.close()
            d.close()
        gbps = total / statistics.median(ours) / 1e9
        raw_gbps = total / statistics.median(raw) / 1e9
        key = (
            "migrate"
            if transport == "tcp"
            else f"migrate_{'shm' if transport == 'auto' else transport}"
        )
        result[f"{key}_gbps"] = round(gbps, 3)
        result[f"{key}_ratio_vs_raw_tcp"] = round(gbps / raw_gbps, 3)
        result[f"{key}_ms"] = round(statistics.median(ours) * 1e3, 2)
        result[f"{key}_requests_per_migration"] = stats.get("requests", 0) // max(
            1, stats.get("migrations", 1)
        )
        result[f"{key}_bytes_verified"] = verified
        result.setdefault("raw_tcp_gbps_runs", {})[transport] = round(raw_gbps, 3)
    runs = result.pop("raw_tcp_gbps_runs")
    result["raw_tcp_gbps"] = runs.get("tcp", next(iter(runs.values())))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench lmdeploy",
        description="KV blocks migrated between two LMDeploy cache engines (CPU pools) "
        "through mooncake-lmdeploy's migration backend, against raw TCP sockets",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--transport",
        choices=["tcp", "auto", "both"],
        default="both",
        help="tcp: shared memory off (the ratio target); auto: the engine's choice (shared "
        "memory between processes of one host); both (default)",
    )
    ap.add_argument("--blocks", type=int, default=16, help="blocks per migration (8 MiB each)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    if args.blocks <= 0 or args.rounds <= 0 or args.layers <= 0:
        print("bench lmdeploy: --blocks, --rounds and --layers must be positive", file=sys.stderr)
        return 2
    try:
        import lmdeploy.pytorch.disagg.backend  # noqa: F401
    except ImportError as exc:
        print(
            f"bench lmdeploy: LMDeploy is not installed ({exc}); run scripts/setup.sh",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    transports = ["tcp", "auto"] if args.transport == "both" else [args.transport]
    r = run(transports=transports, blocks=args.blocks, rounds=args.rounds, layers=args.layers)
    mib = r["block_bytes"] / (1 << 20)
    print(
        f"LMDeploy KV migration: {r['blocks']} blocks x {mib:.1f} MiB ({r['layers']} layers, "
        f"{r['segments_per_migration']} LMDeploy segments), median of {r['rounds']} rounds"
    )
    print(f"{'path':<34}{'GB/s':>8}{'ms':>9}{'vs raw TCP':>12}")
    for key, label in (("migrate", "ours, tcp"), ("migrate_shm", "ours, auto (shared memory)")):
        if f"{key}_gbps" in r:
            print(
                f"{label:<34}{r[key + '_gbps']:>8.2f}{r[key + '_ms']:>9.1f}"
                f"{r[key + '_ratio_vs_raw_tcp']:>11.2f}x"
            )
    print(f"{'raw Python TCP socket, same bytes':<34}{r['raw_tcp_gbps']:>8.2f}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
