"""A request's opt-out of store loads: ``"mooncake_store_load": false`` in its
``kv_transfer_params`` (what ``mooncake-core proxy --store-loads off`` sends).

The connector's real scheduler half against a real master (in a thread) whose pool holds
the prompt's pages; no engine. The flagged request gets no external tokens and counts no
lookup; the same prompt without the flag (or with it true) gets the hit; the flagged
request's pages are still saved.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_helpers import (
    HAVE_VLLM,
    connector_extra,
    new_request_output,
    vllm_config_stub,
)

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")

BS = 32


def _req(rid: str, prompt: list[int], params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params)


def test_a_request_that_opts_out_gets_no_store_tokens_although_the_store_holds_them(
    master: Any,
) -> None:
    from mooncake_vllm.store_connector import _StoreScheduler

    from mooncake_core.store.client import StoreClient

    extra = connector_extra(master)
    sched = _StoreScheduler(vllm_config_stub("/m/optout", BS), extra, "optout")
    holder = StoreClient(master=master.address, segment_size=1 << 20)
    holder.start()
    try:
        prompt = list(range(3, 3 + 3 * BS + 5))  # 3 full pages and a tail
        for k in sched.scheme.exists_keys(sched.scheme.pages(prompt)):
            holder.put(k, b"page")
        pd = {"do_remote_decode": True, "do_remote_prefill": False}
        off = _req("off", prompt, {**pd, "mooncake_store_load": False})
        assert sched.get_num_new_matched_tokens(off, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(off, 0) == (0, False)  # asked again
        assert sched._counts == {}  # no lookup asked, none counted
        blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3],))
        sched.update_state_after_alloc(off, blocks, 0)
        meta = sched.build_connector_meta(new_request_output("off", 0, len(prompt), [0, 1, 2, 3]))
        assert meta.loads == []
        # saving is unchanged: the opted-out request's full pages are saved
        assert [(j.pages, j.block_ids) for j in meta.saves] == [
            (sched.scheme.pages(prompt)[:3], [0, 1, 2])
        ]
        # the same prompt without the flag (or with it true): the store's 3 pages
        for rid, params in (
            ("on", dict(pd)),
            ("none", None),
            ("true", {"mooncake_store_load": True}),
        ):
            assert sched.get_num_new_matched_tokens(_req(rid, prompt, params), 0) == (3 * BS, False)
        assert sched._counts["lookup_requests"] == 3
    finally:
        holder.close()
        sched.close()


def test_store_load_wanted_reads_only_a_false_flag() -> None:
    from mooncake_vllm.store_connector import store_load_wanted

    assert not store_load_wanted(_req("a", [], {"mooncake_store_load": False}))
    assert store_load_wanted(_req("b", [], {"mooncake_store_load": True}))
    assert store_load_wanted(_req("c", [], {}))
    assert store_load_wanted(_req("d", [], None))
    assert store_load_wanted(SimpleNamespace(request_id="e"))  # no such attribute
