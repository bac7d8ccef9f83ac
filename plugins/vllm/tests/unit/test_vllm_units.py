"""Unit tests of the vLLM adapter that need no running engine."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.common import Counters, option
from vllm_helpers import HAVE_VLLM


def test_adapter_entry_point_does_not_import_vllm() -> None:
    code = (
        "import sys, mooncake_vllm.adapter as a; info = a.mooncake_adapter_info(); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules); "
        "print(info.status)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_counters_file(tmp_path: Path) -> None:
    c = Counters("x", str(tmp_path))
    c.add(a=1, b=2)
    c.add(a=1)
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["a"] == 2 and data["b"] == 2


def test_option_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_VLLM_SEND_TIMEOUT_S", "7")
    assert option({}, "send_timeout_s", 120.0) == 7.0
    assert option({"send_timeout_s": 3}, "send_timeout_s", 120.0) == 3


needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


@needs_vllm
def test_runs_group_consecutive_blocks() -> None:
    from mooncake_vllm.worker import _runs

    assert _runs([4, 5, 6, 9], [10, 11, 12, 13]) == [(4, 10, 3), (9, 13, 1)]
    assert _runs([], []) == []


@needs_vllm
def test_page_chain_is_a_prefix_chain() -> None:
    from mooncake_vllm.store_connector import page_chain

    a = page_chain("m|fp32|4", list(range(12)), 4, 3)
    b = page_chain("m|fp32|4", list(range(8)) + [99, 98, 97, 96], 4, 3)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert page_chain("other", list(range(12)), 4, 3)[0] != a[0]


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: Any = "FINISHED_LENGTH_CAPPED"
    num_prompt_tokens: int = 0


@dataclass
class _Blocks:
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@needs_vllm
def test_pd_scheduler_round_trip() -> None:
    from mooncake_vllm.metadata import PDHandshake
    from mooncake_vllm.scheduler import PDScheduler

    prod = PDScheduler("P", "kv_producer", 4)
    prod.set_handshake({(0, 0): PDHandshake("127.0.0.1:1", {"l0": 4096}, 256, 8)})
    req = _Req("r1", list(range(10)), {"do_remote_decode": True}, num_prompt_tokens=10)
    delay, params = prod.request_finished(req, ([3, 4, 5],))
    assert delay and params is not None and params["remote_block_ids"] == [3, 4, 5]
    assert prod.build_connector_meta(None).sends == {"r1": [3, 4, 5]}
    # aborted requests keep nothing
    aborted = _Req("r2", [1], {"do_remote_decode": True}, status="FINISHED_ABORTED")
    assert prod.request_finished(aborted, ([1],)) == (False, None)

    cons = PDScheduler("D", "kv_consumer", 4)
    dreq = _Req("d1", list(range(10)), dict(params))
    assert cons.get_num_new_matched_tokens(dreq, 4) == (6, True)  # one local 4-token hit
    cons.update_state_after_alloc(dreq, _Blocks([7, 8, 9]), 6)
    (spec,) = cons.build_connector_meta(None).recvs
    assert spec.local_block_ids == [8, 9] and spec.remote_block_ids == [4, 5]
    assert cons.get_num_new_matched_tokens(dreq, 4) == (0, False)  # one fetch per request


@pytest.mark.slow
@needs_vllm
def test_register_is_idempotent_and_names_resolve() -> None:
    # in this process (a subprocess paid 16 s of vLLM imports in CI): vLLM refuses a second
    # registration of a name, so calling register() again, after whatever registered before,
    # proves it idempotent; the entry point itself runs in every real-server test
    from mooncake_vllm.register import register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F

    register()
    register()
    assert sorted(k for k in F._registry if k.startswith("MooncakeCore")) == [
        "MooncakeCoreConnector",
        "MooncakeCoreStoreConnector",
    ]
    for name in ("MooncakeCoreConnector", "MooncakeCoreStoreConnector"):
        assert F.get_connector_class_by_name(name).__name__ == name  # the names resolve


def test_store_keys_carry_tp_size_and_hits_need_every_rank() -> None:
    from types import SimpleNamespace

    from mooncake_vllm.store_connector import _key_prefix, _rank_dir, _StoreScheduler
    from mooncake_vllm.store_keys import tp_size_of

    def vc(tp: int) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(model="/m/tiny", dtype="float32"),
            cache_config=SimpleNamespace(block_size=32),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )

    # rank 0 of a TP=2 engine never shares keys with a TP=1 engine of the same model
    assert _key_prefix(vc(1)) + _rank_dir(0, tp_size_of(vc(1))) != _key_prefix(vc(2)) + _rank_dir(
        0, tp_size_of(vc(2))
    )
    sched = _StoreScheduler(vc(2), {"warm_up": False}, "t")
    asked: list[list[str]] = []

    class Client:
        def batch_exists(self, keys: list[str]) -> list[bool]:
            asked.append(keys)
            return [("tp1of2" not in k) or k.startswith("mcv/tiny/tp1of2/p0/") for k in keys]

    sched.client = Client()
    # page p0 has both ranks' shards, p1 only rank 0's: the hit stops at p1
    assert sched._lookup(["p0", "p1", "p2"]) == 1
    assert asked[0][:2] == ["mcv/tiny/tp0of2/p0/L0", "mcv/tiny/tp1of2/p0/L0"]


def test_mixed_bench_gives_each_server_one_openmp_thread_per_core() -> None:
    # vLLM ignores VLLM_CPU_OMP_THREADS_BIND in-process; OMP_NUM_THREADS must say it
    from mooncake_vllm.bench_mixed import omp_env

    assert omp_env("1") == {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    assert omp_env("0,1")["OMP_NUM_THREADS"] == "2"
