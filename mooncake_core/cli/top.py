"""``mooncake-core top``: a live terminal view of a cluster, from its ``/metrics`` endpoints.

For people without Grafana: give the store master's HTTP address, the transfer/store
nodes' metrics endpoints (``transfer.metrics_port``, ``MOONCAKE_TRANSFER_METRICS_PORT``)
and the proxies; every ``--interval`` seconds it scrapes them all and prints one block per
target (totals, and rates since the previous scrape). ``--once`` prints one snapshot (no
rates) and exits: 0 when every target answered, 1 otherwise. ``--json`` (with ``--once``)
prints the snapshot as one JSON object instead.

    mooncake-core top --master 127.0.0.1:9003 --node 127.0.0.1:9100 --proxy 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from mooncake_core.metrics import Sample, parse

__all__ = ["add_arguments", "run", "scrape", "summarize", "quantile"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master", action="append", default=[], metavar="HOST:PORT", help="store master HTTP"
    )
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a process's metrics endpoint (transfer engine, store node)",
    )
    parser.add_argument(
        "--proxy", action="append", default=[], metavar="HOST:PORT", help="a PD proxy"
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="with --once: one JSON object")


def _url(target: str) -> str:
    t = target if "://" in target else f"http://{target}"
    return t if t.rstrip("/").endswith("/metrics") else t.rstrip("/") + "/metrics"


def scrape(target: str, timeout: float = 3.0) -> list[Sample]:
    """The samples of ``target``'s /metrics (raises OSError/ValueError when it fails)."""
    with urllib.request.urlopen(_url(target), timeout=timeout) as r:
        return parse(r.read().decode())


def _sum(samples: list[Sample], sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.sample == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def quantile(samples: list[Sample], hist: str, q: float) -> float:
    """The ``q`` quantile of histogram ``hist`` over all its label sets (linear within the
    bucket, as Prometheus' histogram_quantile); NaN when it has no observations."""
    buckets: dict[float, float] = defaultdict(float)
    for s in samples:
        if s.sample == hist + "_bucket":
            buckets[float(s.labels["le"])] += s.value
    if not buckets:
        return math.nan
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    if total <= 0:
        return math.nan
    rank, prev_edge, prev_count = q * total, 0.0, 0.0
    for e in edges:
        c = buckets[e]
        if c >= rank:
            if math.isinf(e):
                return prev_edge
            width = c - prev_count
            return prev_edge + (e - prev_edge) * ((rank - prev_count) / width if width else 0)
        prev_edge, prev_count = e, c
    return prev_edge


def summarize(kind: str, samples: list[Sample]) -> dict[str, Any]:
    """The figures ``top`` shows of one target (``kind``: master, node or proxy)."""
    out: dict[str, Any] = {"rss_bytes": _sum(samples, "process_resident_memory_bytes")}
    if kind == "master":
        total = _sum(samples, "total_get_nums_")
        out.update(
            leader=_sum(samples, "mooncake_master_is_leader") == 1,
            keys=_sum(samples, "master_key_count"),
            used_bytes=_sum(samples, "master_allocated_bytes"),
            capacity_bytes=_sum(samples, "master_total_capacity_bytes"),
            clients=_sum(samples, "master_active_clients"),
            gets=total,
            hit_rate=_sum(samples, "valid_get_nums_") / total if total else math.nan,
            evictions=_sum(samples, "mooncake_master_evictions_total"),
            leased=_sum(samples, "mooncake_master_leased_objects"),
            ssd_objects=_sum(samples, "mooncake_master_ssd_objects"),
            requests=_sum(samples, "mooncake_master_requests_total"),
            request_errors=_sum(samples, "mooncake_master_request_errors_total"),
            p99_request_s=quantile(samples, "mooncake_master_request_seconds", 0.99),
        )
    elif kind == "node":
        out.update(
            read_bytes=_sum(samples, "mooncake_transfer_bytes_total", op="read"),
            written_bytes=_sum(samples, "mooncake_transfer_bytes_total", op="write"),
            slices=_sum(samples, "mooncake_transfer_slices_total"),
            retries=_sum(samples, "mooncake_transfer_retries_total"),
            failovers=_sum(samples, "mooncake_transfer_failovers_total"),
            slice_errors=_sum(samples, "mooncake_transfer_slice_errors_total"),
            p50_transfer_s=quantile(samples, "mooncake_transfer_seconds", 0.5),
            p99_transfer_s=quantile(samples, "mooncake_transfer_seconds", 0.99),
            peers=sorted({s.labels["peer"] for s in samples if "peer" in s.labels}),
        )
    else:
        out.update(
            ok=_sum(samples, "mooncake_proxy_requests_total", outcome="ok"),
            rejected=_sum(samples, "mooncake_proxy_rejections_total"),
            upstream_errors=_sum(samples, "mooncake_proxy_upstream_errors_total"),
            in_flight=_sum(samples, "mooncake_proxy_in_flight"),
            p50_ttft_s=quantile(samples, "mooncake_proxy_ttft_seconds", 0.5),
            p90_ttft_s=quantile(samples, "mooncake_proxy_ttft_seconds", 0.9),
            p50_e2e_s=quantile(samples, "mooncake_proxy_e2e_seconds", 0.5),
        )
    return out


def _b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.2f} ms"


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str, dt: float) -> str:
    if before is None or dt <= 0:
        return ""
    return f" ({(now[key] - before[key]) / dt:,.1f}/s)"


def _lines(
    kind: str, target: str, now: dict[str, Any] | None, before: dict[str, Any] | None, dt: float
) -> list[str]:
    if now is None:
        return [f"{kind.upper():6} {target}: DOWN"]
    rss = _b(now["rss_bytes"])
    if kind == "master":
        role = "leader" if now["leader"] else "standby"
        hit = "-" if math.isnan(now["hit_rate"]) else f"{now['hit_rate'] * 100:.1f}%"
        return [
            f"MASTER {target} [{role}] keys {now['keys']:,.0f}  memory "
            f"{_b(now['used_bytes'])} / {_b(now['capacity_bytes'])}  clients "
            f"{now['clients']:.0f}  rss {rss}",
            f"       requests {now['requests']:,.0f}{_rate(now, before, 'requests', dt)}  "
            f"errors {now['request_errors']:,.0f}  p99 {_ms(now['p99_request_s'])}  gets "
            f"{now['gets']:,.0f}{_rate(now, before, 'gets', dt)}  hit {hit}  evictions "
            f"{now['evictions']:,.0f}  leased {now['leased']:,.0f}  ssd {now['ssd_objects']:,.0f}",
        ]
    if kind == "node":
        rates = ""
        if before is not None and dt > 0:
            rd = (now["read_bytes"] - before["read_bytes"]) / dt
            wr = (now["written_bytes"] - before["written_bytes"]) / dt
            rates = f"  now read {_b(rd)}/s write {_b(wr)}/s"
        return [
            f"NODE   {target} read {_b(now['read_bytes'])} written {_b(now['written_bytes'])}"
            f"{rates}  rss {rss}",
            f"       slices {now['slices']:,.0f}  retries {now['retries']:,.0f}  failovers "
            f"{now['failovers']:,.0f}  errors {now['slice_errors']:,.0f}  p50 "
            f"{_ms(now['p50_transfer_s'])} p99 {_ms(now['p99_transfer_s'])}  peers "
            f"{len(now['peers'])}",
        ]
    return [
        f"PROXY  {target} ok {now['ok']:,.0f}{_rate(now, before, 'ok', dt)}  rejected "
        f"{now['rejected']:,.0f}  upstream errors {now['upstream_errors']:,.0f}  in flight "
        f"{now['in_flight']:.0f}  rss {rss}",
        f"       TTFT p50 {_ms(now['p50_ttft_s'])} p90 {_ms(now['p90_ttft_s'])}  "
        f"end-to-end p50 {_ms(now['p50_e2e_s'])}",
    ]


def _poll(targets: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any] | None]:
    out: dict[tuple[str, str], dict[str, Any] | None] = {}
    for kind, target in targets:
        try:
            out[(kind, target)] = summarize(kind, scrape(target))
        except (OSError, ValueError, urllib.error.URLError):
            out[(kind, target)] = None
    return out


def run(args: argparse.Namespace) -> int:
    targets = (
        [("master", t) for t in args.master]
        + [("node", t) for t in args.node]
        + [("proxy", t) for t in args.proxy]
    )
    if not targets:
        raise SystemExit("mooncake-core: error: top: give at least one --master, --node or --proxy")
    if args.interval <= 0:
        raise SystemExit(f"mooncake-core: error: --interval must be > 0, got {args.interval}")
    before: dict[tuple[str, str], dict[str, Any] | None] = {}
    t_before = 0.0
    while True:
        t_now = time.monotonic()
        now = _poll(targets)
        if args.once and args.json:
            print(json.dumps({f"{k}:{t}": v for (k, t), v in now.items()}, default=str))
        else:
            lines = [time.strftime("mooncake-core top  %H:%M:%S")]
            for key in targets:
                lines += _lines(key[0], key[1], now[key], before.get(key), t_now - t_before)
            if not args.once and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print("\n".join(lines), flush=True)
        if args.once:
            return 0 if all(v is not None for v in now.values()) else 1
        before, t_before = now, t_now
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
