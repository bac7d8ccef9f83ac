"""What ``mooncake-core proxy`` needs to know about vLLM (no vLLM import).

:class:`VLLMProxyEngine` is the vLLM side of the proxy's engine contract
(:class:`mooncake_core.proxy.engine.ProxyEngine`), offered through the plugin hook
``mooncake_proxy_engine("vllm")`` (see :mod:`mooncake_vllm.adapter`):

- PD split: the prefill instance gets the request with ``max_tokens=1``, ``stream=false``
  and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false}``; the
  decode instance gets the original request plus the ``kv_transfer_params`` the prefill
  answered with (``MooncakeCoreConnector``'s hand-off).
- Tokenizer: ``POST /tokenize`` with the request fields that change tokenization; for
  completions ``prompt`` and ``add_special_tokens``; for chat ``messages``,
  ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
  ``chat_template``, ``chat_template_kwargs``, ``tools``, ``mm_processor_kwargs`` and
  ``media_io_kwargs``; the answer's ``tokens``.
- Model path: ``root`` (else ``id``) of the first card in ``GET /v1/models``.
- KV events: vLLM's ZMQ publisher sends ``(topic, 8-byte big-endian sequence, msgpack
  EventBatch)``, the batch ``[ts, [event, ...], dp_rank]``, each event a map tagged
  ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
- Store keys: :class:`mooncake_vllm.store_keys.StoreKeyScheme`, the scheme
  ``MooncakeCoreStoreConnector`` saves under.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mooncake_core.proxy.engine import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from mooncake_vllm.store_keys import StoreKeyScheme

__all__ = ["VLLMProxyEngine", "ENGINE", "tokenize_request", "decode_kv_events"]

ENGINE = "vllm"

_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def tokenize_request(body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """The ``/tokenize`` body for an OpenAI request body, or None when it is not one text prompt."""
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return None
        out["messages"] = msgs
        out.update({k: body[k] for k in _CHAT_FIELDS if k in body})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return None
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def decode_kv_events(payload: bytes) -> list[KVEvent]:
    """The events of one vLLM ``EventBatch`` (the last ZMQ frame); ValueError when malformed."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack event batch: {exc}") from None
    events = batch[1] if isinstance(batch, list) else batch.get("events", [])
    out: list[KVEvent] = []
    for ev in events:
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "BlockStored":
            size = ev.get("block_size")
            out.append(
                BlocksStored(
                    tuple(ev.get("block_hashes") or ()),
                    ev.get("parent_block_hash"),
                    tuple(ev.get("token_ids") or ()),
                    int(size) if size else None,
                )
            )
        elif kind == "BlockRemoved":
            out.append(BlocksRemoved(tuple(ev.get("block_hashes") or ())))
        elif kind == "AllBlocksCleared":
            out.append(AllBlocksCleared())
    return out


class VLLMProxyEngine:
    """vLLM instances behind ``mooncake-core proxy`` (see the module docstring)."""

    name = ENGINE
    tokenize_path = "/tokenize"
    missing_handoff = (
        "returned no kv_transfer_params; start it with "
        '--kv-transfer-config \'{"kv_connector":"MooncakeCoreConnector",'
        '"kv_role":"kv_producer"}\''
    )

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        pbody = dict(body)
        pbody["max_tokens"] = 1
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        pbody["stream"] = False
        pbody.pop("stream_options", None)
        pbody["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        return pbody

    def handoff(self, answer: Any) -> dict[str, Any] | None:
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    def decode_body(self, body: dict[str, Any], handoff: dict[str, Any]) -> dict[str, Any]:
        dbody = dict(body)
        dbody["kv_transfer_params"] = handoff
        return dbody

    def tokenize_body(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        return tokenize_request(body, chat)

    def token_ids(self, answer: Any) -> list[int]:
        return [int(t) for t in answer["tokens"]]

    def model_path(self, models: Any) -> str | None:
        card = (models.get("data") or [{}])[0]
        root = card.get("root") or card.get("id")
        return str(root) if root else None

    def decode_kv_events(self, payload: bytes) -> list[KVEvent]:
        return decode_kv_events(payload)

    def store_keys(self, model: str, dtype: str, block_tokens: int, tp_size: int) -> StoreKeyScheme:
        return StoreKeyScheme(model, dtype, block_tokens, tp_size)
