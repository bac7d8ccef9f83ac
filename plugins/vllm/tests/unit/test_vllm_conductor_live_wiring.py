"""The vLLM live runner of ``bench conductor --live``, without engines.

The run itself (three vLLM servers, two phases, minutes) is a benchmark, not a test; here:
the core finds this adapter's runner through the installed entry point, the per-phase
token shift keeps the slice's sharing exactly, and the hit-rate counters are read the way
vLLM writes them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mooncake_vllm import bench_conductor_live as live

from mooncake_core.bench.conductor_live import find_runner


def test_the_core_finds_the_vllm_runner_through_the_entry_point() -> None:
    engine, runner = find_runner("vllm")
    assert engine == "vllm" and runner is live.run_conductor_live


def test_phase_shift_is_a_bijection_that_keeps_sharing() -> None:
    ids = tuple(range(3, 403))
    for phase in (0, 1, 2, 99):
        shifted = live.shift_tokens(ids, phase)
        assert sorted(shifted) == list(ids)  # a permutation of the same id range
    a, b = (5, 6, 7, 8), (5, 6, 9, 10)
    sa, sb = live.shift_tokens(a, 1), live.shift_tokens(b, 1)
    assert sa[:2] == sb[:2] and sa[2] != sb[2]
    assert live.shift_tokens(a, 0) == list(a)
    assert all(x != y for x, y in zip(live.shift_tokens(a, 1), a, strict=True))


def test_counters_sum_label_sets_and_ignore_other_names() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries",
            "# TYPE vllm:prefix_cache_queries_total counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1200.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 34.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 96.0',
            'vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 560.0',
            'vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9',
        ]
    )
    assert live.parse_counters(text) == {
        "prefix_cache_queries": 1234.0,
        "prefix_cache_hits": 640.0,
        "external_prefix_cache_hits": 96.0,
    }


def test_the_local_baseline_runs_least_load_with_store_loads_off(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """Each phase label becomes its proxy command line (no proxy process is started)."""
    from mooncake_core.bench.conductor_live import LOCAL_BASELINE, LiveSettings

    cmds: list[list[str]] = []

    class _Popen:
        returncode = None

        def __init__(self, cmd: list[str], **kw: Any) -> None:
            cmds.append(cmd)

        def poll(self) -> None:
            return None

    # the runner module's own view of subprocess: patching subprocess.Popen itself also caught
    # processes other tests' threads started meanwhile
    fake = SimpleNamespace(Popen=_Popen, STDOUT=subprocess.STDOUT, DEVNULL=subprocess.DEVNULL)
    monkeypatch.setattr(live, "subprocess", fake)
    monkeypatch.setattr(live, "_get", lambda url, timeout=10.0: b"{}")
    c: Any = object.__new__(live._Cluster)
    c.s = LiveSettings(block_tokens=32, max_prompt_tokens=64, workdir=tmp_path)
    c.prefill = [SimpleNamespace(url="http://p0"), SimpleNamespace(url="http://p1")]
    c.decode = SimpleNamespace(url="http://d0")
    c.events = ["tcp://e0", "tcp://e1"]
    c.store_events, c.master = "tcp://se", "127.0.0.1:1"
    for policy in ("least-load", LOCAL_BASELINE, "global-cache"):
        c.proxy(policy, tmp_path / f"proxy-{policy}.log")
    plain, local, glob = (cmd[cmd.index("proxy") + 1 :] for cmd in cmds)
    at = local.index("--policy")
    assert local[at : at + 4] == ["--policy", "least-load", "--store-loads", "off"]
    assert "--store-loads" not in plain and "--store-loads" not in glob
    assert plain[plain.index("--policy") + 1] == "least-load"
    assert glob[glob.index("--policy") + 1] == "global-cache"
