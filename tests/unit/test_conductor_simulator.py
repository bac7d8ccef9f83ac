"""Simulator: exact single-request timing, determinism, policy ordering, rejection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncake_core.conductor.costmodel import CostModel
from mooncake_core.conductor.scheduler import ConductorConfig
from mooncake_core.conductor.simulator import DEFAULT_CLUSTER, simulate
from mooncake_core.conductor.trace import Request, load_trace
from mooncake_core.errors import ConfigError

FULL_TRACE = Path(
    os.environ.get("MOONCAKE_TRACE_DIR", Path(__file__).resolve().parents[3] / "shared" / "traces")
) / ("conversation_trace.jsonl")


def conversations(n_conv: int = 24, turns: int = 5, gap: float = 0.25) -> list[Request]:
    """Multi-turn chats: each turn re-sends the previous turns plus 6 new blocks."""
    reqs: list[Request] = []
    nxt = 1000
    chains = [[0] + list(range(c * 100 + 1, c * 100 + 13)) for c in range(n_conv)]
    t = 0.0
    for _ in range(turns):
        for c in range(n_conv):
            chains[c] = chains[c] + list(range(nxt, nxt + 6))
            nxt += 6
            reqs.append(Request(len(reqs), t, 512 * len(chains[c]), 64, tuple(chains[c])))
            t += gap
    return reqs


def cfg(policy: str, n_prefill: int = 4, **kw: object) -> ConductorConfig:
    options: dict[str, object] = {"cache_blocks": 300, "store_blocks": 0, **kw}
    return ConductorConfig(n_prefill, 2, policy, **options)  # type: ignore[arg-type]


def test_single_request_timing_is_exact() -> None:
    cost = CostModel()
    r = Request(0, 0.0, 10_000, 101, tuple(range(20)))
    res = simulate([r], ConductorConfig(1, 1, "least-load"))
    assert res.ttft_s[0] == pytest.approx(cost.prefill_s(10_000))
    a, b, c = cost.decode_coeffs()
    steps = 100 * (a + b + c * 10_000) + c * 100 * 100 / 2
    assert res.tbt_s[0] == pytest.approx((cost.handoff_s(10_000) + steps) / 100, rel=1e-9)


def test_decode_capacity_makes_requests_wait() -> None:
    from mooncake_core.conductor.costmodel import CostProfile

    small = CostProfile(decode_kv_tokens=25_000)
    reqs = [Request(i, 0.0, 10_000, 200, (i,)) for i in range(3)]
    roomy = simulate(reqs, ConductorConfig(3, 1, "least-load"))
    tight = simulate(reqs, ConductorConfig(3, 1, "least-load"), small)
    assert tight.tbt_s.max() > 1.5 * roomy.tbt_s.max()


def test_replay_is_deterministic_with_a_seed() -> None:
    reqs = conversations()
    one = simulate(reqs, cfg("random", seed=3)).metrics()
    two = simulate(reqs, cfg("random", seed=3)).metrics()
    other = simulate(reqs, cfg("random", seed=4)).metrics()
    for m in (one, two, other):
        m.pop("wall_s")
    assert one == two
    assert one != other


def test_cache_aware_policies_win_on_multi_turn_chats() -> None:
    reqs = conversations()
    m = {
        p: simulate(reqs, cfg(p, n_prefill=4)).metrics()
        for p in ("least-load", "local-cache", "global-cache")
    }
    assert (
        m["global-cache"]["hit_rate"] >= m["local-cache"]["hit_rate"] > m["least-load"]["hit_rate"]
    )
    assert (
        m["global-cache"]["mean_ttft_s"]
        <= m["local-cache"]["mean_ttft_s"]
        < m["least-load"]["mean_ttft_s"]
    )


def test_rejection_raises_goodput_under_overload() -> None:
    reqs = conversations(gap=0.05)
    off = simulate(reqs, cfg("global-cache", n_prefill=2, slo_ttft_s=5.0)).metrics()
    on = simulate(reqs, cfg("global-cache", n_prefill=2, slo_ttft_s=5.0, reject=True)).metrics()
    assert on["rejected"] > 0 and off["rejected"] == 0
    assert on["goodput_rps"] > off["goodput_rps"]
    assert on["p99_ttft_s"] <= 5.0


def test_empty_request_list() -> None:
    with pytest.raises(ConfigError, match="empty"):
        simulate([], ConductorConfig(1, 1))


def test_metrics_keys() -> None:
    m = simulate(conversations(4, 2), cfg("global-cache")).metrics()
    for key in (
        "mean_ttft_s",
        "p90_ttft_s",
        "mean_tbt_s",
        "slo_attainment",
        "goodput_rps",
        "hit_rate",
        "rejected",
    ):
        assert key in m


@pytest.mark.slow
@pytest.mark.skipif(not FULL_TRACE.is_file(), reason="full conversation trace not available")
def test_full_conversation_trace_matches_the_paper_ordering() -> None:
    d = DEFAULT_CLUSTER
    reqs = load_trace(FULL_TRACE)
    ttft = {}
    for p in ("global-cache", "local-cache", "least-load", "random"):
        res = simulate(
            reqs, ConductorConfig(d.n_prefill, d.n_decode, p, cache_blocks=d.cache_blocks)
        )
        ttft[p] = res.metrics()["mean_ttft_s"]
    assert ttft["global-cache"] < ttft["local-cache"] < ttft["least-load"] < ttft["random"]
    assert ttft["global-cache"] <= 0.6 * ttft["least-load"]
    assert ttft["global-cache"] <= 0.9 * ttft["local-cache"]


@pytest.mark.slow
@pytest.mark.skipif(not FULL_TRACE.is_file(), reason="full conversation trace not available")
def test_full_trace_overload_rejection_raises_goodput() -> None:
    d = DEFAULT_CLUSTER
    reqs = load_trace(FULL_TRACE, speedup=2.0)
    good = {}
    for reject in (False, True):
        c = ConductorConfig(
            d.n_prefill, d.n_decode, "global-cache", reject=reject, cache_blocks=d.cache_blocks
        )
        good[reject] = simulate(reqs, c, speedup=2.0).metrics()["goodput_rps"]
    assert good[True] > 2 * good[False]
