"""Elastic MoE on 4 processes: one rank is SIGKILLed mid-run and the layer keeps serving.

Run:  .venv/bin/python examples/elastic_moe.py

Each rank runs a tiny MoE layer (32 experts, top-4, hidden 256, every expert on two ranks)
through :class:`mooncake_core.ep.ElasticEP`, compares its output with a single-process
reference every step, and reports. After a few steps the launcher kills rank 3 with SIGKILL;
the survivors agree on a new epoch within the timeout and continue, still exact. The
placement before and after is printed. Every expert had a second replica, so nothing had to
move; at step 10 the survivors call ``rebalance()`` (EPLB from the load they saw), which
copies experts between live ranks to use the freed capacity, and outputs stay exact.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

import torch

from mooncake_core.ep import ElasticEP, EPConfig, ExpertBank, make_expert_weights, reference_moe
from mooncake_core.ep.testing import make_inputs, serve_store

E, K, H, F, SEATS, SLOTS, TOKENS = 32, 4, 256, 64, 4, 16, 32


def rank_main(seat: int, port: int, q: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    weights = make_expert_weights(E, H, F, seed=0)
    cfg = EPConfig(
        num_experts=E,
        num_seats=SEATS,
        slots_per_rank=SLOTS,
        hidden=H,
        top_k=K,
        timeout_s=2.0,
        stale_s=0.5,
    )
    ep = ElasticEP(
        cfg, seat, ExpertBank(H, F, {e: weights[e] for e in range(E)}), "127.0.0.1", port
    )
    ep.start()
    if seat == 0:
        # transport: "shm" (same-host shared memory) here, "collective" (gloo) across hosts
        q.put(("placement", f"before (transport {ep.transport})", ep.placement.describe()))
    try:
        while not stop.is_set():
            x, idx, w, logits = make_inputs(0, seat, ep.step, TOKENS, H, E, K)
            step, t0 = ep.step, time.time()
            y = ep.forward(x, idx, w, logits)
            err = float((y - reference_moe(x, idx, w, weights, H, F)).abs().max())
            q.put(("step", seat, step, ep.epoch, list(ep.members), err, time.time() - t0))
            if ep.step == 10 and len(ep.members) == SEATS - 1:  # same step on every survivor
                if seat == 0:
                    q.put(
                        (
                            "placement",
                            f"after the failure (epoch {ep.epoch})",
                            ep.placement.describe(),
                        )
                    )
                ep.rebalance()
            time.sleep(0.05)
        if seat == 0:
            assert ep.view is not None
            moved = [(t.expert, t.src_seat, t.dst_seat) for t in ep.view.transfers]
            q.put(
                (
                    "placement",
                    f"after rebalance (epoch {ep.epoch}; copied (expert, from, to): {moved})",
                    ep.placement.describe(),
                )
            )
    finally:
        ep.close()


def main() -> int:
    store, port = serve_store()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(s, port, q, stop)) for s in range(SEATS)]
    for p in procs:
        p.start()
    killed_at, survivor_steps_after = None, 0
    try:
        while survivor_steps_after < 3 * 8:
            try:
                msg = q.get(timeout=60)
            except queue.Empty:
                print("no progress for 60 s; giving up")
                return 1
            if msg[0] == "placement":
                print(f"placement {msg[1]}:\n{msg[2]}")
                continue
            _, seat, step, epoch, members, err, dt = msg
            print(
                f"seat {seat} step {step:3d} epoch {epoch} members {members} "
                f"max|y-ref| {err:.2e} ({dt * 1e3:.0f} ms)"
            )
            if killed_at is None and seat == 0 and step == 5:
                os.kill(procs[3].pid or 0, signal.SIGKILL)
                killed_at = time.time()
                print(">>> SIGKILL sent to seat 3")
            elif killed_at is not None and epoch > 0:
                survivor_steps_after += 1
        stop.set()
        end = time.monotonic() + 20
        while any(p.is_alive() for p in procs[:3]) and time.monotonic() < end:
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if msg[0] == "placement":
                print(f"placement {msg[1]}:\n{msg[2]}")
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
