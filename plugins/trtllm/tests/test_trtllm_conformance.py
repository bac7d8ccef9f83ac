"""mooncake-trtllm's store connector passes the adapter conformance suite.

FAKE: TensorRT-LLM cannot run here (it cannot be installed: no CUDA, and its wheel comes
from NVIDIA's index). The suite drives the connector's real scheduler and worker classes
in TensorRT-LLM 1.2's call order, with the smallest stand-ins for TensorRT-LLM's request,
scheduler-output and ``llm_args`` types (``mooncake_trtllm.testing.standins``), on a
pool tensor of TensorRT-LLM's block-major primary-pool shape, against a real master and
memory node (see ``mooncake_trtllm.testing.harness``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from mooncake_conformance import AdapterContract, KVLayout, adapter_fixtures  # noqa: E402

BASE = KVLayout(
    "block_major", num_layers=4, page_size=16, num_kv_heads=4, head_dim=32, num_slots=24
)
# One primary-pool layout; MLA is left out: the connector stores one copy per TP rank.
LAYOUTS = [BASE, BASE.replace(tp_size=2)]


TrtllmFixtures = adapter_fixtures(
    "trtllm",
    "mooncake_trtllm.testing.harness:make_harness",
    LAYOUTS,
    adapter_package="mooncake_trtllm",
    harness_options={"lookup_timeout_s": 2.0, "retry_after_s": 1.0},
    no_migration_reason="the TensorRT-LLM adapter is a KV cache (store) connector only; "
    "it has no PD migration backend",
)


class TestTrtllmStore(AdapterContract, TrtllmFixtures):  # type: ignore[valid-type,misc]
    """The store connector's scheduler and worker halves in one process per rank."""
