"""Cost model: the estimator's shape, profile loading and fitting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_core.conductor.costmodel import (
    DEFAULT_PROFILE,
    CostModel,
    CostProfile,
    fit_profile,
    load_measurements,
    load_profile,
)
from mooncake_core.errors import ConfigError


def test_prefill_is_quadratic_in_new_work() -> None:
    p = CostProfile(prefill_c0=0.5, prefill_c1=0.01, prefill_c2=0.001)
    m = CostModel(p)
    assert m.prefill_s(100) == pytest.approx(0.5 + 1.0 + 10.0)
    assert m.prefill_s(100, 60) == pytest.approx(0.5 + 0.4 + 0.001 * (10000 - 3600))
    # At least one token is always computed.
    assert m.prefill_s(100, 100) == pytest.approx(m.prefill_s(100, 99))


def test_prefill_monotone_and_cache_helps() -> None:
    m = CostModel()
    assert m.prefill_s(8192) < m.prefill_s(16384)
    assert m.prefill_s(16384, 8192) < m.prefill_s(16384)
    # Default calibration: a 12k-token prompt takes 1-3 s on one 8 x A800 node.
    assert 1.0 < m.prefill_s(12_000) < 3.0


def test_vectorised_prefill_matches_scalar() -> None:
    import numpy as np

    m = CostModel()
    cached = np.array([0, 512, 4096, 20000])
    assert m.prefill_s_array(10_000, cached).tolist() == pytest.approx(
        [m.prefill_s(10_000, int(c)) for c in cached]
    )


def test_transfer_and_decode() -> None:
    m = CostModel()
    p = DEFAULT_PROFILE
    assert m.transfer_s(0) == 0.0
    blk = p.block_tokens * p.kv_bytes_per_token
    assert m.transfer_s(10) == pytest.approx(
        p.transfer_latency_s + 10 * blk / (p.transfer_gbps * 1e9)
    )
    # Fetching a prefix is much cheaper than recomputing it (the premise of the pool).
    assert m.transfer_s(20) < 0.5 * (m.prefill_s(20 * 512) - m.prefill_s(1))
    assert m.decode_step_s(1, 1000) < m.decode_step_s(32, 1000) < m.decode_step_s(32, 400_000)


def test_profile_round_trip_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"prefill_c1": 2e-4, "transfer_gbps": 40}))
    prof = load_profile(f)
    assert prof.prefill_c1 == 2e-4 and prof.transfer_gbps == 40.0
    assert prof.block_tokens == 512
    assert load_profile(None) is DEFAULT_PROFILE
    f.write_text(json.dumps({"prefil_c1": 1}))
    with pytest.raises(ConfigError, match="prefill_c1"):
        load_profile(f)
    f.write_text(json.dumps({"transfer_gbps": -1}))
    with pytest.raises(ConfigError, match="transfer_gbps"):
        load_profile(f)
    with pytest.raises(ConfigError, match="not found"):
        load_profile(tmp_path / "missing.json")


def test_fit_recovers_coefficients(tmp_path: Path) -> None:
    truth = CostModel(
        CostProfile(
            prefill_c0=0.05,
            prefill_c1=2e-4,
            prefill_c2=2e-9,
            decode_a=0.02,
            decode_b=3e-4,
            decode_c=4e-8,
        )
    )
    rows = []
    for n, p in [
        (1000, 0),
        (4000, 0),
        (8000, 4000),
        (16000, 0),
        (32000, 16000),
        (64000, 0),
        (500, 0),
    ]:
        rows.append({"input_len": n, "cached_len": p, "prefill_s": truth.prefill_s(n, p)})
    for b, c in [(1, 1000), (8, 80_000), (32, 300_000), (64, 900_000), (16, 10_000)]:
        rows.append({"batch": b, "context_tokens": c, "step_s": truth.decode_step_s(b, c)})
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    rep = fit_profile(load_measurements(f))
    assert rep.prefill_samples == 7 and rep.decode_samples == 5
    assert rep.profile.prefill_c1 == pytest.approx(2e-4, rel=1e-3)
    assert rep.profile.prefill_c2 == pytest.approx(2e-9, rel=1e-3)
    assert rep.profile.decode_c == pytest.approx(4e-8, rel=1e-3)
    assert rep.prefill_rel_err < 1e-6


def test_fit_rejects_unusable_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no usable"):
        fit_profile([{"foo": 1}])
    f = tmp_path / "bad.jsonl"
    f.write_text('{"input_len": 1, "prefill_s": 1}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_measurements(f)
