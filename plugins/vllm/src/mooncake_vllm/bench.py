"""``mooncake-core bench vllm [--json]``: TTFT with a KV-pool hit vs recompute, PD vs monolithic.

A random local Llama of about 100M parameters (prefill of a few thousand tokens is slow
on this CPU) runs in real vLLM servers on loopback, in two phases so they do not share
the two cores:

1. store: a master, instances A and B with ``MooncakeCoreStoreConnector`` and a plain
   vLLM P (no connector) on B's core. Per repeat: A serves ``prefix + suffix1``; P serves
   the same (cold, plain) and then ``prefix + suffix2`` (vLLM's own prefix-cache hit: the
   physical limit); B serves ``prefix + suffix2`` (pool hit on the shared prefix, only the
   suffix computed), ``prefix + suffix2`` again (its own prefix cache now: the same pages
   cached, the same tail computed, the same first token) and
   ``other_prefix + suffix`` (miss: recompute, with the connector looking up and saving).
   B's hit in the first repeat is its first request with a long prompt at all, reported
   apart as ``ttft_store_first_hit_ms``.
2. PD: prefill and decode instances with ``MooncakeCoreConnector`` plus the proxy; TTFT
   through the proxy vs the decode instance computing alone (monolithic), and output
   throughput of concurrent requests both ways; KV bytes moved and GB/s.

JSON keys: ``ttft_recompute_ms``, ``ttft_store_hit_ms`` (repeats after the first),
``ttft_store_first_hit_ms``, ``ttft_local_prefix_hit_ms`` (the same repeats as
``ttft_store_hit_ms``), ``ttft_store_hit_vs_local_ratio``,
``store_first_hit_connector_ms`` and ``store_hit_connector_ms`` (of a hit's TTFT, the time
B's connector spent: the lookup plus the forward's waits for loads),
``store_hit_load_thread_ms`` (the load threads' time per hit, summed over threads; it overlaps
the forward), ``ttft_store_instance_local_hit_ms`` (B asked the hit's prompt again: vLLM's
own prefix cache with the connector present; against ``ttft_local_prefix_hit_ms`` it shows
what the connector costs a step that loads nothing),
``ttft_plain_cold_ms``, ``ttft_cold_overhead_pct`` (B's recompute against P's cold prefill of
a prompt of the same length, same core), ``ttft_speedup_store_hit``,
``pd_ttft_ms``, ``mono_ttft_ms``, ``pd_tok_s``, ``mono_tok_s``, ``kv_bytes``, ``kv_gbps``,
``store_hit_pages``, plus the model shape. Not a test: numbers depend on the machine.

With ``--compare-lmcache PYTHON`` (a venv from ``scripts/setup_lmcache_peer.sh``) the store
phase also runs LMCache's server and two vLLM instances LA/LB with ``LMCacheMPConnector``
(LA on A's core, LB on B's), interleaved with ours in every repeat: LA computes the prompt A
computed, LB serves B's prompt. Keys: ``ttft_lmcache_hit_ms``, ``ttft_lmcache_first_hit_ms``,
``ttft_store_hit_vs_lmcache_ratio`` (ours / LMCache's, target <= 0.8),
``ttft_local_hit_vs_lmcache_ratio`` (vLLM's own local prefix hit, P, / LMCache's: the floor,
since a store hit computes what a local hit computes and loads the prefix besides), and for
every hit figure the prompt tokens vLLM reported as cached (``*_cached_tokens``: a recompute
shows 0).
If LMCache cannot run, ``lmcache`` holds the one-line reason and the rest still runs.

3. mixed (``--phase mixed`` runs it alone): decodes streaming while long prompts keep
   arriving at a fixed rate, PD (prefill and decode each pinned to one core with
   ``taskset``) against one monolithic instance on the same two cores; see
   :mod:`mooncake_vllm.bench_mixed` for its keys and SLO.

Every process the bench starts is stopped on every exit path, SIGINT/SIGTERM and SIGKILL
included (:mod:`mooncake_vllm.bench_reap`).
Registered as ``bench.vllm`` in the entry-point group ``mooncake_core.cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mooncake-core bench vllm", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--workdir", default=None, help="model, logs and counters (default: a temp dir)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument(
        "--prefix-tokens", type=int, default=3072, help="shared prefix length (default 3072)"
    )
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="measurements per figure (median)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="concurrent requests for throughput")
    p.add_argument(
        "--no-warm-up",
        action="store_true",
        help="store connectors set up on first use, not at start (the old behaviour)",
    )
    p.add_argument(
        "--store-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an extra kv_connector_extra_config option for the store phase's A and B "
        "(VALUE as JSON, else a string; e.g. load_batches=1, io_cpus=any); repeatable",
    )
    p.add_argument(
        "--store-unpinned",
        action="store_true",
        help="store phase: every instance may use every core (before 2026-12-02 the store "
        "phase's pins were not in effect: an in-process vLLM engine ignores "
        "VLLM_CPU_OMP_THREADS_BIND)",
    )
    p.add_argument("--skip-pd", action="store_true", help="leave out the PD phase")
    p.add_argument("--skip-store", action="store_true", help="leave out the store phase")
    p.add_argument(
        "--phase",
        default="store,pd,mixed",
        help="comma-separated phases to run: store, pd, mixed (default all three)",
    )
    p.add_argument(
        "--compare-lmcache",
        metavar="PYTHON",
        default=None,
        help="also run LMCache (this interpreter, scripts/setup_lmcache_peer.sh) in the "
        "store phase",
    )
    p.add_argument(
        "--cores",
        default="0,1",
        help="CPU for the first,second instance of each phase (default 0,1)",
    )
    p.add_argument("--start-timeout", type=float, default=900.0)
    from mooncake_vllm.bench_mixed import add_arguments

    add_arguments(p)
    return p


# B's counters read around each hit (load_seconds: the load threads' time, summed)
_HIT_PARTS = ("lookup_seconds", "load_wait_seconds", "load_seconds")


def _store_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (VALUE as JSON, else a plain string) for the store connector."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"bench vllm: --store-option wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 131) % 400 + 3 for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    from mooncake_vllm.bench_reap import ChildReaper

    args = _parser().parse_args(argv)
    phases = {x.strip() for x in args.phase.split(",") if x.strip()}
    bad = phases - {"store", "pd", "mixed"}
    if bad:
        print(f"bench vllm: unknown --phase {','.join(sorted(bad))} (store, pd, mixed)")
        return 2
    if args.skip_store:
        phases.discard("store")
    if args.skip_pd:
        phases.discard("pd")
    reaper = ChildReaper().install()
    try:
        return _run(args, phases, reaper)
    finally:
        reaper.reap()


def _run(args: argparse.Namespace, phases: set[str], reaper: Any) -> int:
    from mooncake_vllm.testing import build_tiny_llama

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mooncake-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    L = args.prefix_tokens + args.suffix_tokens
    max_len = L + args.max_tokens + 64
    model = build_tiny_llama(
        work / f"llama-{args.layers}x{args.hidden}",
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_positions=max(4096, max_len),
    )
    kv_per_token = args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 4
    kv_bytes = f"{max(256, (kv_per_token * max_len * (args.concurrency + 2)) >> 20)}M"
    common: dict[str, Any] = dict(
        block_size=args.block_size, kv_cache_bytes=kv_bytes, max_model_len=max_len
    )
    body = {"model": "tiny", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    out: dict[str, Any] = {
        "model_layers": args.layers,
        "model_hidden": args.hidden,
        "prompt_tokens": L,
        "prefix_tokens": args.prefix_tokens,
        "block_size": args.block_size,
    }

    def log(msg: str) -> None:
        print(f"[bench vllm] {msg}", flush=True)

    def med(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    cores = args.cores.split(",")
    pin = [{"VLLM_CPU_OMP_THREADS_BIND": c.strip()} for c in (cores + cores)[:2]]

    load0 = round(os.getloadavg()[0], 1)
    log(f"work dir {work}; phases {','.join(p for p in ('store', 'pd', 'mixed') if p in phases)}")
    if "store" in phases:
        _store_phase(args, model, common, body, out, pin, work, log, med, reaper)
    if "pd" in phases:
        _pd_phase(args, model, common, body, out, pin, work, log, med, L, reaper)
    if "mixed" in phases:
        from mooncake_vllm.bench_mixed import mixed_phase

        mixed_phase(args, model, common, out, cores, work, log, reaper)
    out["load_avg_1m_start"] = load0
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 1)
    print(f"\n{'figure':<36}{'value':>14}")
    for k, v in out.items():
        print(f"{k:<36}{v!s:>14}")
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


def _busy_cores(window_s: float = 1.0) -> float:
    """CPUs kept busy (all processes) over ``window_s``, from ``/proc/stat``."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v) - idle, sum(v)

    b0, t0 = sample()
    time.sleep(window_s)
    b1, t1 = sample()
    ncpu = os.cpu_count() or 1
    return ncpu * (b1 - b0) / max(1, t1 - t0)


def _wait_quiet(log: Any, busy_max: float = 0.3, timeout_s: float = 60.0) -> None:
    """Until the machine is idle (under ``busy_max`` CPUs busy over a second), at most
    ``timeout_s``: instances that just answered ready may still be settling (LMCache's
    took seconds), and the first repeat's hit would otherwise run beside them."""
    t0 = time.monotonic()
    busy = _busy_cores()
    while busy > busy_max and time.monotonic() - t0 < timeout_s:
        busy = _busy_cores()
    log(f"machine quiet after {time.monotonic() - t0:.0f} s ({busy:.2f} CPUs busy)")


def _store_phase(
    args: argparse.Namespace,
    model: Path,
    common: dict[str, Any],
    body: dict[str, Any],
    out: dict[str, Any],
    pin: list[dict[str, str]],
    work: Path,
    log: Any,
    med: Any,
    reaper: Any,
) -> None:
    from mooncake_vllm.bench_http import stream
    from mooncake_vllm.bench_mixed import omp_env, pin_group
    from mooncake_vllm.testing import (
        VLLMServer,
        engine_env,
        free_port,
        http_json,
        read_counters,
        store_transfer_config,
        stream_ttft,
    )

    L = args.prefix_tokens + args.suffix_tokens
    head_dim = args.hidden // args.heads
    kv_per_token = args.layers * 2 * args.kv_heads * head_dim * 4
    port = free_port()
    master_log = open(work / "master.log", "wb")  # noqa: SIM115
    master = reaper.popen(
        [
            sys.executable,
            "-m",
            "mooncake_core",
            "master",
            "--rpc-port",
            str(port),
            "--http-port",
            str(free_port()),
        ],
        stdout=master_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=engine_env(),
    )
    master_log.close()
    seg = f"{max(512, (kv_per_token * L * (args.repeats + 2) * 2) >> 20)}MiB"
    details = ["--enable-prompt-tokens-details"]  # usage.cached_tokens: a hit, or not
    # each instance on one core for real (VLLM_CPU_OMP_THREADS_BIND alone does not pin an
    # in-process engine: see bench_mixed.omp_env); --store-unpinned: every instance on all
    cores = [c["VLLM_CPU_OMP_THREADS_BIND"] for c in pin]
    env = [dict(p) if args.store_unpinned else omp_env(c) for p, c in zip(pin, cores, strict=True)]
    out["store_phase_pinned"] = not args.store_unpinned
    servers = [
        VLLMServer(
            model,
            name=n,
            log_path=work / f"{n}.log",
            env=env[i],
            kv_transfer_config=store_transfer_config(
                f"127.0.0.1:{port}",
                segment_size=seg,
                stats_dir=str(work / "stats" / n),
                warm_up=not args.no_warm_up,
                **_store_options(args.store_option),
            ),
            args=details,
            **common,
        )
        for i, n in enumerate(("A", "B"))
    ]
    # plain vLLM (no connector) on B's core: cold prefill and its own prefix-cache hit
    servers.append(
        VLLMServer(model, name="P", log_path=work / "P.log", env=env[1], args=details, **common)
    )
    peer = _lmcache_peer(args, work, reaper, log, out)
    if peer is not None:  # LA on A's core computes, LB on B's core hits
        servers += [
            peer.vllm_server(model, n, env[i], args=details, **common)
            for i, n in enumerate(("LA", "LB"))
        ]
    for s in servers:
        reaper.server(s)
    url = "/v1/completions"
    try:
        t0 = time.monotonic()
        if peer is not None:
            peer.start()
        for s in servers[:3]:  # ours start while LMCache's server imports
            s.start()
        if peer is not None:
            peer.wait_ready(args.start_timeout)  # its connector needs the server at start
            for s in servers[3:]:
                s.start()
        reaper.sync()
        for s in servers:
            s.wait_ready(args.start_timeout)
        reaper.sync()
        if not args.store_unpinned:  # A and LA on the first core, B, P and LB on the second
            homes = [cores[0], cores[1], cores[1], cores[0], cores[1]][: len(servers)]
            for s, core in zip(servers, homes, strict=True):
                pin_group(s, core)
        log(
            f"store phase: master + {len(servers)} vLLM instances"
            f"{' + lmcache server' if peer else ''} ready in {time.monotonic() - t0:.0f} s"
        )
        a, b, plain = servers[:3]
        for i, s in enumerate(servers):  # a short request each (not a hit: one page at most)
            http_json(s.url + url, {**body, "prompt": _prompt(64, 999 - i)})
        _wait_quiet(log)
        hit_t: list[float] = []
        parts: list[dict[str, float]] = []  # B's connector time per hit (ms)
        bstats = work / "stats" / "B"
        miss_t: list[float] = []
        cold_t: list[float] = []
        local_t: list[float] = []
        own_t: list[float] = []  # B asked again: its own prefix cache, the connector present
        cached: dict[str, list[int]] = {"store": [], "local": [], "lmcache": []}
        lmc_t: list[float] = []
        for r in range(args.repeats):
            prefix = _prompt(args.prefix_tokens, 10 + r)
            saved = read_counters(work / "stats" / "A", "store-worker-").get("save_objects", 0)
            ta, _ = stream_ttft(
                a.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 50)}
            )
            want = (L // args.block_size) * args.layers
            deadline = time.monotonic() + 120
            while (
                read_counters(work / "stats" / "A", "store-worker-").get("save_objects", 0)
                < saved + want
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("instance A did not save its pages within 120 s")
                time.sleep(0.2)
            # B first: its first hit must not follow a long prompt of its own
            before = {
                **read_counters(bstats, "store-worker-"),
                **read_counters(bstats, "store-sched-"),
            }
            hit = stream(b.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 60)})
            th = hit.ttft
            cached["store"].append(hit.cached_tokens or 0)
            after = {
                **read_counters(bstats, "store-worker-"),
                **read_counters(bstats, "store-sched-"),
            }
            parts.append({k: (after.get(k, 0) - before.get(k, 0)) * 1e3 for k in _HIT_PARTS})
            # the hit's prompt again: a TTFT is the first chunk with text, and a first token
            # that decodes to no text (another suffix: another token) moves it a step later
            own = stream(b.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 60)})
            own_t.append(own.ttft)
            tc, _ = stream_ttft(
                plain.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 50)}
            )
            local = stream(
                plain.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 60)}
            )
            tl = local.ttft
            cached["local"].append(local.cached_tokens or 0)
            tm, _ = stream_ttft(
                b.url + url,
                {
                    **body,
                    "prompt": _prompt(args.prefix_tokens, 500 + r)
                    + _prompt(args.suffix_tokens, 61),
                },
            )
            lmc = ""
            if peer is not None:  # LMCache: LA computes A's prompt, LB is asked B's
                la, lb = servers[3:5]
                stream(la.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 50)})
                time.sleep(1.0)  # its store is asynchronous; a miss shows as cached_tokens 0
                lh = stream(
                    lb.url + url, {**body, "prompt": prefix + _prompt(args.suffix_tokens, 60)}
                )
                lmc_t.append(lh.ttft)
                cached["lmcache"].append(lh.cached_tokens or 0)
                lmc = f"; LMCache hit {lh.ttft * 1e3:.0f} ms ({lh.cached_tokens} cached)"
            hit_t.append(th)
            miss_t.append(tm)
            cold_t.append(tc)
            local_t.append(tl)
            log(
                f"repeat {r}: A computes {ta * 1e3:.0f} ms; B store hit {th * 1e3:.0f} ms "
                f"(lookup {parts[-1]['lookup_seconds']:.0f} ms, forward waited for loads "
                f"{parts[-1]['load_wait_seconds']:.0f} ms); "
                f"P cold {tc * 1e3:.0f} ms, local hit {tl * 1e3:.0f} ms; "
                f"B's own local hit {own.ttft * 1e3:.0f} ms; "
                f"B recompute {tm * 1e3:.0f} ms; cached tokens: store hit {hit.cached_tokens}, "
                f"local hit {local.cached_tokens}{lmc}"
            )
        sched = read_counters(work / "stats" / "B", "store-sched-")
        later = hit_t[1:] or hit_t
        out.update(
            ttft_recompute_ms=round(med(miss_t), 1),
            ttft_plain_cold_ms=round(med(cold_t), 1),
            ttft_store_first_hit_ms=round(hit_t[0] * 1e3, 1),
            ttft_store_hit_ms=round(med(later), 1),
            # the same repeats as ttft_store_hit_ms (the first is B's first hit, apart)
            ttft_local_prefix_hit_ms=round(med(local_t[1:] or local_t), 1),
            ttft_store_instance_local_hit_ms=round(med(own_t[1:] or own_t), 1),
            store_hit_pages=sched.get("hit_pages", 0),
        )
        out["ttft_cold_overhead_pct"] = round(
            100.0 * (out["ttft_recompute_ms"] / max(out["ttft_plain_cold_ms"], 1e-3) - 1.0), 1
        )
        out["ttft_store_hit_vs_local_ratio"] = round(
            out["ttft_store_hit_ms"] / max(out["ttft_local_prefix_hit_ms"], 1e-3), 2
        )
        out["store_first_hit_connector_ms"] = round(
            parts[0]["lookup_seconds"] + parts[0]["load_wait_seconds"], 1
        )
        out["store_hit_connector_ms"] = round(
            statistics.median(
                p["lookup_seconds"] + p["load_wait_seconds"] for p in parts[1:] or parts
            ),
            1,
        )
        out["store_hit_load_thread_ms"] = round(
            statistics.median(p["load_seconds"] for p in parts[1:] or parts), 1
        )
        out["ttft_store_first_vs_later_ratio"] = round(
            out["ttft_store_first_hit_ms"] / max(out["ttft_store_hit_ms"], 1e-3), 2
        )
        out["ttft_speedup_store_hit"] = round(
            out["ttft_recompute_ms"] / max(out["ttft_store_hit_ms"], 1e-3), 2
        )
        out["store_hit_cached_tokens"] = int(statistics.median(cached["store"]))
        out["local_hit_cached_tokens"] = int(statistics.median(cached["local"]))
        if peer is not None:
            later_l = lmc_t[1:] or lmc_t
            out["ttft_lmcache_first_hit_ms"] = round(lmc_t[0] * 1e3, 1)
            out["ttft_lmcache_hit_ms"] = round(med(later_l), 1)
            out["lmcache_hit_cached_tokens"] = int(statistics.median(cached["lmcache"]))
            out["ttft_store_hit_vs_lmcache_ratio"] = round(
                out["ttft_store_hit_ms"] / max(out["ttft_lmcache_hit_ms"], 1e-3), 2
            )
            out["ttft_local_hit_vs_lmcache_ratio"] = round(
                out["ttft_local_prefix_hit_ms"] / max(out["ttft_lmcache_hit_ms"], 1e-3), 2
            )
    finally:
        for s in servers:
            s.stop()
        master.kill()
        master.wait(10)
        if peer is not None:
            left = peer.stop()
            if left:
                log(f"removed LMCache's shared-memory files: {' '.join(left)}")


def _lmcache_peer(
    args: argparse.Namespace, work: Path, reaper: Any, log: Any, out: dict[str, Any]
) -> Any:
    """The LMCache peer for ``--compare-lmcache``, or None (with the reason in ``out``)."""
    if not args.compare_lmcache:
        return None
    from mooncake_vllm.bench_lmcache import LMCachePeer, check_lmcache

    why = check_lmcache(args.compare_lmcache)
    if why is not None:
        out["lmcache"] = "unavailable"
        log(f"LMCache comparison skipped: {why}")
        return None
    return LMCachePeer(args.compare_lmcache, work, reaper)


def _pd_phase(
    args: argparse.Namespace,
    model: Path,
    common: dict[str, Any],
    body: dict[str, Any],
    out: dict[str, Any],
    pin: list[dict[str, str]],
    work: Path,
    log: Any,
    med: Any,
    L: int,
    reaper: Any,
) -> None:
    from mooncake_core.proxy import ProxyConfig, ProxyServer
    from mooncake_vllm.testing import (
        VLLMServer,
        http_json,
        pd_transfer_config,
        read_counters,
        stream_ttft,
    )

    stats = work / "stats" / "pd"
    pdv = [
        VLLMServer(
            model,
            name="prefill",
            log_path=work / "prefill.log",
            env=pin[0],
            kv_transfer_config=pd_transfer_config("kv_producer", stats_dir=str(stats)),
            **common,
        ),
        VLLMServer(
            model,
            name="decode",
            log_path=work / "decode.log",
            env=pin[1],
            kv_transfer_config=pd_transfer_config("kv_consumer", stats_dir=str(stats)),
            **common,
        ),
    ]
    for s in pdv:
        reaper.server(s)
    stop = None
    try:
        t0 = time.monotonic()
        for s in pdv:
            s.start()
        reaper.sync()
        for s in pdv:
            s.wait_ready(args.start_timeout)
        reaper.sync()
        pre, dec = pdv
        proxy = ProxyServer(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), port=0))
        purl, stop = proxy.run_in_thread()
        log(f"PD phase: prefill + decode + proxy ready in {time.monotonic() - t0:.0f} s")
        http_json(purl + "/v1/completions", {**body, "prompt": _prompt(64, 997)})
        http_json(dec.url + "/v1/completions", {**body, "prompt": _prompt(64, 996)})
        before = read_counters(stats, "pd-kv_consumer-")
        pd_t: list[float] = []
        mono_t: list[float] = []
        for r in range(args.repeats):
            tp, _ = stream_ttft(purl + "/v1/completions", {**body, "prompt": _prompt(L, 700 + r)})
            tm, _ = stream_ttft(
                dec.url + "/v1/completions", {**body, "prompt": _prompt(L, 800 + r)}
            )
            pd_t.append(tp)
            mono_t.append(tm)
            log(f"repeat {r}: PD TTFT {tp * 1e3:.0f} ms; monolithic TTFT {tm * 1e3:.0f} ms")
        after = read_counters(stats, "pd-kv_consumer-")
        moved = after.get("recv_bytes", 0) - before.get("recv_bytes", 0)
        secs = after.get("recv_seconds", 0) - before.get("recv_seconds", 0)
        out.update(
            pd_ttft_ms=round(med(pd_t), 1),
            mono_ttft_ms=round(med(mono_t), 1),
            kv_bytes=int(moved),
            kv_gbps=round(moved / secs / 1e9, 3) if secs > 0 else 0.0,
        )

        def burst(url: str, salt: int) -> float:
            n = args.concurrency
            tok = 4 * args.max_tokens
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                list(
                    ex.map(
                        lambda i: http_json(
                            url + "/v1/completions",
                            {**body, "max_tokens": tok, "prompt": _prompt(L // 4, salt + i)},
                        ),
                        range(n),
                    )
                )
            return float(n * tok / (time.perf_counter() - t))

        p0 = proxy.stats["prefill_s"]
        t_burst = time.perf_counter()
        out["pd_tok_s"] = round(burst(purl, 900), 1)
        log(
            f"PD burst: {time.perf_counter() - t_burst:.1f} s wall, of which prefill answers "
            f"{(proxy.stats['prefill_s'] - p0) / args.concurrency:.1f} s per request on average"
        )
        t_burst = time.perf_counter()
        out["mono_tok_s"] = round(burst(dec.url, 950), 1)
        log(f"monolithic burst: {time.perf_counter() - t_burst:.1f} s wall")
    finally:
        if stop is not None:
            stop.set()
        for s in pdv:
            s.stop()
