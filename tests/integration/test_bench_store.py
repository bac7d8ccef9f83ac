"""``mooncake-core bench store``: the JSON contract of issue 3, against the published store when
its venv exists."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from mooncake_core.bench.published import peer
from mooncake_core.bench.store import ratios

default_peer_python = peer().default_peer_python

pytestmark = pytest.mark.slow

KEYS = (
    "put_gbps_16m",
    "get_gbps_16m",
    "batch_put_gbps_32x1m",
    "batch_get_gbps_32x1m",
    "get64k_p50_us",
    "get64k_p99_us",
    "meta_ops_per_s",
    "put_gbps_1m",
    "get_gbps_1m",
    "put_gbps_64m",
    "get_gbps_64m",
    "put_gbps_64k",
    "get_gbps_64k",
    "raw_tcp_put_gbps_1m",
    "raw_tcp_get_gbps_16m",
    "get_vs_memcpy_16m",
    "get_uncached_gbps_1m",
)


def _bench(*args: str, timeout: float = 300) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake_core",
            "bench",
            "store",
            "--quick",
            "--json",
            "--rounds",
            "1",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "store bench (" in out.stdout
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    for k in KEYS:
        assert isinstance(res[k], (int, float)) and res[k] > 0, (k, res.get(k))
    return res


def test_ratios_include_the_bare_socket_ceiling() -> None:
    ours = {
        "put_gbps_1m": 2.0,
        "raw_tcp_put_gbps_1m": 3.0,
        "get64k_p99_us": 400.0,
        "get_gbps_1m": 2.0,
        "get_uncached_gbps_1m": 1.5,
    }
    theirs = {"put_gbps_1m": 1.0, "get64k_p99_us": 500.0, "rounds": 2, "get_gbps_1m": 1.0}
    got = ratios(ours, theirs)
    assert got["get_uncached_gbps_1m_ratio_vs_mooncake"] == 1.5
    assert got["put_gbps_1m_ratio_vs_mooncake"] == 2.0
    assert got["raw_tcp_put_gbps_1m_ratio_vs_mooncake"] == 3.0
    assert got["get64k_p99_us_ratio_vs_mooncake"] == 0.8
    assert got["mooncake_rounds"] == 2 and "rounds_ratio_vs_mooncake" not in got


@pytest.mark.timeout(400)
def test_bench_store_tcp_json_contract_and_published_comparison() -> None:
    peer = default_peer_python()
    res = _bench(*(["--compare-mooncake", peer] if peer else []))
    assert res["transport"] == "tcp"
    if (
        peer is None
    ):  # CI builds the peer venv (make mooncake-peer); without it only our own figures exist
        return
    assert "mooncake_error" not in res, res.get("mooncake_error")
    for k in (
        "put_gbps_16m",
        "get_gbps_16m",
        "put_gbps_1m",
        "batch_get_gbps_32x1m",
        "get64k_p99_us",
    ):
        assert res[f"{k}_ratio_vs_mooncake"] == pytest.approx(
            res[k] / res[f"mooncake_{k}"], rel=0.01, abs=0.002
        )
    for k in ("put_gbps_1m", "get_gbps_1m", "put_gbps_16m", "get_gbps_16m"):
        assert res[f"raw_tcp_{k}_ratio_vs_mooncake"] > 0


@pytest.mark.timeout(300)
def test_bench_store_shm_json_contract() -> None:
    res = _bench("--transport", "shm")
    assert res["transport"] == "shm"
    assert 0 < res["get_vs_memcpy_16m"] < 5
