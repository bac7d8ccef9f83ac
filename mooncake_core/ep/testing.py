"""Multi-process harness for the EP tests, benchmark and example (loopback only).

- :func:`free_port` / :func:`serve_store`: the launcher hosts the shared TCPStore.
- :class:`WorkerSpec` + :func:`run_worker`: one EP rank that runs a tiny MoE layer on
  deterministic inputs and reports every step (inputs, output, epoch, live experts) on a
  queue, so the parent can compare against its own references. A spec can make one seat
  ``SIGKILL`` itself at a given step and phase, start a seat with ``join()`` instead of
  ``start()``, or inject bad input. With ``store_master`` every rank gets a
  :class:`~mooncake_core.ep.weights.StoreWeightSource` on a real ``mooncake_core.store``
  client (connected on first use), and ``joiner_live_fetch=False`` makes a restarted rank
  refuse any expert from a live replica, so its experts can only come from the store.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

from mooncake_core.config import env_str
from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.engine import ElasticEP
from mooncake_core.ep.experts import ExpertBank, make_expert_weights
from mooncake_core.ep.weights import (
    STORE,
    FetchContext,
    LiveReplicaSource,
    StoreWeightSource,
    Transfer,
)
from mooncake_core.errors import EPError, Evicted

__all__ = ["WorkerSpec", "free_port", "make_inputs", "run_worker", "serve_store"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_store(port: int | None = None) -> tuple[TCPStore, int]:
    """Host the shared store in this (launcher) process; returns ``(store, port)``."""
    port = port or free_port()
    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return store, port


def make_inputs(
    seed: int, seat: int, step: int, tokens: int, hidden: int, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic ``(x, topk_idx, topk_weights, logits)`` for one seat and step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + seat * 10_007 + step)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, num_experts, generator=gen)
    vals, idx = torch.topk(logits, top_k, dim=1)
    return x, idx, torch.softmax(vals, dim=1), logits


@dataclass(frozen=True)
class WorkerSpec:
    """One rank's script (picklable)."""

    num_seats: int = 4
    slots_per_rank: int = 16
    num_experts: int = 32
    hidden: int = 256
    ffn: int = 32
    top_k: int = 4
    tokens: int = 16
    steps: int = 6
    policy: str = "renormalize"
    timeout_s: float = 2.0
    stale_s: float = 1.0
    heartbeat_s: float = 0.05
    seed: int = 0
    kill_seat: int = -1
    kill_step: int = -1
    kill_phase: str = "before_dispatch"
    join: bool = False
    steps_after_join: int = 0
    bad_input_step: int = -1
    bad_mask_step: int = -1
    step_sleep_s: float = 0.0
    tokens_growth: int = 0
    transport: str = "auto"
    store_master: str = ""
    store_key_prefix: str = "ep-test/experts"
    joiner_live_fetch: bool = True
    prefix: str = "mooncake/ep"
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> EPConfig:
        return EPConfig(
            num_experts=self.num_experts,
            num_seats=self.num_seats,
            slots_per_rank=self.slots_per_rank,
            hidden=self.hidden,
            top_k=self.top_k,
            policy="substitute" if self.policy == "substitute" else "renormalize",
            timeout_s=self.timeout_s,
            heartbeat_s=self.heartbeat_s,
            stale_s=self.stale_s,
            join_poll_s=0.05,
            transport=self.transport,
            prefix=self.prefix,
        )

    def tokens_at(self, step: int) -> int:
        return self.tokens + step * self.tokens_growth


class _LazyStoreClient:
    """``put``/``get`` on a ``mooncake_core.store`` client that connects on first use, so
    ranks that never read the store never connect to it."""

    def __init__(self, master: str):
        self.master = master
        self._client: Any = None

    def _c(self) -> Any:
        if self._client is None:
            from mooncake_core.store.client import StoreClient

            self._client = StoreClient(master=self.master, segment_size=0).start()
        return self._client

    def put(self, key: str, data: bytes) -> None:
        self._c().put(key, data)

    def get(self, key: str) -> bytes:
        data: bytes = self._c().get(key)
        return data

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _NoLiveIncoming(LiveReplicaSource):
    """A live-replica source that refuses to deliver experts to this seat."""

    def fetch(self, transfers: Sequence[Transfer], ctx: FetchContext) -> dict[int, torch.Tensor]:
        mine = [t for t in transfers if t.dst_seat == ctx.seat and t.src_seat != STORE]
        if mine:
            raise EPError(f"seat {ctx.seat} must not get experts from live replicas: {mine}")
        return super().fetch(transfers, ctx)


def _live_experts(ep: ElasticEP) -> list[int]:
    """Experts that served the last step (of the epoch that served it)."""
    view = ep.served_view or ep.view
    if view is None:
        return []
    p = view.placement
    return sorted({e for s in view.members for e in p.seat_experts(s) if e >= 0})


def _die(queue: Any, seat: int, sig: int = signal.SIGKILL) -> None:
    """Report, flush the queue, then SIGKILL (crash) or SIGSTOP (hang) this process."""
    queue.put(
        {"kind": "killed" if sig == signal.SIGKILL else "stopped", "seat": seat, "t": time.time()}
    )
    if sig == signal.SIGKILL:
        queue.close()
        queue.join_thread()
    else:
        time.sleep(0.2)  # let the queue's feeder thread flush
    os.kill(os.getpid(), sig)


def run_worker(seat: int, port: int, spec: WorkerSpec, queue: Any) -> None:
    """Body of one EP rank process (target of a ``spawn`` process)."""
    torch.set_num_threads(1)
    if env_str("MOONCAKE_EP_TEST_LOG"):  # any value turns on debug logs of the rank processes
        logging.basicConfig(
            level=logging.DEBUG, format=f"%(asctime)s seat{seat} %(name)s %(message)s"
        )
    cfg = spec.config()
    weights = make_expert_weights(spec.num_experts, spec.hidden, spec.ffn, spec.seed)
    held = {} if spec.join else {e: weights[e] for e in range(spec.num_experts)}
    client = _LazyStoreClient(spec.store_master) if spec.store_master else None
    source = StoreWeightSource(client, spec.store_key_prefix) if client is not None else None
    ep = ElasticEP(
        cfg, seat, ExpertBank(spec.hidden, spec.ffn, held), "127.0.0.1", port, store_source=source
    )
    if spec.join and not spec.joiner_live_fetch:
        ep.live_source = _NoLiveIncoming()
    try:
        if spec.join:
            ep.join(timeout_s=60.0)
        else:
            ep.start()
        queue.put(
            {
                "kind": "up",
                "reason": ep.view.reason if ep.view is not None else "",
                "seat": seat,
                "epoch": ep.epoch,
                "placement": ep.placement.to_list(),
                "held": ep.bank.held(),
                "transport": ep.transport,
                "store_loads": source.loads if source is not None else 0,
                "transfers_in": [
                    [t.expert, t.src_seat]
                    for t in (ep.view.transfers if ep.view is not None else ())
                    if t.dst_seat == seat
                ],
            }
        )
        join_step = ep.view.max_step if spec.join and ep.view is not None else -1
        doomed = seat == spec.kill_seat and not spec.join  # a rejoined process is not killed again
        last = join_step + spec.steps_after_join if spec.join else spec.steps
        while ep.step < last or (spec.steps_after_join and join_step < 0):
            step = ep.step
            x, idx, w, logits = make_inputs(
                spec.seed,
                seat,
                step,
                spec.tokens_at(step),
                spec.hidden,
                spec.num_experts,
                spec.top_k,
            )
            if step == spec.bad_input_step or step == spec.bad_mask_step:
                bad_idx, mask = idx, None
                if step == spec.bad_input_step and seat == 0:
                    bad_idx = idx.clone()
                    bad_idx[0, 0] = spec.num_experts + 5
                if step == spec.bad_mask_step:
                    mask = torch.ones(spec.num_seats, dtype=torch.int32)
                    if seat == 0:
                        mask[spec.num_seats - 1] = 0
                t0 = time.monotonic()
                try:
                    ep.forward(x, bad_idx, w, logits, active_ranks=mask)
                    queue.put({"kind": "bad", "seat": seat, "step": step, "error": None})
                except EPError as exc:
                    queue.put(
                        {
                            "kind": "bad",
                            "seat": seat,
                            "step": step,
                            "error": f"{type(exc).__name__}: {exc}",
                            "s": time.monotonic() - t0,
                        }
                    )
            if doomed and step == spec.kill_step and spec.kill_phase == "before_dispatch":
                _die(queue, seat)
            epoch_before = ep.epoch
            if doomed and step == spec.kill_step and spec.kill_phase == "hang":
                ep.dispatch(x, idx, w, router_logits=logits)
                _die(queue, seat, signal.SIGSTOP)  # resumes here after SIGCONT
            if doomed and step == spec.kill_step and spec.kill_phase == "mid_step":
                ep.dispatch(x, idx, w, router_logits=logits)
                _die(queue, seat)
            y = ep.forward(x, idx, w, logits)
            view = ep.view
            if spec.steps_after_join and join_step < 0 and view is not None and view.joined:
                # The view that admitted the joiner (a "join" or a "failure" transition):
                # everyone counts from its max_step, the step the joiner starts at.
                join_step = view.max_step
                last = join_step + spec.steps_after_join
            queue.put(
                {
                    "kind": "step",
                    "seat": seat,
                    "step": step,
                    "t": time.time(),
                    "epoch": ep.epoch,
                    "epoch_changed": ep.epoch != epoch_before,
                    "members": list(ep.members),
                    "live_experts": _live_experts(ep),
                    "x": x.tolist(),
                    "idx": idx.tolist(),
                    "w": w.tolist(),
                    "logits": logits.tolist(),
                    "y": y.tolist(),
                    "placement": ep.placement.to_list(),
                    "stats": dict(ep.stats),
                }
            )
            if spec.step_sleep_s:
                time.sleep(spec.step_sleep_s)
        queue.put(
            {
                "kind": "done",
                "seat": seat,
                "epoch": ep.epoch,
                "placement": ep.placement.to_list(),
                "held": ep.bank.held(),
            }
        )
    except Evicted as exc:
        queue.put({"kind": "evicted", "seat": seat, "error": str(exc)})
    except Exception as exc:  # reported to the parent, which fails the test with it
        queue.put(
            {
                "kind": "error",
                "seat": seat,
                "error": f"{type(exc).__name__}: {exc}",
                "t": time.time(),
            }
        )
        raise
    finally:
        ep.close()
        if client is not None:
            client.close()
