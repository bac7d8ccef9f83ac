"""The mixed-load phase of ``mooncake-core bench vllm`` (``--phase mixed`` runs it alone).

What PD is for: long prefills stop disturbing decodes. Under a steady load:

- ``--mixed-streams`` decode streams, each a loop of short prompts
  (``--mixed-short-tokens``) generating ``--mixed-decode-tokens`` tokens, streamed;
- long prompts (``--mixed-long-tokens``, 8 output tokens each) arriving every
  ``--mixed-interval`` seconds, whatever is in flight;

served by PD (a prefill vLLM pinned to the first core and a decode vLLM pinned to the second,
each with one OpenMP thread (``OMP_NUM_THREADS``, see :func:`omp_env`), every thread of its
processes moved there with ``taskset`` once it is ready, ``MooncakeCoreConnector`` between them, the
proxy in the bench process) and by one monolithic vLLM with both cores (``taskset`` onto both,
two OpenMP threads, vLLM's default scheduler: chunked prefill mixes a long prompt's chunk
into the decodes' step). Both run the same load in alternating windows (PD, mono, PD, mono),
so drift on a shared machine hits both alike. All prompts are distinct (no prefix hits).

Keys:
- ``tbt_p99_ms_pd`` / ``tbt_p99_ms_mono``: p99 of the decode streams' time between tokens;
  ``tbt_pd_vs_mono_ratio`` (target <= 0.5) and ``tbt_p50_ms_*``;
- ``ttft_p99_ms_pd`` / ``ttft_p99_ms_mono``: p99 TTFT of the long prompts (p50 too), and
  ``short_ttft_p99_ms_*`` of the decode streams' own prompts;
- ``goodput_rps_pd`` / ``goodput_rps_mono``: requests per second that met the SLO, which is:
  TTFT <= ``--slo-ttft-ms`` (default 10000) and no gap between two tokens of the request
  over ``--slo-tbt-ms`` (default 500); ``slo_met_pct_*`` is the share of requests that met it;
- ``decode_tok_s_*``: tokens per second the decode streams got; ``long_done_*``: long prompts
  served; ``load_avg_1m_mixed``: the machine's load while the phase ran.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mooncake_vllm.bench_http import Stream, percentile, stream

__all__ = ["add_arguments", "mixed_phase", "omp_env", "summarize"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed phase (PD against monolithic under a steady load)")
    g.add_argument("--mixed-seconds", type=float, default=80.0, help="load time per mode")
    g.add_argument("--mixed-windows", type=int, default=2, help="alternating windows per mode")
    g.add_argument("--mixed-streams", type=int, default=3, help="concurrent decode streams")
    g.add_argument("--mixed-short-tokens", type=int, default=128)
    g.add_argument("--mixed-decode-tokens", type=int, default=64)
    g.add_argument("--mixed-long-tokens", type=int, default=2048)
    g.add_argument("--mixed-interval", type=float, default=8.0, help="seconds between long prompts")
    g.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    g.add_argument("--slo-tbt-ms", type=float, default=500.0)


def omp_env(cpus: str) -> dict[str, str]:
    """Environment that gives a vLLM server one OpenMP thread per CPU of ``cpus``.

    ``VLLM_CPU_OMP_THREADS_BIND`` alone does not: vLLM 0.32 reads it only in its
    multi-process executor, and our servers run the engine in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where OpenMP starts one thread per CPU of the
    machine. Squeezed onto one core by ``taskset -a``, two OpenMP threads wait for each
    other at every parallel region: the PD decode instance made about one token a second
    (2026-12-01) while its forward took milliseconds.
    """
    n = len([c for c in cpus.split(",") if c.strip()])
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus, "OMP_NUM_THREADS": str(max(1, n))}


def pin_group(s: Any, cpus: str) -> None:
    """Every thread of every process of a ``VLLMServer``'s group onto ``cpus`` (once it is
    ready: a pinned start-up takes minutes on loaded cores)."""
    assert s.proc is not None
    for pid in _group_pids(s.proc.pid):
        subprocess.run(
            ["taskset", "-a", "-cp", cpus, str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )


def _group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 403) for _ in range(n)]


def _load(
    url: str, args: argparse.Namespace, seconds: float, rng: random.Random
) -> tuple[list[Stream], list[Stream]]:
    """Run the mixed load against ``url`` for ``seconds``; returns (decode requests, long ones)."""
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    shorts: list[Stream] = []
    longs: list[Stream] = []
    errors: list[BaseException] = []

    def prompt(n: int) -> list[int]:
        with lock:
            return _tokens(n, rng)

    def decoder() -> None:
        while time.monotonic() < stop_at:
            body = {
                "model": "tiny",
                "prompt": prompt(args.mixed_short_tokens),
                "max_tokens": args.mixed_decode_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            try:
                s = stream(url + "/v1/completions", body)
            except Exception as exc:  # noqa: BLE001 - reported after the window
                errors.append(exc)
                return
            with lock:
                shorts.append(s)

    def long_one() -> None:
        body = {
            "model": "tiny",
            "prompt": prompt(args.mixed_long_tokens),
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            s = stream(url + "/v1/completions", body)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            return
        with lock:
            longs.append(s)

    n_long = max(1, int(seconds // args.mixed_interval))
    with ThreadPoolExecutor(args.mixed_streams + n_long) as ex:
        t0 = time.monotonic()
        futs = [ex.submit(decoder) for _ in range(args.mixed_streams)]
        for k in range(n_long):
            time.sleep(
                max(0.0, t0 + k * args.mixed_interval + args.mixed_interval / 2 - time.monotonic())
            )
            futs.append(ex.submit(long_one))
        for f in futs:
            f.result()
    if errors:
        raise RuntimeError(f"mixed load on {url}: {len(errors)} request(s) failed: {errors[0]}")
    return shorts, longs


def summarize(
    shorts: list[Stream], longs: list[Stream], seconds: float, slo_ttft_ms: float, slo_tbt_ms: float
) -> dict[str, float]:
    """Figures of one mode's requests (see the module doc); ``seconds`` is its load time."""
    gaps = [g * 1e3 for s in shorts for g in s.gaps]
    ttft_long = [s.ttft * 1e3 for s in longs]
    ttft_short = [s.ttft * 1e3 for s in shorts]

    def good(s: Stream) -> bool:
        return s.ttft * 1e3 <= slo_ttft_ms and max(s.gaps, default=0.0) * 1e3 <= slo_tbt_ms

    everyone = shorts + longs
    n_good = sum(good(s) for s in everyone)
    return {
        "tbt_p99_ms": round(percentile(gaps, 99), 1),
        "tbt_p50_ms": round(percentile(gaps, 50), 1),
        "ttft_p99_ms": round(percentile(ttft_long, 99), 1),
        "ttft_p50_ms": round(percentile(ttft_long, 50), 1),
        "short_ttft_p99_ms": round(percentile(ttft_short, 99), 1),
        "goodput_rps": round(n_good / seconds, 3) if seconds > 0 else 0.0,
        "slo_met_pct": round(100.0 * n_good / len(everyone), 1) if everyone else 0.0,
        "decode_tok_s": round(sum(len(s.arrivals) for s in shorts) / seconds, 1),
        "long_done": len(longs),
        "tbt_samples": len(gaps),
    }


def mixed_phase(
    args: argparse.Namespace,
    model: Path,
    common: dict[str, Any],
    out: dict[str, Any],
    cores: list[str],
    work: Path,
    log: Any,
    reaper: Any,
) -> None:
    from mooncake_core.proxy import ProxyConfig, ProxyServer
    from mooncake_vllm.testing import VLLMServer, http_json, pd_transfer_config

    c0, c1 = (cores + cores)[:2]
    c0, c1 = c0.strip(), c1.strip()
    stats = str(work / "stats" / "mixed")

    def pinned(name: str, cpus: str, kv: dict[str, Any] | None) -> VLLMServer:
        s = VLLMServer(
            model,
            name=name,
            log_path=work / f"{name}.log",
            env=omp_env(cpus),
            kv_transfer_config=kv,
            **common,
        )
        reaper.server(s)
        return s

    pre = pinned("mixed-prefill", c0, pd_transfer_config("kv_producer", stats_dir=stats))
    dec = pinned("mixed-decode", c1, pd_transfer_config("kv_consumer", stats_dir=stats))
    mono_cpus = f"{c0},{c1}" if c0 != c1 else c0
    mono = pinned("mixed-mono", mono_cpus, None)
    servers = [pre, dec, mono]
    stop = None
    load0 = os.getloadavg()[0]
    try:
        t0 = time.monotonic()
        for s in servers:
            s.start()
        reaper.sync()
        for s in servers:
            s.wait_ready(args.start_timeout)
        reaper.sync()
        for s, cpus in ((pre, c0), (dec, c1), (mono, mono_cpus)):
            pin_group(s, cpus)
        proxy = ProxyServer(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), port=0))
        purl, stop = proxy.run_in_thread()
        log(
            "mixed phase: prefill + decode + proxy + monolithic ready in "
            f"{time.monotonic() - t0:.0f} s"
        )
        urls = {"pd": purl, "mono": mono.url}
        rng = random.Random(20)
        for url in urls.values():  # first requests of each path warm kernels up
            for n in (64, 512):
                http_json(
                    url + "/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": _tokens(n, rng),
                        "max_tokens": 4,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
        got: dict[str, tuple[list[Stream], list[Stream]]] = {m: ([], []) for m in urls}
        window = args.mixed_seconds / max(1, args.mixed_windows)
        loads: list[float] = []
        for w in range(max(1, args.mixed_windows)):
            for mode, url in urls.items():
                shorts, longs = _load(url, args, window, rng)
                got[mode][0].extend(shorts)
                got[mode][1].extend(longs)
                loads.append(os.getloadavg()[0])
                gaps = [g for s in shorts for g in s.gaps]
                log(
                    f"window {w} {mode}: {len(shorts)} decode requests, {len(longs)} long prompts; "
                    f"TBT p99 {percentile(gaps, 99) * 1e3:.0f} ms, long TTFT max "
                    f"{max((s.ttft for s in longs), default=0) * 1e3:.0f} ms; load {loads[-1]:.1f}"
                )
        seconds = window * max(1, args.mixed_windows)
        for mode, (shorts, longs) in got.items():
            for k, v in summarize(
                shorts, longs, seconds, args.slo_ttft_ms, args.slo_tbt_ms
            ).items():
                out[f"{k}_{mode}"] = v
        out["tbt_pd_vs_mono_ratio"] = round(
            out["tbt_p99_ms_pd"] / max(out["tbt_p99_ms_mono"], 1e-3), 2
        )
        out["slo"] = f"ttft<={args.slo_ttft_ms:.0f}ms,max_tbt<={args.slo_tbt_ms:.0f}ms"
        out["load_avg_1m_mixed"] = round(max([load0, *loads]), 1)
    finally:
        if stop is not None:
            stop.set()
        for s in servers:
            s.stop()
