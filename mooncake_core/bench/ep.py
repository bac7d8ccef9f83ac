"""``mooncake-core bench ep [--json]``: elastic EP dispatch/combine on local processes.

Starts ``--seats`` processes (default 4) on loopback, each one EP rank over gloo, and for the
routing distributions uniform, k-hot (``--hot`` experts take 90 % of picks) and Zipf (a=1):

- dispatch+combine tokens/s (all ranks' tokens per second; identity experts, so this is the
  communication path) against a naive all-gather baseline (all-gather tokens and routing,
  every rank applies its experts to all tokens, all-reduce the outputs; torch.distributed
  gloo collectives) in the same run. The EP layer is timed twice: with its default
  transport (``auto``: the same-host shared-memory plane here) and with
  ``transport="collective"`` (rows over the same gloo group as the baseline), so the gain of
  the algorithm and that of the transport can be told apart. The three paths alternate in
  the timed windows, at the same tokens per rank and hidden size. Throughput is the median
  window (a window lasts as long as its slowest rank); a ratio is the median of the ratios
  of adjacent windows, which saw the same load on a shared machine. Both are reported for
  the initial placement and after ``rebalance()``;
- load imbalance (max/mean received (token, expert) pairs per rank) with the initial
  contiguous placement (no redundancy, no EPLB) and after ``rebalance()`` on that load;
- time to recover after one rank is SIGKILLed by the launcher mid-run (kill -> the step in
  flight completes on every survivor).

Prints a table; with ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

__all__ = ["main"]

DISTS = ("uniform", "khot", "zipf")


def _routing(
    dist: str, tokens: int, experts: int, k: int, hot: int, gen: torch.Generator
) -> torch.Tensor:
    if dist == "uniform":
        return torch.topk(torch.rand(tokens, experts, generator=gen), k, dim=1).indices
    if dist == "khot":
        probs = torch.full((experts,), 0.1 / (experts - hot))
        probs[:hot] = 0.9 / hot
    else:
        probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32)
    return torch.multinomial(probs.expand(tokens, experts), k, replacement=False, generator=gen)


def _barrier(group: Any) -> None:
    group.all_reduce(torch.zeros(1))


def _allgather_step(
    ep: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, bufs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Naive EP: all-gather everything, apply local experts to all tokens, all-reduce.

    Output buffers are reused across steps, as the EP path does, so the comparison is
    about the communication pattern, not the allocator.
    """
    group = ep.group
    n = x.shape[0] * group.size
    if "x" not in bufs or bufs["x"].shape[0] != n:
        bufs["x"] = torch.empty(n, x.shape[1], dtype=x.dtype)
        bufs["idx"] = torch.empty(n, idx.shape[1], dtype=idx.dtype)
        bufs["w"] = torch.empty(n, w.shape[1], dtype=w.dtype)
        bufs["partial"] = torch.empty(n, x.shape[1], dtype=x.dtype)
    xs = group.all_gather(x, out=bufs["x"])
    idxs = group.all_gather(idx, out=bufs["idx"])
    ws = group.all_gather(w, out=bufs["w"])
    local = torch.zeros(ep.config.num_experts, dtype=torch.bool)
    owner = {e: s for s in ep.members for e in ep.placement.seat_experts(s) if e >= 0}
    for e, s in owner.items():
        local[e] = s == ep.seat
    gate = torch.where(local[idxs], ws, 0.0).sum(dim=1, keepdim=True)
    partial = torch.mul(xs, gate, out=bufs["partial"])  # identity experts
    group.all_reduce(partial)
    i = ep.members.index(ep.seat)
    return partial[i * x.shape[0] : (i + 1) * x.shape[0]].clone()


def _ep_step(ep: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    recv_x, _, handle = ep.dispatch(x, idx, w)
    out: torch.Tensor = ep.combine(recv_x, handle)  # identity experts
    return out


def _worker(seat: int, port: int, opts: dict[str, Any], q: Any) -> None:
    torch.set_num_threads(1)
    from mooncake_core.ep import ElasticEP, EPConfig, ExpertBank, Placement, make_expert_weights

    e, r, s, h, k, t = (
        opts["experts"],
        opts["seats"],
        opts["slots"],
        opts["hidden"],
        opts["topk"],
        opts["tokens"],
    )
    per = e // r
    slots = [-1] * (r * s)
    for seat_i in range(r):
        for j in range(per):
            slots[seat_i * s + j] = seat_i * per + j
    initial = Placement(e, r, s, tuple(slots))
    weights = make_expert_weights(e, h, 1)

    def layer(transport: str, prefix: str) -> Any:
        cfg = EPConfig(
            num_experts=e,
            num_seats=r,
            slots_per_rank=s,
            hidden=h,
            top_k=k,
            timeout_s=opts["timeout"],
            stale_s=opts["stale"],
            heartbeat_s=0.05,
            connect_timeout_s=120,
            transport=transport,
            prefix=prefix,
        )
        bank = ExpertBank(h, 1, {i: weights[i] for i in range(e)})
        return ElasticEP(cfg, seat, bank, "127.0.0.1", port, placement=initial)

    # Two EP layers on the same ranks: the default transport and rows over the gloo group.
    ep = layer(opts["transport"], "mooncake/ep")
    ep_c = layer("collective", "mooncake/ep-collective")
    ep.start()
    ep_c.start()
    gen = torch.Generator().manual_seed(1000 + seat)
    x = torch.randn(t, h, generator=gen)
    out: dict[str, Any] = {"seat": seat, "transport": ep.transport}
    try:
        routing = {}
        for dist in DISTS:
            routing[dist] = (
                _routing(dist, t, e, k, opts["hot"], gen),
                torch.softmax(torch.randn(t, k, generator=gen), dim=1),
            )
        # "before": the initial contiguous placement for every distribution; "after": EPLB
        # re-placement (rebalance) from the load that distribution produced.
        for phase in ("before", "after"):
            for dist in DISTS:
                idx, w = routing[dist]
                if phase == "after":
                    for layer_ in (ep, ep_c):  # same load, so the same EPLB placement
                        layer_.reset_load()
                        for _ in range(2):
                            _ep_step(layer_, x, idx, w)
                        layer_.rebalance()
                recv_x, counts, handle = ep.dispatch(x, idx, w)
                ep.combine(recv_x, handle)  # identity experts
                group = ep.group
                assert group is not None
                pairs = group.all_gather(counts.sum().reshape(1).to(torch.float64))
                out[f"imbalance_{dist}_{phase}"] = float(pairs.max() / pairs.mean())
                bufs: dict[str, torch.Tensor] = {}
                steps: dict[str, Callable[[], Any]] = {
                    "ep": partial(_ep_step, ep, x, idx, w),
                    "collective": partial(_ep_step, ep_c, x, idx, w),
                    "allgather": partial(_allgather_step, ep, x, idx, w, bufs),
                }
                for fn in steps.values():
                    for _ in range(opts["warmup"]):
                        fn()
                # Alternate the two paths and keep the median of the repeats: the machine
                # is shared, so a single window can be hit by someone else's build.
                times: dict[str, list[float]] = {name: [] for name in steps}
                for _ in range(opts["repeats"]):
                    for name, fn in steps.items():
                        _barrier(group)
                        t0 = time.perf_counter()
                        for _ in range(opts["iters"]):
                            fn()
                        _barrier(group)
                        times[name].append((time.perf_counter() - t0) / opts["iters"])
                for name, ts in times.items():
                    out[f"s_{name}_{dist}_{phase}"] = ts
        q.put({"kind": "result", **out})
        ep_c.close()
        # Recovery: run steps until the launcher kills a rank and the survivors recover.
        xs, idxs = x[:64], _routing("uniform", 64, e, k, opts["hot"], gen)
        ws = torch.softmax(torch.randn(64, k, generator=gen), dim=1)
        q.put({"kind": "ready", "seat": seat})
        epoch0 = ep.epoch
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ep.forward(xs, idxs, ws)
            if ep.epoch != epoch0:
                q.put(
                    {
                        "kind": "recovered",
                        "seat": seat,
                        "t": time.time(),
                        "members": list(ep.members),
                        "internal_s": ep.stats["last_recover_s"],
                    }
                )
                break
            time.sleep(0.005)
    finally:
        ep_c.close()
        ep.close()


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def _print_table(res: dict[str, Any]) -> None:
    print(
        f"{'distribution':<12} {'placement':<10} {'EP tok/s':>10} {'EP-coll tok/s':>14} "
        f"{'all-gather tok/s':>17} {'ratio':>7} {'ratio coll':>11} {'imbalance':>10}"
    )
    for d in DISTS:
        for ph, sfx in (("before", ""), ("after", "_after_rebalance")):
            print(
                f"{d:<12} {ph:<10} {res[f'tokens_per_s_{d}{sfx}']:>10.0f} "
                f"{res[f'collective_tokens_per_s_{d}{sfx}']:>14.0f} "
                f"{res[f'allgather_tokens_per_s_{d}{sfx}']:>17.0f} {res[f'ratio_{d}{sfx}']:>7.2f} "
                f"{res[f'ratio_collective_{d}{sfx}']:>11.2f} {res[f'imbalance_{d}_{ph}']:>10.2f}"
            )
    print(
        f"EP transport: {res['transport']} (EP-coll: rows over the gloo group, like the baseline)"
    )
    print(
        f"recovery after SIGKILL of seat {res['killed_seat']}: {res['recover_s']:.3f} s "
        f"(timeout {res['timeout_s']} s, stale {res['stale_s']} s)"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mooncake-core bench ep", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--seats", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument(
        "--slots", type=int, default=10, help="slots per rank (experts/seats + redundant)"
    )
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--hot", type=int, default=4, help="hot experts of the k-hot distribution")
    p.add_argument("--iters", type=int, default=5, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per path (median kept)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--stale", type=float, default=0.5)
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "shm", "collective"),
        help="transport of the main EP layer (the second one always uses 'collective')",
    )
    a = p.parse_args(argv)
    from mooncake_core.ep.testing import serve_store

    opts = vars(a).copy()
    store, port = serve_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(s, port, opts, q), daemon=True) for s in range(a.seats)
    ]
    for proc in procs:
        proc.start()
    results: list[dict[str, Any]] = []
    recovered: list[dict[str, Any]] = []
    ready = 0
    t_kill = 0.0
    victim = a.seats - 1
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and len(recovered) < a.seats - 1:
            try:
                m = q.get(timeout=0.5)
            except queue_mod.Empty:
                if not any(proc.is_alive() for proc in procs):
                    break
                continue
            if m["kind"] == "result":
                results.append(m)
            elif m["kind"] == "ready":
                ready += 1
                if ready == a.seats:
                    time.sleep(0.3)
                    t_kill = time.time()
                    os.kill(procs[victim].pid or 0, signal.SIGKILL)
            elif m["kind"] == "recovered":
                recovered.append(m)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        del store
    if len(results) != a.seats or len(recovered) != a.seats - 1:
        print(f"bench ep failed: {len(results)} results, {len(recovered)} recoveries")
        return 1
    total = a.tokens * a.seats
    res: dict[str, Any] = {}
    for d in DISTS:
        for ph, sfx in (("before", ""), ("after", "_after_rebalance")):
            # Window i of a path lasts as long as its slowest rank (windows start at a
            # barrier). Throughput: median window. Ratios: median of the per-repeat ratios of
            # adjacent windows, which saw the same load on this shared machine.
            win = {
                path: [
                    max(ws) for ws in zip(*(r[f"s_{path}_{d}_{ph}"] for r in results), strict=True)
                ]
                for path in ("ep", "collective", "allgather")
            }
            res[f"tokens_per_s_{d}{sfx}"] = total / _median(win["ep"])
            res[f"collective_tokens_per_s_{d}{sfx}"] = total / _median(win["collective"])
            res[f"allgather_tokens_per_s_{d}{sfx}"] = total / _median(win["allgather"])
            res[f"ratio_{d}{sfx}"] = _median(
                [g / e for g, e in zip(win["allgather"], win["ep"], strict=True)]
            )
            res[f"ratio_collective_{d}{sfx}"] = _median(
                [g / c for g, c in zip(win["allgather"], win["collective"], strict=True)]
            )
            res[f"imbalance_{d}_{ph}"] = results[0][f"imbalance_{d}_{ph}"]
    summary = {
        "tokens_per_s": res["tokens_per_s_uniform"],
        "tokens_per_s_ratio_vs_allgather": res["ratio_uniform"],
        "tokens_per_s_ratio_vs_allgather_collective": res["ratio_collective_uniform"],
        "transport": results[0]["transport"],
        "imbalance_zipf_before": res["imbalance_zipf_before"],
        "imbalance_zipf_after": res["imbalance_zipf_after"],
        "recover_s": max(m["t"] for m in recovered) - t_kill,
        "recover_internal_s": max(m["internal_s"] for m in recovered),
        "killed_seat": victim,
        "timeout_s": a.timeout,
        "stale_s": a.stale,
        "seats": a.seats,
        "experts": a.experts,
        "slots_per_rank": a.slots,
        "topk": a.topk,
        "hidden": a.hidden,
        "tokens_per_rank": a.tokens,
        "backend": "gloo",
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()},
    }
    _print_table({**res, **summary})
    if a.json:
        print(json.dumps(summary))
    return 0
