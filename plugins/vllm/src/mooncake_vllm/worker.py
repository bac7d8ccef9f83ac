"""Worker side of the PD connector: registers the KV cache, moves and releases blocks.

- Both roles register every layer's paged KV tensor with a
  :class:`~mooncake_core.transfer.TransferEngine` (loopback, P2P handshake), so a decode
  worker can read a prefill worker's blocks directly (same host: shared memory /
  cross-memory attach; other hosts: TCP).
- Decode (``kv_consumer``): :meth:`PDWorker.start_load` submits one asynchronous batch
  per layer, in layer order, each block (or run of consecutive blocks) one request.
  :meth:`PDWorker.results` reports finished fetches, and failed ones (vLLM then
  recomputes when ``kv_load_failure_policy`` is ``recompute``). After a fetch, or when
  none is needed, the prefill worker is told to release the blocks.
- Prefill (``kv_producer``): keeps a finished request's blocks until the decode side
  says it is done, or ``send_timeout_s`` passed (a vanished peer).

Called by vLLM's model runner, in the worker process; not thread-safe (one caller).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_vllm.common import Counters, config_from_engine, option
from mooncake_vllm.metadata import PDHandshake, PDMetadata, RecvSpec

__all__ = ["PDWorker", "FREE_NOTIFY"]

logger = logging.getLogger(__name__)

FREE_NOTIFY = "mooncake_vllm.free"


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """Group block pairs into (local_start, remote_start, count) runs of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if out and out[-1][0] + out[-1][2] == lb and out[-1][1] + out[-1][2] == rb:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((lb, rb, 1))
    return out


@dataclass
class _Fetch:
    spec: RecvSpec
    peer: str
    batches: list[Any]
    started: float
    nbytes: int
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class PDWorker:
    """Worker-side state of :class:`~mooncake_vllm.connector.MooncakeCoreConnector`."""

    def __init__(self, engine_id: str, role: str, extra: dict[str, Any], tp_rank: int) -> None:
        self.engine_id = engine_id
        self.role = role  # kv_producer | kv_consumer | kv_both
        self.extra = extra
        self.tp_rank = tp_rank
        self.send_timeout_s = float(option(extra, "send_timeout_s", 120.0))
        self.transfer_timeout_s = float(option(extra, "transfer_timeout_s", 30.0))
        self.counters = Counters(
            f"pd-{role}-{engine_id}-tp{tp_rank}", option(extra, "stats_dir", None)
        )
        self.engine: TransferEngine | None = None
        self.layers: dict[str, Any] = {}
        self.block_bytes = 0
        self.num_blocks = 0
        self._sends: dict[str, float] = {}  # request id -> deadline
        self._early_frees: set[str] = set()
        self._fetches: dict[str, _Fetch] = {}
        self._notify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-vllm-notify")

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Start the transfer engine and register every layer's KV tensor."""
        cfg = config_from_engine(self.extra)
        self.engine = TransferEngine(cfg).start()
        shapes = set()
        for name, t in kv_caches.items():
            if not t.is_contiguous():
                raise ValueError(
                    f"KV cache of layer {name!r} is not contiguous; "
                    "the PD connector moves whole blocks"
                )
            self.engine.register(t, name=name)
            self.layers[name] = t
            shapes.add((tuple(t.shape), t.dtype))
            self.block_bytes = int(t.stride(0)) * int(t.element_size())
            self.num_blocks = int(t.shape[0])
        if len(shapes) > 1:
            raise ValueError(f"layers have different KV layouts: {shapes}")
        logger.info(
            "mooncake_vllm: %s worker tp%d registered %d layers x %d blocks x %d bytes on %s",
            self.role,
            self.tp_rank,
            len(self.layers),
            self.num_blocks,
            self.block_bytes,
            self.engine.name,
        )

    def handshake(self) -> PDHandshake | None:
        if self.engine is None:
            return None
        return PDHandshake(
            peer=self.engine.name,
            layers={n: int(t.data_ptr()) for n, t in self.layers.items()},
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
        )

    def shutdown(self) -> None:
        self._notify_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ------------------------------------------------------------------ per step
    def start_load(self, meta: PDMetadata) -> None:
        """Register new sends and start new fetches. Does not block on transfers."""
        now = time.monotonic()
        for rid in meta.sends:
            if rid in self._early_frees:  # the decode side finished before we heard of it
                self._early_frees.discard(rid)
                self._sends[rid] = 0.0
            else:
                self._sends[rid] = now + self.send_timeout_s
            self.counters.add(send_requests=1, send_blocks=len(meta.sends[rid]))
        for spec in meta.recvs:
            self._start_fetch(spec)

    def _start_fetch(self, spec: RecvSpec) -> None:
        assert self.engine is not None
        info = spec.peers.get(str(self.tp_rank))
        peer = str(info["peer"]) if info else ""
        if not spec.local_block_ids:  # nothing to read: just release the remote blocks
            if peer:
                self._release(peer, spec)
            return
        fetch = _Fetch(spec, peer, [], time.monotonic(), 0)
        self._fetches[spec.request_id] = fetch
        try:
            if info is None:
                raise ValueError(
                    f"prefill instance {spec.remote_engine_id} has no TP rank {self.tp_rank}"
                )
            if int(info["block_bytes"]) != self.block_bytes:
                raise ValueError(
                    f"block size differs: remote {info['block_bytes']} bytes, "
                    f"local {self.block_bytes}"
                )
            if len(spec.local_block_ids) != len(spec.remote_block_ids):
                raise ValueError(
                    f"{len(spec.local_block_ids)} local blocks for "
                    f"{len(spec.remote_block_ids)} remote ones"
                )
            remote_layers: dict[str, int] = info["layers"]
            runs = _runs(spec.local_block_ids, spec.remote_block_ids)
            bb = self.block_bytes
            for name, t in self.layers.items():  # layer order: layer 0 lands first
                base = remote_layers.get(name)
                if base is None:
                    raise ValueError(f"prefill instance has no layer {name!r}")
                local_base = int(t.data_ptr())
                reqs = [
                    TransferRequest(
                        "read", peer, local_base + lb * bb, n * bb, remote_addr=int(base) + rb * bb
                    )
                    for lb, rb, n in runs
                ]
                fetch.batches.append(self.engine.submit(reqs, timeout=self.transfer_timeout_s))
                fetch.nbytes += sum(n for _, _, n in runs) * bb
        except Exception as exc:  # reported as a failed load in results()
            fetch.error = exc

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.engine is not None:
            for name, msg in self.engine.get_notifies():
                if name != FREE_NOTIFY:
                    continue
                try:
                    rid = str(json.loads(msg)["request_id"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("mooncake_vllm: ignoring malformed release message %r", msg)
                    continue
                if rid in self._sends:
                    self._sends[rid] = 0.0
                    self.counters.add(sends_released_by_peer=1)
                else:
                    self._early_frees.add(rid)
                    self.counters.add(sends_released_by_peer=1)
        now = time.monotonic()
        for rid, deadline in list(self._sends.items()):
            if deadline == 0.0:
                sending.add(rid)
                del self._sends[rid]
            elif now >= deadline:
                logger.warning(
                    "mooncake_vllm: no decode instance fetched request %s within %.0f s; "
                    "releasing its KV blocks",
                    rid,
                    self.send_timeout_s,
                )
                self.counters.add(sends_released_by_timeout=1)
                sending.add(rid)
                del self._sends[rid]
        for rid, f in list(self._fetches.items()):
            if f.error is None and not all(b.done() for b in f.batches):
                continue
            del self._fetches[rid]
            err = f.error
            if err is None:
                for b in f.batches:
                    try:
                        b.wait(0)
                    except Exception as exc:
                        err = exc
                        break
            if err is not None:
                logger.warning(
                    "mooncake_vllm: KV fetch for request %s from prefill %s (%s) failed: %s; "
                    "vLLM's kv_load_failure_policy decides "
                    "(recompute: the prompt is computed here)",
                    rid,
                    f.spec.remote_engine_id,
                    f.peer or "?",
                    err,
                )
                self.counters.add(recv_failures=1)
                failed.add(rid)
                recving.add(rid)
            else:
                dt = time.monotonic() - f.started
                self.counters.add(
                    recv_requests=1,
                    recv_blocks=len(f.spec.local_block_ids),
                    recv_bytes=f.nbytes,
                    recv_seconds=dt,
                )
                logger.debug("fetched %d bytes for %s in %.3f s", f.nbytes, rid, dt)
                recving.add(rid)
            if f.peer:
                self._release(f.peer, f.spec)
        return sending, recving, failed

    # ------------------------------------------------------------------ helpers
    def _release(self, peer: str, spec: RecvSpec) -> None:
        """Tell the prefill worker it may free the request's blocks (in the background)."""
        engine = self.engine
        if engine is None:
            return
        msg = json.dumps({"request_id": spec.remote_request_id})

        def run() -> None:
            try:
                engine.notify(peer, FREE_NOTIFY, msg)
            except Exception as exc:  # the prefill instance's timeout frees them instead
                logger.debug("release of %s on %s failed: %s", spec.remote_request_id, peer, exc)

        self._notify_pool.submit(run)
