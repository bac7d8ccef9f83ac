"""Scheduler side of the PD connector: decides what to fetch, keep and release.

- Prefill (``kv_producer``): a request that arrives with ``kv_transfer_params``
  ``{"do_remote_decode": true}`` keeps its blocks after it finishes
  (:meth:`PDScheduler.request_finished` returns ``delay_free=True``) and answers with the
  parameters a decode instance needs::

      {"do_remote_prefill": true, "do_remote_decode": false,
       "remote_engine_id": ..., "remote_request_id": ..., "remote_block_ids": [...],
       "remote_peers": {"0": {"peer": "127.0.0.1:PORT", "layers": {...}, "block_bytes": n}},
       "num_prompt_tokens": n, "mooncake_vllm": 1}

- Decode (``kv_consumer``): a request carrying those parameters reports its whole prompt
  (past any local prefix hit) as loadable asynchronously; once vLLM allocated blocks,
  the next step's metadata tells the workers to fetch into them.

Called by vLLM's scheduler, in the EngineCore process, from one thread.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_vllm.metadata import PARAMS_VERSION, PDHandshake, PDMetadata, RecvSpec

__all__ = ["PDScheduler"]

logger = logging.getLogger(__name__)

_REQUIRED = ("remote_request_id", "remote_block_ids", "remote_peers")


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes ``list[int]`` or one list per KV-cache group; we use group 0."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or [])]


class PDScheduler:
    """Scheduler-side state of :class:`~mooncake_vllm.connector.MooncakeCoreConnector`."""

    def __init__(self, engine_id: str, role: str, block_size: int) -> None:
        self.engine_id = engine_id
        self.role = role
        self.block_size = block_size
        self.is_producer = role in ("kv_producer", "kv_both")
        self.is_consumer = role in ("kv_consumer", "kv_both")
        self.peers: dict[str, dict[str, Any]] = {}
        self._local_hit: dict[str, int] = {}
        self._recvs: list[RecvSpec] = []
        self._sends: dict[str, list[int]] = {}

    def set_handshake(self, metadata: dict[Any, Any]) -> None:
        """Learn how peers reach each worker's KV (called once at start-up)."""
        for key, md in metadata.items():
            tp = key[1] if isinstance(key, tuple) else key
            if isinstance(md, PDHandshake):
                self.peers[str(tp)] = {
                    "peer": md.peer,
                    "layers": dict(md.layers),
                    "block_bytes": md.block_bytes,
                }
        logger.info(
            "mooncake_vllm: %s engine %s reachable at %s",
            self.role,
            self.engine_id,
            ", ".join(p["peer"] for p in self.peers.values()) or "(nowhere)",
        )

    # ------------------------------------------------------------------ decode side
    def _wants_fetch(self, request: Any) -> dict[str, Any] | None:
        p = request.kv_transfer_params
        if not self.is_consumer or not p or not p.get("do_remote_prefill"):
            return None
        if not all(k in p for k in _REQUIRED):
            logger.warning(
                "mooncake_vllm: request %s has incomplete kv_transfer_params (need %s); "
                "computing its prompt here",
                request.request_id,
                ", ".join(_REQUIRED),
            )
            p["do_remote_prefill"] = False
            return None
        return dict(p)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        p = self._wants_fetch(request)
        if p is None:
            return 0, False
        prompt = len(request.prompt_token_ids or [])
        remote_tokens = min(prompt, len(p["remote_block_ids"]) * self.block_size)
        count = remote_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = self._wants_fetch(request)
        if p is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one fetch per request
        rid = request.request_id
        spec = RecvSpec(
            rid,
            str(p["remote_request_id"]),
            str(p.get("remote_engine_id", "?")),
            dict(p["remote_peers"]),
        )
        local_hit = self._local_hit.pop(rid, 0)
        if num_external_tokens > 0:
            bs = self.block_size
            skip = local_hit // bs
            n = -(-(local_hit + num_external_tokens) // bs) - skip
            all_ids = _first_group(blocks.get_block_ids())
            spec.local_block_ids = all_ids[skip : skip + n]
            spec.remote_block_ids = [int(b) for b in p["remote_block_ids"][skip : skip + n]]
        self._recvs.append(spec)  # without blocks: only release the prefill side

    # ------------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output: Any) -> PDMetadata:
        meta = PDMetadata(recvs=self._recvs, sends=self._sends)
        self._recvs, self._sends = [], {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params
        rid = request.request_id
        self._local_hit.pop(rid, None)
        if not p:
            return False, None
        if self.is_consumer and p.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: release the prefill side.
            p["do_remote_prefill"] = False
            if all(k in p for k in _REQUIRED):
                self._recvs.append(
                    RecvSpec(
                        rid,
                        str(p["remote_request_id"]),
                        str(p.get("remote_engine_id", "?")),
                        dict(p["remote_peers"]),
                    )
                )
            return False, None
        if not (self.is_producer and p.get("do_remote_decode")):
            return False, None
        status = str(getattr(request.status, "name", request.status))
        ids = _first_group(block_ids)
        if (
            status not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
            or not ids
            or not self.peers
        ):
            return False, None
        self._sends[rid] = ids
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": ids,
            "remote_peers": self.peers,
            "num_prompt_tokens": int(request.num_prompt_tokens),
            "mooncake_vllm": PARAMS_VERSION,
        }
