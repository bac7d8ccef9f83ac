"""Trace loading, bad input, and the simulate / conductor fit / bench commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_core.cli import main
from mooncake_core.conductor.trace import load_trace, parse_trace_lines
from mooncake_core.errors import ConfigError, TraceError

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "conversation_excerpt.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'


def test_excerpt_loads_with_its_license() -> None:
    reqs = load_trace(EXCERPT)
    assert len(reqs) == 300
    assert reqs[0].blocks[0] == 0 and reqs[-1].arrival_s == pytest.approx(102.0)
    assert (EXCERPT.parent / "LICENSE-APACHE").is_file() and (EXCERPT.parent / "NOTICE").is_file()
    assert load_trace(EXCERPT, speedup=2.0)[-1].arrival_s == pytest.approx(51.0)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "output_length": 5, "hash_ids": []}', "missing field 'input_length'"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 5, "hash_ids": []}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": "10", "output_length": 5, "hash_ids": []}',
            "input_length",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1, "x"]}',
            "hash_ids",
        ),
    ],
)
def test_malformed_line_names_its_line_number(bad: str, match: str) -> None:
    with pytest.raises(TraceError, match=match) as info:
        parse_trace_lines([GOOD, "", bad, GOOD], "t.jsonl")
    assert "t.jsonl:3:" in str(info.value)
    assert isinstance(info.value, (ConfigError, ValueError))


def test_empty_and_missing_traces(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="empty"):
        load_trace(empty)
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="speedup"):
        parse_trace_lines([GOOD], speedup=0)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["--log-level", "WARNING", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_simulate_replays_the_excerpt(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(
        capsys,
        "simulate",
        "--trace",
        str(EXCERPT),
        "--policy",
        "all",
        "--prefill",
        "2",
        "--decode",
        "1",
        "--json",
    )
    assert rc == 0
    runs = json.loads(out.strip().splitlines()[-1])["runs"]
    assert [r["policy"] for r in runs] == ["random", "least-load", "local-cache", "global-cache"]
    for r in runs:
        assert r["requests"] == 300 and r["rejected"] == 0
        for key in (
            "mean_ttft_s",
            "p90_ttft_s",
            "mean_tbt_s",
            "slo_attainment",
            "goodput_rps",
            "hit_rate",
        ):
            assert r[key] >= 0
    rc, out, _ = run_cli(
        capsys, "simulate", "--trace", str(EXCERPT), "--prefill", "2", "--decode", "1"
    )
    assert rc == 0 and "global-cache" in out and "TTFT mean" in out


def test_simulate_overload_with_and_without_rejection(capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "simulate",
        "--trace",
        str(EXCERPT),
        "--prefill",
        "2",
        "--decode",
        "1",
        "--speedup",
        "2",
        "--json",
    ]
    off = json.loads(run_cli(capsys, *base, "--no-reject")[1].splitlines()[-1])
    on = json.loads(run_cli(capsys, *base, "--reject")[1].splitlines()[-1])
    assert on["rejected"] > 0 and on["goodput_rps"] > off["goodput_rps"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prefill", "0"], "prefill instance"),
        (["--decode", "0"], "decode instance"),
        (["--slo-ttft", "-1"], "slo_ttft_s"),
        (["--slo-tbt", "-0.5"], "slo_tbt_s"),
        (["--policy", "fastest"], "unknown policy"),
        (["--speedup", "0"], "speedup"),
    ],
)
def test_simulate_bad_arguments(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    rc, _, err = run_cli(capsys, "simulate", "--trace", str(EXCERPT), *extra)
    assert rc == 2 and message in err


def test_simulate_bad_traces(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n" + GOOD + "\n" + '{"timestamp": 1, "input_length": 5\n')
    rc, _, err = run_cli(capsys, "simulate", "--trace", str(bad))
    assert rc == 2 and "bad.jsonl:3:" in err
    bad.write_text("")
    rc, _, err = run_cli(capsys, "simulate", "--trace", str(bad))
    assert rc == 2 and "empty" in err


def test_simulate_writes_plots(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rc, _, _ = run_cli(
        capsys,
        "simulate",
        "--trace",
        str(EXCERPT),
        "--policy",
        "least-load,global-cache",
        "--limit",
        "120",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert rc == 0
    for name in ("ttft_cdf.png", "hit_rate.png", "queue_length.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_conductor_fit_and_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rows = [
        {"input_len": n, "cached_len": 0, "prefill_s": 0.01 + 1e-4 * n}
        for n in (1000, 2000, 4000, 8000)
    ]
    meas = tmp_path / "m.jsonl"
    meas.write_text("\n".join(json.dumps(r) for r in rows))
    prof = tmp_path / "prof.json"
    rc, out, _ = run_cli(
        capsys, "conductor", "fit", "--input", str(meas), "--output", str(prof), "--json"
    )
    assert rc == 0
    rep = json.loads(out.splitlines()[-1])
    assert rep["prefill_samples"] == 4 and rep["profile"]["prefill_c1"] == pytest.approx(
        1e-4, rel=1e-6
    )
    rc, out, _ = run_cli(capsys, "conductor", "profile", "--profile", str(prof))
    assert rc == 0 and json.loads(out)["prefill_c1"] == pytest.approx(1e-4, rel=1e-6)
    rc, _, err = run_cli(
        capsys, "simulate", "--trace", str(EXCERPT), "--limit", "20", "--profile", str(prof)
    )
    assert rc == 0
    rc, _, err = run_cli(capsys, "conductor", "fit", "--input", str(tmp_path / "missing.csv"))
    assert rc == 2 and "missing.csv" in err


def test_bench_conductor_json(capsys: pytest.CaptureFixture[str]) -> None:
    from mooncake_core.bench.conductor import main as bench_main

    assert bench_main(["--trace", str(EXCERPT), "--decisions", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "decide_us_8",
        "decide_us_64",
        "decide_us_512",
        "replay_req_per_s",
        "mean_ttft_s_global-cache",
        "mean_ttft_s_random",
    ):
        assert key in out
