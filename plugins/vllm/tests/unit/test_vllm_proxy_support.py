"""The vLLM side of the proxy's engine contract: KV events, tokenizer body, PD split, store keys."""

from __future__ import annotations

import time

import msgspec
import pytest
from mooncake_vllm.proxy_support import VLLMProxyEngine, decode_kv_events, tokenize_request
from mooncake_vllm.store_keys import StoreKeyScheme

from mooncake_core.conductor.policy import prefix_blocks
from mooncake_core.plugins import get_plugin_manager
from mooncake_core.proxy import ProxyEngine, StoreKeys, proxy_engine
from mooncake_core.proxy.kvevents import BlockChain


def _stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int = 4
) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _batch(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


def test_the_hook_serves_vllm_only() -> None:
    eng = proxy_engine("vllm")
    assert isinstance(eng, VLLMProxyEngine) and isinstance(eng, ProxyEngine)
    assert get_plugin_manager().hook.mooncake_proxy_engine(name="lmdeploy") is None
    keys = eng.store_keys("/m/tiny", "fp32", 16, 2)
    assert isinstance(keys, StoreKeys) and keys == StoreKeyScheme("/m/tiny", "torch.float32", 16, 2)


def test_vllm_events_rechain_to_the_proxys_prompt_hashes() -> None:
    toks = list(range(100, 124))
    want = list(prefix_blocks(toks, 4))
    c = BlockChain(4)
    evs = decode_kv_events(
        _batch(
            _stored([b"a", b"b"], None, toks[:8]),
            _stored([b"c", b"d", b"e", b"f"], b"b", toks[8:]),
            {"type": "BlockRemoved", "block_hashes": [b"f"], "medium": "GPU"},
            {"type": "SomethingNew"},
            {"type": "AllBlocksCleared"},
        )
    )
    assert [type(e).__name__ for e in evs] == [
        "BlocksStored",
        "BlocksStored",
        "BlocksRemoved",
        "AllBlocksCleared",
    ]
    assert c.stored(evs[0]) == want[:2]  # type: ignore[arg-type]
    assert c.stored(evs[1]) == want[2:]  # type: ignore[arg-type]
    assert c.removed(evs[2].block_hashes) == [want[5]]  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        decode_kv_events(b"\xc1garbage")


def test_pd_split_and_tokenizer_body() -> None:
    eng = VLLMProxyEngine()
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 9,
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p = eng.prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and p["kv_transfer_params"]["do_remote_decode"] is True
    assert (
        body["max_tokens"] == 9 and "kv_transfer_params" not in body
    )  # the client's body is untouched
    assert eng.handoff({"kv_transfer_params": {"x": 1}}) == {"x": 1}
    assert eng.handoff({"choices": []}) is None and eng.handoff([1]) is None
    assert eng.decode_body(body, {"x": 1})["kv_transfer_params"] == {"x": 1}
    assert tokenize_request(
        {"model": "m", "prompt": ["one"], "add_special_tokens": False}, chat=False
    ) == {"model": "m", "prompt": "one", "add_special_tokens": False}
    assert tokenize_request({"prompt": [1, 2]}, chat=False) is None
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [], "temperature": 0}
    assert tokenize_request(chat, chat=True) == {"messages": chat["messages"], "tools": []}
    assert eng.token_ids({"tokens": ["3", 4]}) == [3, 4]
    assert eng.model_path({"data": [{"id": "tiny", "root": "/m/tiny"}]}) == "/m/tiny"
    assert (
        eng.model_path({"data": [{"id": "tiny"}]}) == "tiny"
        and eng.model_path({"data": []}) is None
    )
