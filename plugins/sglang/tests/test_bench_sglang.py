"""``mooncake-core bench sglang`` runs end to end and prints its JSON (one round).

With the scratch venv set up by ``scripts/setup_mooncake_peer.sh --sglang`` the
comparison with SGLang's built-in backend on the published wheel runs too (skipped,
saying why, otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup.sh)"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PEER = Path(__file__).resolve().parents[3] / ".scratch" / "mooncake-venv" / "bin" / "python"
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "published" / "_mooncake_sglang.py"


def _bench(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake_core",
            "bench",
            "sglang",
            "--rounds",
            "1",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def test_bench_ours() -> None:
    r = _bench()
    assert r["pages"] == 64 and r["page_bytes"] == 2 << 20
    for k in ("set_gbps", "get_gbps", "pages_per_s", "set_pages_per_s"):
        assert r[k] > 0


def test_bench_against_the_published_backend() -> None:
    if not PEER.is_file():
        pytest.skip("no scratch venv; run scripts/setup_mooncake_peer.sh --sglang")
    chk = subprocess.run(
        [str(PEER), str(BENCH), "check"], capture_output=True, text=True, timeout=300
    )
    if chk.returncode != 0:
        pytest.skip(
            "SGLang is not installed next to the published wheel; "
            "run scripts/setup_mooncake_peer.sh --sglang"
        )
    r = _bench("--transport", "tcp", "--compare-mooncake", str(PEER))
    for k in ("set_gbps", "get_gbps", "pages_per_s"):
        assert r[f"mooncake_{k}"] > 0
        assert r[f"{k}_ratio_vs_mooncake"] == pytest.approx(r[k] / r[f"mooncake_{k}"], rel=0.01)
