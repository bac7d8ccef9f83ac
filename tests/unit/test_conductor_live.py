"""``bench conductor --live`` without engines: the trace slice and the wiring to an adapter.

What runs the engines is an adapter's runner (the vLLM one needs three vLLM servers and
minutes, so it is run as a benchmark, not here). These tests cover what the core does:
the scaled slice keeps the trace's prefix sharing exactly, the arguments reach the runner,
the figures and JSON keys come out of its results, and without an adapter the command
stops with one line. The runner used for the wiring is a stand-in returning fixed
results (named as such below).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_core.bench import conductor, conductor_live
from mooncake_core.bench.conductor_live import (
    LiveRequest,
    LiveSettings,
    PhaseResult,
    ideal_hit_rate,
    live_slice,
    summarize,
)
from mooncake_core.conductor.trace import Request, load_trace

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "conversation_excerpt.jsonl"


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_slice_keeps_the_traces_prefix_sharing_as_token_prefixes() -> None:
    trace = load_trace(EXCERPT)
    bt, mb = 16, 8
    reqs = live_slice(trace, requests=24, block_tokens=bt, max_blocks=mb, duration_s=30.0)
    assert len(reqs) == 24
    by_rid = {r.rid: r for r in trace}
    shared_pairs = 0
    for i, a in enumerate(reqs):
        src = by_rid[a.rid]
        assert a.blocks == src.blocks[:mb]
        assert len(a.prompt) == len(a.blocks) * bt + bt // 2  # blocks, then its own tail
        assert all(3 <= t < 403 for t in a.prompt)
        for b in reqs[i + 1 :]:
            blocks = _common(a.blocks, b.blocks)
            tokens = _common(a.prompt, b.prompt)
            # equal leading hash ids <=> equal leading token blocks, and no more than that
            assert tokens // bt == blocks, (a.rid, b.rid, blocks, tokens)
            shared_pairs += blocks >= 2
    assert shared_pairs >= 5  # multi-turn conversations: turns share more than the system block
    # every conversation of the slice has several turns (whole conversations are taken)
    turns: dict[int, int] = {}
    for r in reqs:
        turns[r.conversation] = turns.get(r.conversation, 0) + 1
    assert sum(1 for n in turns.values() if n >= 2) >= len(turns) - 1
    # arrivals: trace order, compressed linearly onto [0, duration]
    arr = [r.arrival_s for r in reqs]
    assert arr == sorted(arr) and arr[0] == 0.0 and arr[-1] == pytest.approx(30.0)
    src_t = [by_rid[r.rid].arrival_s for r in reqs]
    scale = 30.0 / (src_t[-1] - src_t[0])
    assert all(
        x == pytest.approx((t - src_t[0]) * scale, abs=2e-3)
        for x, t in zip(arr, src_t, strict=True)
    )
    # deterministic
    again = live_slice(trace, requests=24, block_tokens=bt, max_blocks=mb, duration_s=30.0)
    assert again == reqs


def test_slice_errors_are_one_line() -> None:
    trace = load_trace(EXCERPT)
    with pytest.raises(ValueError, match="has only .* requests in multi-turn"):
        live_slice(trace, requests=500, block_tokens=16, max_blocks=8, duration_s=10)
    with pytest.raises(ValueError, match="block_tokens >= 1"):
        live_slice(trace, requests=10, block_tokens=0, max_blocks=8, duration_s=10)


def test_ideal_hit_rate_counts_whole_prefixes_only() -> None:
    # (1,2,3) then (1,2,4): 2 of 3 hit; then (9,2): 2 is behind another prefix, a miss
    assert ideal_hit_rate([(1, 2, 3), (1, 2, 4), (9, 2)]) == pytest.approx(2 / 8)
    assert ideal_hit_rate([]) == 0.0


def test_summarize_gives_the_ratio_and_hit_rates() -> None:
    res = {
        "global-cache": PhaseResult(
            ttft_s=[0.1, 0.2, 0.3, 1.0],
            prompt_tokens=1000,
            prefix_hit_tokens=500,
            store_hit_tokens=100,
            routed={"a": 2, "b": 2},
        ),
        "least-load": PhaseResult(
            ttft_s=[0.2, 0.4, 0.6, 0.8], errors=1, prompt_tokens=1000, store_hit_tokens=300
        ),
    }
    fig = summarize(res)
    assert fig["live_mean_ttft_s_global_cache"] == pytest.approx(0.4)
    assert fig["live_mean_ttft_s_least_load"] == pytest.approx(0.5)
    assert fig["live_mean_ttft_ratio_global_vs_least"] == pytest.approx(0.8)
    assert fig["live_p50_ttft_s_global_cache"] == pytest.approx(0.2)
    assert fig["live_p99_ttft_s_global_cache"] == pytest.approx(1.0)
    assert fig["live_prefix_hit_rate_global_cache"] == pytest.approx(0.5)
    assert fig["live_store_hit_rate_global_cache"] == pytest.approx(0.1)
    assert fig["live_store_hit_rate_least_load"] == pytest.approx(0.3)
    assert fig["live_errors_least_load"] == 1
    assert "live_mean_ttft_ratio_floor" not in fig  # no turn split: no floor
    # first turns 0.2 + 0.4 of least-load's 2.0 s: no routing can go below 0.3
    res["least-load"].notes["first_turns_ttft_sum_s"] = 0.6
    assert summarize(res)["live_mean_ttft_ratio_floor"] == pytest.approx(0.3)
    # a phase with no answer has no TTFT and no ratio (never a division by zero)
    fig = summarize({"global-cache": PhaseResult(), "least-load": PhaseResult(ttft_s=[1.0])})
    assert fig["live_mean_ttft_ratio_global_vs_least"] is None


def test_summarize_adds_the_local_baseline_ratios_only_when_it_ran() -> None:
    res = {
        "global-cache": PhaseResult(ttft_s=[0.2, 0.4], prompt_tokens=100, store_hit_tokens=30),
        "least-load": PhaseResult(ttft_s=[0.4, 0.6], prompt_tokens=100, store_hit_tokens=20),
    }
    fig = summarize(res)
    assert not [k for k in fig if "least_local" in k or "least_load_local" in k]
    res["least-load-local"] = PhaseResult(
        ttft_s=[0.5, 0.7, 0.9], prompt_tokens=200, prefix_hit_tokens=50, routed={"a": 3}
    )
    res["global-cache"].notes["later_turns_mean_ttft_s"] = 0.3
    res["least-load-local"].notes["later_turns_mean_ttft_s"] = 0.6
    fig = summarize(res)
    assert fig["live_mean_ttft_s_least_load_local"] == pytest.approx(0.7)
    assert fig["live_mean_ttft_ratio_global_vs_least_local"] == pytest.approx(0.3 / 0.7, abs=1e-3)
    assert fig["live_p50_ttft_ratio_global_vs_least_local"] == pytest.approx(0.2 / 0.7, abs=1e-3)
    assert fig["live_later_turns_ttft_ratio_global_vs_least_local"] == pytest.approx(0.5)
    assert fig["live_prefix_hit_rate_least_load_local"] == pytest.approx(0.25)
    assert fig["live_store_hit_rate_least_load_local"] == 0.0
    assert fig["live_answered_least_load_local"] == 3
    # the existing figure is unchanged by the extra phases
    assert fig["live_mean_ttft_ratio_global_vs_least"] == pytest.approx(0.6)
    assert fig["live_mean_ttft_s_least_load"] == pytest.approx(0.5)
    # an unanswered baseline: no ratio, no division by zero
    res["least-load-local"] = PhaseResult()
    assert summarize(res)["live_mean_ttft_ratio_global_vs_least_local"] is None


def _no_entry_points(**kw: Any) -> list[Any]:
    return []


def test_live_without_an_adapter_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(conductor_live, "entry_points", _no_entry_points)
    rc = conductor.main(["--live", "--trace", str(EXCERPT)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 2
    assert out == [
        "mooncake-core: error: bench conductor --live: no installed engine adapter provides a "
        "live runner (entry point 'bench.conductor-live-ENGINE' in group 'mooncake_core.cli'); "
        "install an engine adapter"
    ]


# Stand-in runner for the wiring test only: no engine runs; fixed TTFTs per policy.
_SEEN: dict[str, Any] = {}


def run_conductor_live(requests: list[LiveRequest], settings: LiveSettings) -> dict[str, Any]:
    _SEEN.update(requests=requests, settings=settings)
    ttft = {"global-cache": [0.3, 0.3], "least-load": [0.5, 0.5], "least-load-local": [0.6, 0.6]}
    return {
        p: PhaseResult(ttft_s=ttft[p], prompt_tokens=100, prefix_hit_tokens=40, routed={"a": 2})
        for p in settings.policies
    }


def test_live_wiring_arguments_reach_the_runner_and_json_comes_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ep = SimpleNamespace(name="bench.conductor-live-fake", value=f"{__name__}:main")
    monkeypatch.setattr(conductor_live, "entry_points", lambda **kw: [ep])
    rc = conductor.main(
        ["--live", "--quick", "--json", "--trace", str(EXCERPT), "--requests", "12"]
        + ["--duration", "20", "--block-tokens", "16", "--max-blocks", "6"]
        + ["--order", "least-load,global-cache", "--workdir", str(tmp_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    fig = json.loads(out[-1])
    assert fig["live_engine"] == "fake" and fig["live_requests"] == 12
    assert fig["live_mean_ttft_ratio_global_vs_least"] == pytest.approx(0.6)
    for k in ("global_cache", "least_load"):
        for name in ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "prefix_hit_rate"):
            assert f"live_{name}_{k}" in fig
        assert fig[f"live_store_hit_rate_{k}"] == 0.0
    assert fig["live_order"] == ["least-load", "global-cache"]
    assert any("live_mean_ttft_ratio_global_vs_least = 0.6" in line for line in out)
    s: LiveSettings = _SEEN["settings"]
    assert s.quick and s.block_tokens == 16 and s.workdir == tmp_path
    assert s.policies == ("least-load", "global-cache")
    reqs: list[LiveRequest] = _SEEN["requests"]
    assert len(reqs) == 12 and max(len(r.blocks) for r in reqs) <= 6
    assert reqs[-1].arrival_s == pytest.approx(20.0)
    assert s.max_prompt_tokens == max(len(r.prompt) for r in reqs)


def test_live_bad_order_and_unknown_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ep = SimpleNamespace(name="bench.conductor-live-fake", value=f"{__name__}:main")
    monkeypatch.setattr(conductor_live, "entry_points", lambda **kw: [ep])
    assert conductor.main(["--live", "--trace", str(EXCERPT), "--engine", "nope"]) == 2
    assert "no live runner for engine 'nope'; installed: fake" in capsys.readouterr().out
    assert conductor.main(["--live", "--trace", str(EXCERPT), "--order", "least-load"]) == 2
    assert "--order must name global-cache and least-load" in capsys.readouterr().out


def test_local_baseline_phases_run_in_the_same_rounds_and_are_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ep = SimpleNamespace(name="bench.conductor-live-fake", value=f"{__name__}:main")
    monkeypatch.setattr(conductor_live, "entry_points", lambda **kw: [ep])
    base = ["--live", "--json", "--trace", str(EXCERPT), "--requests", "12", "--duration", "20"]
    base += ["--workdir", str(tmp_path)]
    assert conductor.main([*base, "--local-baseline", "--rounds", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    fig = json.loads(out[-1])
    assert fig["live_order"] == [
        "global-cache",
        "least-load",
        "least-load-local",
        "least-load-local",
        "least-load",
        "global-cache",
    ]
    assert _SEEN["settings"].policies == tuple(fig["live_order"])
    assert fig["live_mean_ttft_ratio_global_vs_least"] == pytest.approx(0.6)
    assert fig["live_mean_ttft_ratio_global_vs_least_local"] == pytest.approx(0.5)
    assert fig["live_prefix_hit_rate_least_load_local"] == pytest.approx(0.4)
    assert any(line.startswith("least-load-local ") for line in out)  # its table row
    assert any("live_mean_ttft_ratio_global_vs_least_local = 0.5" in line for line in out)
    # with the flag --order may place it; without, naming it is an error
    order = ["--order", "least-load-local,global-cache,least-load"]
    assert conductor.main([*base, "--local-baseline", *order]) == 0
    fig = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fig["live_order"] == ["least-load-local", "global-cache", "least-load"]
    assert conductor.main([*base, *order]) == 2
    assert "--order must name global-cache and least-load, got" in capsys.readouterr().out
    assert conductor.main([*base, "--local-baseline", "--order", "least-load-local"]) == 2
    assert "(and least-load-local with --local-baseline)" in capsys.readouterr().out
    # without the flag: the two policies only, and no local-baseline figures
    assert conductor.main(base) == 0
    fig = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fig["live_order"] == ["global-cache", "least-load"]
    assert "live_mean_ttft_ratio_global_vs_least_local" not in fig


def test_request_type_is_what_the_slice_reads() -> None:
    # the slice keys conversations by the second hash id; a one-block request has none
    trace = [Request(i, float(i), 10, 1, (0,)) for i in range(5)]
    with pytest.raises(ValueError, match="has only 0 requests"):
        live_slice(trace, requests=2, block_tokens=4, max_blocks=4, duration_s=1)


def _req(rid: int, conv: int, blocks: tuple[int, ...]) -> LiveRequest:
    return LiveRequest(rid, float(rid), (), 2, blocks, conv)


def test_routing_summary_turns_and_phases_from_decision_records() -> None:
    # conversation 7: turns 1 and 3 share 3 blocks; conversation 8 shares only block 0
    reqs = [_req(1, 7, (0, 1, 2)), _req(2, 8, (0, 5)), _req(3, 7, (0, 1, 2, 3))]
    tag = conductor_live.request_tag

    def rec(phase: int, rid: int, r: LiveRequest, inst: int, **kw: Any) -> dict[str, Any]:
        return {"phase": phase, "rid": rid, "tag": tag(r), "prefill": inst, "prefill_s": 1.0, **kw}

    decisions = [
        # phase 0: turn 3 follows its prefix to instance 0; the index and the events agree
        rec(0, 1, reqs[0], 0),
        rec(0, 2, reqs[1], 1),
        rec(0, 3, reqs[2], 0, local=[3, 1], events=[3, 0]),
        # phase 1 (its own caches): turn 3 goes elsewhere; the events never matched
        rec(1, 2, reqs[1], 1),
        rec(1, 1, reqs[0], 0),
        rec(1, 3, reqs[2], 1, local=[0, 3], events=[0, 0]),
        {"rid": 9, "tag": "someone-else", "prefill": 0},  # not the bench's: ignored
    ]
    s = conductor_live.routing_summary(reqs, decisions)
    assert s["routing_records"] == 6
    assert s["prefix_available"] == 2 and s["prefix_followed"] == 1
    assert s["events_confirmed"] == 0.5  # the decision log catches events that never match
    assert s["prefill_leg_mean_s"] == 1.0
    t = conductor_live.turn_split(
        reqs, [(tag(reqs[0]), 2.0), (tag(reqs[1]), 4.0), (tag(reqs[2]), 0.5)]
    )
    assert t == {
        "first_turns_mean_ttft_s": 3.0,
        "later_turns_mean_ttft_s": 0.5,
        "first_turns_ttft_sum_s": 6.0,
    }
    assert conductor_live.phase_order(["a", "b"], 3) == ("a", "b", "b", "a", "a", "b")
    m = conductor_live.merge_phases(
        [
            PhaseResult(
                ttft_s=[1.0], routed={"u": 1}, notes={"kv_events": 2}, tagged_ttft=[("x", 1.0)]
            ),
            PhaseResult(ttft_s=[3.0], routed={"u": 2, "v": 1}, notes={"kv_events": 3}),
        ]
    )
    assert m.ttft_s == [1.0, 3.0] and m.routed == {"u": 3, "v": 1} and m.notes["kv_events"] == 5
    assert m.tagged_ttft == [("x", 1.0)]
