"""The store connector's per-request work on vLLM's critical path.

- A prompt whose lookup pages all sit in vLLM's own prefix cache is not hashed (a local hit
  pays no page hashing); pages are hashed, with the same keys, once a lookup or save needs
  them.
- A step's loads start in ``handle_preemptions`` (vLLM's first worker call of the step,
  before it prepares the step's inputs), once, unless vLLM zeroes new blocks in between.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_helpers import HAVE_VLLM, new_request_output, vllm_config_stub

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")

BS = 32


def test_a_local_hit_is_not_hashed_and_later_saves_keep_their_keys(
    master: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncake_vllm import store_connector as sc
    from mooncake_vllm.store_keys import StoreKeyScheme

    calls: list[int] = []
    orig = StoreKeyScheme.pages

    def counted(self: Any, tokens: Any, n_pages: Any = None) -> list[str]:
        calls.append(len(tokens))
        return list(orig(self, tokens, n_pages))

    monkeypatch.setattr(StoreKeyScheme, "pages", counted)
    extra = {"mooncake": {"master_server_address": master.address}}
    sched = sc._StoreScheduler(vllm_config_stub("/m/hitpath", BS), extra, "hp")
    try:
        prompt = list(range(3, 3 + 3 * BS + 5))  # 3 full pages and a tail
        req = SimpleNamespace(request_id="local", prompt_token_ids=prompt)
        # vLLM's own cache holds the 3 pages: nothing to look up, nothing to hash
        assert sched.get_num_new_matched_tokens(req, 3 * BS) == (0, False)
        blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3],))
        sched.update_state_after_alloc(req, blocks, 0)
        meta = sched.build_connector_meta(new_request_output("local", 3 * BS, 5, [0, 1, 2, 3]))
        assert meta.saves == [] and meta.loads == [] and calls == []
        assert sched.request_finished(req, [0, 1, 2, 3]) == (False, None)
        # one local page: the lookup hashes the prompt once; the saves use the same keys
        req2 = SimpleNamespace(request_id="miss", prompt_token_ids=prompt)
        assert sched.get_num_new_matched_tokens(req2, BS) == (0, False)
        assert calls == [len(prompt)]
        sched.update_state_after_alloc(req2, SimpleNamespace(get_block_ids=lambda: [4, 5, 6, 7]), 0)
        meta = sched.build_connector_meta(
            new_request_output("miss", BS, len(prompt) - BS, [4, 5, 6, 7])
        )
        want = orig(sched.scheme, prompt)
        assert [(j.pages, j.block_ids) for j in meta.saves] == [(want[1:3], [5, 6])]
        assert calls == [len(prompt)]
    finally:
        sched.close()


class _FakeWorker:
    def __init__(self) -> None:
        self.started: list[Any] = []

    def start_load(self, meta: Any) -> None:
        self.started.append(meta)


def _connector(early: bool) -> Any:
    from mooncake_vllm.store_connector import MooncakeCoreStoreConnector

    c = object.__new__(MooncakeCoreStoreConnector)
    c._connector_metadata = None
    c.sched = None
    c.worker = _FakeWorker()
    c._early_loads = early
    return c


@pytest.mark.parametrize("early", [True, False])
def test_loads_start_once_before_the_step_prepares_its_inputs(early: bool) -> None:
    from mooncake_vllm.store_connector import PageJob, StoreMetadata

    c = _connector(early)
    meta = StoreMetadata(loads=[PageJob("r", ["p0"], [3])])
    c.handle_preemptions(meta)  # execute_model's first connector call
    assert c.worker.started == ([meta] if early else [])
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)  # vLLM's own place for it, just before the forward
    assert c.worker.started == [meta]
    # a step without loads starts nothing; nor does a metadata of another connector
    c.handle_preemptions(StoreMetadata())
    c.handle_preemptions(SimpleNamespace(loads=[1]))
    assert c.worker.started == [meta]


def test_loads_start_early_only_where_vllm_zeroes_no_new_blocks() -> None:
    from mooncake_vllm.store_connector import loads_may_start_early

    assert loads_may_start_early(SimpleNamespace(needs_kv_cache_zeroing=False))
    assert not loads_may_start_early(SimpleNamespace(needs_kv_cache_zeroing=True))
    assert not loads_may_start_early(None)  # config unknown: as vLLM orders it
    assert not loads_may_start_early(SimpleNamespace())  # a vLLM without the flag
