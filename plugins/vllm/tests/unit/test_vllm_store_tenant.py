"""The store connector's ``tenant`` option (``kv_connector_extra_config``).

A real master (in a thread) with a refusing quota, and the connector's real scheduler and
worker halves, as in ``test_vllm_store_warmup.py``; no engine. Pages saved by an instance
of one tenant are invisible to another tenant's lookups; a tenant's quota holds for the
client the connector builds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_helpers import HAVE_VLLM, connector_extra, thread_master, vllm_config_stub

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


@pytest.fixture()
def master() -> Iterator[Any]:
    from mooncake_core.store.tenants import parse_quotas

    with thread_master(tenant_quotas=parse_quotas(["vt-q=4KB:refuse"])) as m:
        yield m


def test_pages_of_one_tenant_are_invisible_to_another_and_quotas_hold(master: Any) -> None:
    import torch
    from mooncake_vllm.store_connector import _StoreScheduler
    from mooncake_vllm.store_worker import _StoreWorker

    from mooncake_core.errors import NoSpace
    from mooncake_core.store.protocol import InvalidArgument

    kv = {"model.layers.0.self_attn.attn": torch.zeros(4, 2, 32, 64)}
    worker = _StoreWorker(
        vllm_config_stub("/m/tenant"),
        connector_extra(master, segment_size="4MiB", tenant="vt-a", warm_up=False),
        "ta",
        0,
    )
    scheds = [
        _StoreScheduler(vllm_config_stub("/m/tenant"), connector_extra(master, tenant=t), t)
        for t in ("vt-a", "vt-b", "vt-q")
    ]
    plain = _StoreScheduler(vllm_config_stub("/m/tenant"), connector_extra(master), "plain")
    try:
        worker.register_kv_caches(kv)
        assert worker.client is not None and worker.client.tenant == "vt-a"
        sa, sb, sq = scheds
        for k in sa.scheme.exists_keys(["p0"]):
            worker.client.put(k, b"page")
        assert sa._lookup(["p0"]) == 1  # the same tenant sees the page
        assert sb._lookup(["p0"]) == 0 and plain._lookup(["p0"]) == 0  # others do not
        assert master.state.tenant_stats()["vt-a"]["objects"] == 1
        with pytest.raises(NoSpace, match="tenant 'vt-q' holds 0 B of its 4.0 KiB quota"):
            sq._connect().put("too-big", b"q" * 8192)
        with pytest.raises(InvalidArgument, match="kv_connector_extra_config.tenant 'a b'"):
            _StoreScheduler(
                vllm_config_stub("/m/tenant"), connector_extra(master, tenant="a b"), "bad"
            )
    finally:
        for s in [*scheds, plain]:
            s.close()
        worker.close()
