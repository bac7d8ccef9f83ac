"""Elastic EP across 4 real processes: reference equality (both transports), SIGKILL,
policies, rejoin from live replicas and from the real store, bad input."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mooncake_core.ep import (
    STORE,
    StoreWeightSource,
    make_expert_weights,
    reference_moe,
    run_expert,
)
from mooncake_core.ep.testing import WorkerSpec, free_port, run_worker, serve_store

pytestmark = [pytest.mark.slow]

ATOL = 1e-5
RTOL = 1e-5


def _run(
    spec: WorkerSpec,
    restart_killed: str = "",
    deadline_s: float = 75.0,
    resume_after: int = 0,
    kill_store_after_step: int = -1,
    allow_errors: bool = False,
) -> list[dict[str, Any]]:
    """Run the ranks; ``restart_killed`` is "" (no), "at_once" or "after_recovery".

    With ``kill_store_after_step`` the membership store runs in its own process, which is
    SIGKILLed once every seat has reported that step."""
    store_proc: subprocess.Popen[str] | None = None
    if kill_store_after_step >= 0:
        port = free_port()
        store_proc = subprocess.Popen(
            [sys.executable, "-c", _STORE_SCRIPT.format(port=port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert store_proc.stdout is not None and store_proc.stdout.readline().strip() == "up"
        store: Any = None
    else:
        store, port = serve_store()
    # forkserver: torch is imported once in the server, not once per rank (start-up on a
    # loaded 2-core machine dominates these tests otherwise).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "mooncake_core.ep.testing"])
    q = ctx.Queue()
    procs = {
        s: ctx.Process(target=run_worker, args=(s, port, spec, q), daemon=True)
        for s in range(spec.num_seats)
    }
    extra: list[Any] = []
    for p in procs.values():
        p.start()
    msgs: list[dict[str, Any]] = []
    pending_restart = -1
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            alive = [p for p in [*procs.values(), *extra] if p.is_alive()]
            if not alive and q.empty():
                break
            try:
                m = q.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            msgs.append(m)
            if (
                store_proc is not None
                and store_proc.poll() is None
                and m["kind"] == "step"
                and len({x["seat"] for x in _steps(msgs) if x["step"] == kill_store_after_step})
                == spec.num_seats
            ):
                store_proc.kill()
                store_proc.wait()
                msgs.append({"kind": "store_killed", "t": time.time()})
            if resume_after and sum(x["kind"] == "done" for x in msgs) == resume_after:
                for x in msgs:  # wake the hung rank once the survivors are done
                    if x["kind"] == "stopped":
                        os.kill(procs[x["seat"]].pid or 0, signal.SIGCONT)
                resume_after = 0
            if m["kind"] == "killed" and restart_killed:
                procs[m["seat"]].join(10)
                pending_restart = m["seat"]
            recovered = m["kind"] == "step" and m["epoch"] >= 1
            if pending_restart >= 0 and (restart_killed == "at_once" or recovered):
                seat, pending_restart = pending_restart, -1
                joiner = ctx.Process(
                    target=run_worker,
                    args=(seat, port, replace(spec, join=True), q),
                    daemon=True,
                )
                joiner.start()
                extra.append(joiner)
    finally:
        for p in [*procs.values(), *extra]:
            if p.is_alive():
                p.kill()
            p.join(5)
        if store_proc is not None and store_proc.poll() is None:
            store_proc.kill()
            store_proc.wait()
        del store
    errors = [m for m in msgs if m["kind"] == "error"]
    assert allow_errors or not errors, errors
    return msgs


_STORE_SCRIPT = """
import time
from mooncake_core.ep.testing import serve_store
store, _ = serve_store({port})
print("up", flush=True)
time.sleep(600)
"""


def _t(v: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype)


def _ref(
    m: dict[str, Any], spec: WorkerSpec, live: set[int] | None = None, policy: str = "renormalize"
) -> torch.Tensor:
    """Independent per-token reference (loops are fine here)."""
    weights = make_expert_weights(spec.num_experts, spec.hidden, spec.ffn, spec.seed)
    x, idx, w, logits = _t(m["x"]), _t(m["idx"], torch.int64), _t(m["w"]), _t(m["logits"])
    live = set(range(spec.num_experts)) if live is None else live
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        experts = idx[t].tolist()
        gates = w[t].tolist()
        if policy == "substitute":
            order = torch.argsort(logits[t], descending=True).tolist()
            for k, e in enumerate(experts):
                if e not in live:
                    cand = [c for c in order if c in live and c not in experts]
                    experts[k] = cand[0] if cand else -1
        keep = [k for k, e in enumerate(experts) if e in live]
        total, kept = sum(gates), sum(gates[k] for k in keep)
        for k in keep:
            gate = gates[k] * total / kept
            y[t] += gate * run_expert(weights[experts[k]], x[t : t + 1], spec.hidden, spec.ffn)[0]
    return y


def _steps(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in msgs if m["kind"] == "step"]


@pytest.mark.timeout(120)
def test_ep_matches_reference_survives_sigkill_and_rejects_bad_input() -> None:
    spec = WorkerSpec(
        kill_seat=3, kill_step=3, kill_phase="mid_step", steps=6, bad_input_step=1, bad_mask_step=2
    )
    msgs = _run(spec)
    steps = _steps(msgs)
    # Every survivor did every step, the killed seat the first three; all equal the reference.
    for seat in range(4):
        done = sorted(m["step"] for m in steps if m["seat"] == seat)
        assert done == (list(range(6)) if seat != 3 else [0, 1, 2])
    for m in steps:
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec), atol=ATOL, rtol=RTOL)
    # Redundancy: every expert still has a live replica after seat 3 died.
    after = [m for m in steps if m["step"] >= 3]
    assert all(m["members"] == [0, 1, 2] and len(m["live_experts"]) == 32 for m in after)
    # Recovery bound: the step in flight at the kill finished within timeout + 1 s.
    t_kill = next(m["t"] for m in msgs if m["kind"] == "killed")
    recover = max(m["t"] for m in steps if m["step"] == 3) - t_kill
    assert recover <= spec.timeout_s + 1.0, recover
    # Bad input: every rank got a clear error, quickly, and the next call worked.
    bad = [m for m in msgs if m["kind"] == "bad"]
    ids = {m["seat"]: m["error"] for m in bad if m["step"] == 1}
    assert set(ids) == {0, 1, 2, 3}
    assert "InvalidRouting" in ids[0] and "expert id 37" in ids[0]
    assert all("seat(s) [0] rejected" in ids[s] for s in (1, 2, 3))
    masks = {m["seat"]: m["error"] for m in bad if m["step"] == 2}
    assert set(masks) == {0, 1, 2, 3}
    assert all(e is not None and "active_ranks differs across ranks" in e for e in masks.values())
    assert all(m["s"] < 1.0 for m in bad)


def _no_redundancy(policy: str) -> None:
    spec = WorkerSpec(slots_per_rank=8, kill_seat=1, kill_step=2, steps=4, policy=policy)
    msgs = _run(spec)
    steps = _steps(msgs)
    up = next(m for m in msgs if m["kind"] == "up" and m["seat"] == 1)
    lost = set(up["placement"][8:16])
    for m in steps:
        live = set(m["live_experts"])
        if m["step"] < 2:
            assert live == set(range(32))
        else:
            assert m["members"] == [0, 2, 3] and live == set(range(32)) - lost
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec, live, policy), atol=ATOL, rtol=RTOL)
    assert sorted({m["seat"] for m in steps if m["step"] == 3}) == [0, 2, 3]


@pytest.mark.timeout(120)
def test_ep_renormalize_without_redundancy_matches_masked_reference() -> None:
    _no_redundancy("renormalize")


@pytest.mark.timeout(120)
def test_ep_substitute_without_redundancy_matches_its_reference() -> None:
    _no_redundancy("substitute")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("when", ["at_once", "after_recovery"])
def test_ep_rejoin_gets_experts_and_matches_full_reference(when: str) -> None:
    # at_once: the join request usually lands while the survivors are still agreeing on the
    # failure epoch, which then admits the joiner; after_recovery: the leader sees the
    # request in a later round and all members run a planned "join" transition.
    spec = WorkerSpec(kill_seat=2, kill_step=2, steps=3, steps_after_join=3, step_sleep_s=0.02)
    msgs = _run(spec, restart_killed=when, deadline_s=110)
    ups = [m for m in msgs if m["kind"] == "up" and m["seat"] == 2]
    assert len(ups) == 2  # first life and the rejoined process
    rejoined = ups[1]
    assert rejoined["epoch"] >= 1 and rejoined["held"], rejoined  # experts came from live replicas
    if when == "after_recovery":
        assert rejoined["epoch"] >= 2 and rejoined["reason"] == "join", rejoined
    steps = _steps(msgs)
    final = [m for m in steps if len(m["members"]) == 4 and m["epoch"] >= rejoined["epoch"]]
    assert {m["seat"] for m in final} == {0, 1, 2, 3}
    for m in steps:
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec), atol=ATOL, rtol=RTOL)
    done = {m["seat"]: m for m in msgs if m["kind"] == "done"}
    assert set(done) == {0, 1, 2, 3}
    assert all(d["epoch"] == done[0]["epoch"] for d in done.values())


@pytest.mark.timeout(120)
def test_ep_hung_rank_times_out_is_excluded_and_evicted_on_resume() -> None:
    spec = WorkerSpec(kill_seat=2, kill_step=2, kill_phase="hang", steps=4)
    msgs = _run(spec, resume_after=3)
    steps = _steps(msgs)
    for m in steps:
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec), atol=ATOL, rtol=RTOL)
    t_stop = next(m["t"] for m in msgs if m["kind"] == "stopped")
    recover = max(m["t"] for m in steps if m["step"] == 2 and m["seat"] != 2) - t_stop
    # A hung rank keeps its sockets open: the survivors notice only through the timeout.
    assert spec.timeout_s - 0.5 <= recover <= spec.timeout_s + 1.0, recover
    assert all(m["members"] == [0, 1, 3] for m in steps if m["step"] >= 2)
    evicted = [m for m in msgs if m["kind"] == "evicted"]
    assert [m["seat"] for m in evicted] == [2] and "call join()" in evicted[0]["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_ep_transports_match_reference_as_batches_grow(transport: str) -> None:
    # The batch grows every step (16 -> 466 tokens per rank), so on the shared-memory plane
    # each rank's send buffers outgrow 1 MiB and are replaced; peers must remap them.
    spec = WorkerSpec(transport=transport, steps=4, tokens=16, tokens_growth=150)
    msgs = _run(spec)
    ups = [m for m in msgs if m["kind"] == "up"]
    expected = "shm" if transport == "auto" else "collective"
    assert len(ups) == 4 and all(m["transport"] == expected for m in ups), ups
    steps = _steps(msgs)
    assert len(steps) == 16
    weights = make_expert_weights(spec.num_experts, spec.hidden, spec.ffn, spec.seed)
    for m in steps:
        assert len(m["x"]) == spec.tokens_at(m["step"])
        ref = reference_moe(
            _t(m["x"]), _t(m["idx"], torch.int64), _t(m["w"]), weights, spec.hidden, spec.ffn
        )
        torch.testing.assert_close(_t(m["y"]), ref, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def store_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real store: ``mooncake-core master`` plus one process contributing memory."""
    from store_support import Agent, Master

    tmp: Path = tmp_path_factory.mktemp("ep-rejoin-store")
    master = Master(tmp)
    holder = Agent(master.address, segment_size=64 << 20, log=tmp / "holder.log")
    try:
        yield master
    finally:
        holder.stop()
        master.stop()


@pytest.mark.timeout(150)
def test_ep_rejoin_loads_its_experts_from_the_store(store_cluster: Any) -> None:
    # No redundancy: when seat 2 dies nobody else holds its 8 experts. The survivors serve
    # the renormalized reference without them; the restarted seat 2 has no weights, may not
    # take any from a live replica (its live source refuses), reads its experts from the
    # real store, and after it rejoins all four ranks match the full reference again.
    from mooncake_core.store.client import StoreClient

    spec = WorkerSpec(
        slots_per_rank=8,
        kill_seat=2,
        kill_step=2,
        steps=3,
        steps_after_join=3,
        step_sleep_s=0.02,
        store_master=store_cluster.address,
        store_key_prefix=f"ep-rejoin-{uuid.uuid4().hex[:8]}/layer0/experts",
        joiner_live_fetch=False,
    )
    weights = make_expert_weights(spec.num_experts, spec.hidden, spec.ffn, spec.seed)
    # The process that loaded the model saves every expert in the store (it contributes no
    # memory, so the objects live in the store node's segment).
    with StoreClient(master=store_cluster.address, segment_size=0) as writer:
        publisher = StoreWeightSource(writer, spec.store_key_prefix)
        for e in range(spec.num_experts):
            publisher.publish(e, weights[e])
    msgs = _run(spec, restart_killed="after_recovery", deadline_s=110)
    ups = [m for m in msgs if m["kind"] == "up" and m["seat"] == 2]
    assert len(ups) == 2, ups  # first life and the restarted process
    first, rejoined = ups
    lost = set(first["placement"][2 * 8 : 3 * 8])
    assert len(lost) == 8 and -1 not in lost
    # Its experts came from the store, all of them, and from nowhere else.
    assert sorted(e for e, _src in rejoined["transfers_in"]) == sorted(lost), rejoined
    assert all(src == STORE for _e, src in rejoined["transfers_in"]), rejoined
    assert rejoined["store_loads"] == 8 and set(rejoined["held"]) == lost, rejoined
    assert rejoined["reason"] == "join" and rejoined["epoch"] >= 2, rejoined
    # The survivors never needed the store.
    assert all(m["store_loads"] == 0 for m in msgs if m["kind"] == "up" and m["seat"] != 2)
    steps = _steps(msgs)
    everything = set(range(spec.num_experts))
    # live_experts: those of the epoch that served the step
    degraded = [m for m in steps if set(m["live_experts"]) == everything - lost]
    full_again = [
        m
        for m in steps
        if m["step"] > 2
        and m["epoch"] >= rejoined["epoch"]
        and m["live_experts"] == sorted(everything)
    ]
    assert {m["seat"] for m in degraded} == {0, 1, 3}
    assert {m["seat"] for m in full_again} == {0, 1, 2, 3}
    for m in steps:
        live = set(m["live_experts"])
        assert live in (everything, everything - lost), m["step"]
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec, live), atol=ATOL, rtol=RTOL)
    done = {m["seat"]: m for m in msgs if m["kind"] == "done"}
    assert set(done) == {0, 1, 2, 3}
    assert all(d["epoch"] == done[0]["epoch"] for d in done.values())


@pytest.mark.timeout(120)
def test_ep_steps_go_on_without_the_membership_store_and_a_failure_then_fails_clearly() -> None:
    # The TCPStore carries membership only. Once its host dies, steps go on (they never
    # touch it; the leader's join polling tolerates its loss); a rank failure, which needs
    # agreement, then makes every survivor raise MembershipStoreLost instead of hanging.
    spec = WorkerSpec(steps=8, kill_seat=3, kill_step=6, step_sleep_s=0.1)
    msgs = _run(spec, kill_store_after_step=2, allow_errors=True)
    t_store = next(m["t"] for m in msgs if m["kind"] == "store_killed")
    steps = _steps(msgs)
    for seat in range(4):
        done = sorted(m["step"] for m in steps if m["seat"] == seat)
        assert done == list(range(6)), (seat, done)
        assert max(m["t"] for m in steps if m["seat"] == seat) > t_store + 0.15
    for m in steps:
        torch.testing.assert_close(_t(m["y"]), _ref(m, spec), atol=ATOL, rtol=RTOL)
    errors = {m["seat"]: m for m in msgs if m["kind"] == "error"}
    assert set(errors) == {0, 1, 2}, errors
    assert all(
        "MembershipStoreLost" in e["error"] and "unreachable" in e["error"] for e in errors.values()
    )
    t_kill = next(m["t"] for m in msgs if m["kind"] == "killed")
    assert all(e["t"] - t_kill < spec.timeout_s + 1.0 for e in errors.values()), errors
