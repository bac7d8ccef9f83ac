"""mooncake-vllm's store connector passes the adapter conformance suite, on vLLM's CPU KV layout.

Drives ``MooncakeCoreStoreConnector``'s scheduler and worker halves the way vLLM calls
them, on KV caches allocated by vLLM's own CPU allocator, against a real master and
memory node; no vLLM engine or model runs (see ``mooncake_vllm.testing.harness``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.worker.utils", reason="vllm is not installed (scripts/setup.sh)")

from mooncake_conformance import AdapterContract, KVLayout, adapter_fixtures  # noqa: E402

# vLLM's CPU attention backend: kernel block sizes are multiples of 32, head sizes from 32.
BASE = KVLayout("LBHNC", num_layers=4, page_size=32, num_kv_heads=4, head_dim=32, num_slots=24)
# The CPU backend offers one KV layout; MLA is left out: the connector stores one copy per TP rank.
LAYOUTS = [BASE, BASE.replace(tp_size=2)]


VLLMFixtures = adapter_fixtures(
    "vllm",
    "mooncake_vllm.testing.harness:make_harness",
    LAYOUTS,
    adapter_package="mooncake_vllm",
    harness_options={"lookup_timeout_s": 2.0, "retry_after_s": 1.0},
    no_migration_reason="vLLM's PD path (MooncakeCoreConnector) is checked end to end on "
    "real vLLM servers in test_vllm_pd.py; it offers no migration pair for this suite yet",
)


class TestVLLMStore(AdapterContract, VLLMFixtures):  # type: ignore[valid-type,misc]
    """The store connector (KV pool), scheduler and worker halves in one process per rank."""
