"""The conductor: per-request prefill/decode placement with early rejection.

Contract (what a proxy or the simulator calls, in order):

- :meth:`Conductor.decide` (once per request, at arrival): returns a :class:`Decision`
  with the prefill instance, the decode instance, the predicted TTFT and TBT, the prefix
  that is reused locally and the part fetched from another holder, and ``rejected`` with
  a reason (answer HTTP 429) when early rejection is on and a prediction misses its SLO.
  An accepted decision is committed: the instance's queue, NIC and the decode load
  forecast are updated, so the next decision sees them.
- :meth:`Conductor.prefill_done` when the prefill finished (the blocks the instance now
  holds go into the index, evicting LRU blocks when a capacity is configured).
- :meth:`Conductor.decode_done` when the last token was produced.
- KV events from a live cluster: :meth:`kv_stored`, :meth:`kv_removed`,
  :meth:`store_put`, :meth:`store_removed`, :meth:`instance_reset`.

TTFT on prefill instance ``i`` = max(queue wait, NIC wait + fetch time) + prefill time of
the tokens beyond the reused prefix; the fetch overlaps the queue wait because the KV lands
in the instance's host memory while earlier prefills run. TBT is predicted for the moment
the request would reach decode, from the requests forecast to be decoding then.

Thread-safety: none; call from one thread or event loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mooncake_core.conductor.cache import BlockIndex
from mooncake_core.conductor.costmodel import DEFAULT_PROFILE, CostModel, CostProfile
from mooncake_core.conductor.policy import POLICIES, PrefillView, make_policy
from mooncake_core.conductor.trace import Request
from mooncake_core.errors import ConfigError

__all__ = ["Conductor", "ConductorConfig", "Decision", "DEFAULT_SLO_TTFT_S", "DEFAULT_SLO_TBT_S"]

logger = logging.getLogger(__name__)

DEFAULT_SLO_TTFT_S = 10.0
DEFAULT_SLO_TBT_S = 0.1


@dataclass(frozen=True)
class ConductorConfig:
    """Cluster shape and scheduling knobs.

    Attributes:
        n_prefill: Prefill instances (> 0).
        n_decode: Decode instances (> 0).
        policy: One of ``random``, ``least-load``, ``local-cache``, ``global-cache``.
        reject: Early rejection on/off.
        slo_ttft_s: TTFT target (s, > 0).
        slo_tbt_s: Time-between-tokens target (s, > 0).
        balance_threshold_blocks: Fetch a remote prefix only when it is longer than the
            local one by more than this many blocks (``kvcache_balancing_threshold``).
        cache_blocks: Per-prefill-instance KV capacity in blocks (``None``: unbounded,
            holdings come from KV events).
        store_blocks: Shared store pool capacity in blocks (0: none, ``None``: unbounded).
        seed: Seed of the random policy.
        fetch_sources: Where ``global-cache`` may fetch a prefix from: ``"any"`` (every
            holder: other prefill instances and the store, the paper's pooled DRAM) or
            ``"store"`` (the store pool only, e.g. vLLM instances that can read each
            other's KV only through the store).
        holder_margin: ``global-cache`` only: the instance holding the longest local prefix
            keeps a request unless another option is predicted faster by more than this share
            (see :class:`~mooncake_core.conductor.policy.GlobalCachePolicy`); 0: plain minimum.
    """

    n_prefill: int
    n_decode: int
    policy: str = "global-cache"
    reject: bool = False
    slo_ttft_s: float = DEFAULT_SLO_TTFT_S
    slo_tbt_s: float = DEFAULT_SLO_TBT_S
    balance_threshold_blocks: int = 2
    cache_blocks: int | None = None
    store_blocks: int | None = 0
    seed: int = 0
    fetch_sources: str = "any"
    holder_margin: float = 0.0

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        if self.n_prefill <= 0:
            raise ConfigError(f"need at least one prefill instance, got n_prefill={self.n_prefill}")
        if self.n_decode <= 0:
            raise ConfigError(f"need at least one decode instance, got n_decode={self.n_decode}")
        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}"
            )
        for name in ("slo_ttft_s", "slo_tbt_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.balance_threshold_blocks < 0:
            raise ConfigError(
                f"balance_threshold_blocks must be >= 0, got {self.balance_threshold_blocks}"
            )
        if self.cache_blocks is not None and self.cache_blocks < 0:
            raise ConfigError(f"cache_blocks must be >= 0, got {self.cache_blocks}")
        if self.store_blocks is not None and self.store_blocks < 0:
            raise ConfigError(f"store_blocks must be >= 0, got {self.store_blocks}")
        if self.fetch_sources not in ("any", "store"):
            raise ConfigError(f"fetch_sources must be 'any' or 'store', got {self.fetch_sources!r}")
        m = self.holder_margin
        if not (isinstance(m, (int, float)) and m >= 0 and math.isfinite(m)):
            raise ConfigError(f"holder_margin must be a finite number >= 0, got {m!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The conductor's answer for one request.

    Attributes:
        rid: Request id.
        rejected: True when early rejection refused the request (no state was changed).
        reason: Why it was rejected (empty when accepted).
        prefill: Prefill instance (the candidate, also when rejected).
        decode: Decode instance (-1 when the request needs no decode step).
        ttft_s: Predicted time to first token.
        tbt_s: Predicted time between tokens (0 when there is no decode).
        cached_blocks: Prefix blocks reused (local plus fetched).
        fetch_blocks: Blocks fetched from ``fetch_source`` before prefill.
        fetch_source: Holder with the longest own copy of the fetched prefix (-1: none;
            ``n_prefill``: store); blocks it lacks come from the other holders.
        queue_s: Predicted wait before the prefill starts (includes a pending fetch).
        transfer_s: Predicted fetch duration.
        prefill_s: Predicted prefill compute time.
        prefill_end_s: Absolute time the prefill is predicted to finish.
    """

    rid: int
    rejected: bool
    reason: str
    prefill: int
    decode: int
    ttft_s: float
    tbt_s: float
    cached_blocks: int
    fetch_blocks: int
    fetch_source: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    prefill_end_s: float


class Conductor:
    """Global scheduler over ``n_prefill`` prefill and ``n_decode`` decode instances.

    Args:
        config: Cluster shape and knobs (validated here).
        profile: Cost-model profile (default: the shipped A800/70B profile).

    Raises:
        ConfigError: invalid configuration or profile.
    """

    def __init__(self, config: ConductorConfig, profile: CostProfile = DEFAULT_PROFILE) -> None:
        config.validate()
        self.config = config
        self.cost = CostModel(profile)
        self.policy = make_policy(config.policy, config.seed, config.holder_margin)
        n, m = config.n_prefill, config.n_decode
        self.index = BlockIndex(n, config.cache_blocks, config.store_blocks)
        self._free_at = np.zeros(n)
        self._nic_free = np.zeros(n)
        self.queued = np.zeros(n, dtype=np.int64)
        self._inf = np.full(n, np.inf)
        self._ones = np.ones(n)
        #: the last decision's per-instance view (wait, local prefix, TTFT options)
        self.last_view: PrefillView | None = None
        self._bt = profile.block_tokens
        self._blk_bytes = float(profile.block_tokens * profile.kv_bytes_per_token)
        self._bw = profile.transfer_gbps * 1e9
        self._lat = profile.transfer_latency_s
        self._kv_cap = float(profile.decode_kv_tokens)
        # Decode forecast: one window [start, end) of reserved tokens per accepted request.
        cap = 256
        self._w_start = np.zeros(cap)
        self._w_end = np.zeros(cap)
        self._w_tok = np.zeros(cap)
        self._w_inst = np.zeros(cap, dtype=np.int64)
        self._w_rid = np.full(cap, -1, dtype=np.int64)
        self._w_n = 0
        self.decisions = 0
        self.rejections = 0
        logger.debug(
            "conductor: policy %s, %d prefill, %d decode, reject %s",
            config.policy,
            n,
            m,
            config.reject,
        )

    # --- decisions ----------------------------------------------------------------------

    def queue_wait_s(self, now: float) -> np.ndarray:
        """Predicted wait before each prefill instance is free, seconds from ``now``."""
        return np.maximum(self._free_at - now, 0.0)

    def decode_load(self, at: float) -> tuple[np.ndarray, np.ndarray]:
        """Forecast ``(requests, reserved_tokens)`` per decode instance at time ``at``."""
        k = self._w_n
        m = self.config.n_decode
        active = (self._w_start[:k] <= at) & (self._w_end[:k] > at)
        inst = self._w_inst[:k][active]
        cnt = np.bincount(inst, minlength=m)
        tok = np.bincount(inst, weights=self._w_tok[:k][active], minlength=m)
        return cnt, tok

    def decide(
        self,
        req: Request,
        now: float | None = None,
        commit: bool = True,
        wait_s: Sequence[float] | np.ndarray | None = None,
        speed: Sequence[float] | np.ndarray | None = None,
    ) -> Decision:
        """Place one request (see the module docstring).

        Args:
            req: The request.
            now: Current time in seconds (default: ``req.arrival_s``).
            commit: Apply an accepted decision to the state (False: only predict).
            wait_s: Per prefill instance, the wait before it could start this prefill, from
                outside (a live proxy measures its instances' queues); default: the
                conductor's own queue model.
            speed: Per prefill instance, real seconds per second of the cost profile (an
                instance measured slower than its profile); scales prefill and fetch
                times. Default: 1 (the profile is exact).

        Returns:
            The decision; when ``rejected`` is True nothing was changed.

        Called by: the proxy per incoming request; the simulator at each arrival.
        Blocking: no (tens of microseconds).
        """
        t = req.arrival_s if now is None else now
        cfg = self.config
        cost = self.cost
        n_in = req.input_len
        bt = self._bt
        matched, union = self.index.match(req.blocks)
        local = matched[: cfg.n_prefill]
        if wait_s is None:
            wait = np.maximum(self._free_at - t, 0.0)
        else:
            wait = np.maximum(np.asarray(wait_s, dtype=np.float64), 0.0)
        k = self._ones if speed is None else np.asarray(speed, dtype=np.float64)
        ttft_local = wait + k * cost.prefill_s_array(n_in, local * bt)
        best = 0
        src = -1
        ttft_fetch = self._inf
        if self.policy.uses_remote:
            if cfg.fetch_sources == "store":
                src = self.index.store
                best = int(matched[src])
            else:
                src = int(np.argmax(matched))
                best = union
            gain = best - local
            ok = gain > cfg.balance_threshold_blocks
            if ok.any():
                xfer = k * (self._lat + gain * (self._blk_bytes / self._bw))
                nic_wait = np.maximum(self._nic_free - t, 0.0)
                ttft_fetch = np.where(
                    ok,
                    np.maximum(wait, nic_wait + xfer) + k * cost.prefill_s(n_in, best * bt),
                    np.inf,
                )
        view = PrefillView(wait, local, ttft_local, ttft_fetch, best if src >= 0 else 0)
        self.last_view = view
        choice = self.policy.choose(view)
        i = choice.instance
        ki = float(k[i])
        if choice.fetch:
            cached = best
            fetch_blocks = best - int(local[i])
            transfer = ki * cost.transfer_s(fetch_blocks)
            fetch_end = max(t, float(self._nic_free[i])) + transfer
        else:
            cached = int(local[i])
            fetch_blocks = 0
            transfer = 0.0
            fetch_end = t
            src = -1
        start = max(t + float(wait[i]), fetch_end)
        prefill = ki * cost.prefill_s(n_in, cached * bt)
        end = start + prefill
        ttft = end - t
        # Decode: least predicted TBT at the time the request would get there.
        j = -1
        tbt = 0.0
        dec_tokens = n_in + req.output_len
        t_dec = end + cost.handoff_s(n_in)
        if req.output_len > 1:
            cnt, tok = self.decode_load(t_dec)
            a, b, c = cost.decode_coeffs()
            tbts = a + b * (cnt + 1) + c * (tok + n_in + req.output_len / 2)
            tbts = np.where((tok + dec_tokens > self._kv_cap) & (cnt > 0), np.inf, tbts)
            j = int(np.argmin(tbts))
            tbt = float(tbts[j])
        self.decisions += 1
        reason = ""
        if cfg.reject:
            if ttft > cfg.slo_ttft_s:
                reason = f"predicted TTFT {ttft:.3f} s exceeds the SLO {cfg.slo_ttft_s:g} s"
            elif tbt > cfg.slo_tbt_s:
                reason = f"predicted TBT {tbt:.4f} s exceeds the SLO {cfg.slo_tbt_s:g} s"
        decision = Decision(
            req.rid,
            bool(reason),
            reason,
            i,
            j,
            ttft,
            tbt,
            cached,
            fetch_blocks,
            src,
            start - t,
            transfer,
            prefill,
            end,
        )
        if reason:
            self.rejections += 1
            logger.debug("reject request %d: %s", req.rid, reason)
            return decision
        if commit:
            self._commit(req, decision, fetch_end, t_dec, t)
        return decision

    def _commit(
        self, req: Request, d: Decision, fetch_end: float, t_dec: float, now: float
    ) -> None:
        i = d.prefill
        self._free_at[i] = d.prefill_end_s
        self.queued[i] += 1
        if d.fetch_blocks:
            self._nic_free[i] = fetch_end
            self.index.touch(d.fetch_source, req.blocks[: d.cached_blocks])
        else:
            self.index.touch(i, req.blocks[: d.cached_blocks])
        if d.decode >= 0:
            self._add_window(
                req.rid,
                d.decode,
                t_dec,
                t_dec + (req.output_len - 1) * d.tbt_s,
                req.input_len + req.output_len,
                now,
            )

    def _add_window(
        self, rid: int, inst: int, start: float, end: float, tokens: float, now: float
    ) -> None:
        k = self._w_n
        if k == len(self._w_start):
            keep = self._w_end[:k] > now - 1e-9
            live = int(keep.sum())
            size = len(self._w_start) * (2 if live > k // 2 else 1)

            def grow(arr: np.ndarray) -> np.ndarray:
                new = np.zeros(size, dtype=arr.dtype)
                new[:live] = arr[:k][keep]
                return new

            self._w_start = grow(self._w_start)
            self._w_end = grow(self._w_end)
            self._w_tok = grow(self._w_tok)
            self._w_inst = grow(self._w_inst)
            self._w_rid = grow(self._w_rid)
            k = self._w_n = live
        self._w_start[k] = start
        self._w_end[k] = end
        self._w_tok[k] = tokens
        self._w_inst[k] = inst
        self._w_rid[k] = rid
        self._w_n = k + 1

    # --- completions and KV events -------------------------------------------------------

    def prefill_done(self, d: Decision, blocks: Sequence[int] | None, now: float) -> list[int]:
        """Record that ``d``'s prefill finished on ``d.prefill``.

        Args:
            d: The accepted decision.
            blocks: Blocks the instance now holds (the prompt's), or None when KV events
                report them separately.
            now: Current time.

        Returns:
            Blocks evicted from the instance to make room (empty without a capacity).
        """
        i = d.prefill
        self.queued[i] = max(int(self.queued[i]) - 1, 0)
        if self.queued[i] == 0:
            self._free_at[i] = min(float(self._free_at[i]), now)
        return self.index.insert(i, blocks) if blocks else []

    def decode_done(self, rid: int, now: float) -> None:
        """Close request ``rid``'s decode window (it no longer loads its instance)."""
        k = self._w_n
        hit = np.nonzero(self._w_rid[:k] == rid)[0]
        if len(hit):
            self._w_end[hit] = np.minimum(self._w_end[hit], now)

    def kv_stored(self, instance: int, blocks: Sequence[int]) -> None:
        """KV event: ``instance`` now holds ``blocks`` (prefix order)."""
        self.index.insert(instance, blocks)

    def kv_removed(self, instance: int, blocks: Sequence[int]) -> None:
        """KV event: ``instance`` dropped ``blocks``."""
        self.index.remove(instance, blocks)

    def store_put(self, blocks: Sequence[int]) -> None:
        """The shared store now holds ``blocks``."""
        self.index.insert(self.index.store, blocks)

    def store_removed(self, blocks: Sequence[int]) -> None:
        """The shared store dropped ``blocks``."""
        self.index.remove(self.index.store, blocks)

    def instance_reset(self, instance: int, now: float) -> None:
        """An instance restarted: forget its cache and queue."""
        self.index.clear(instance)
        self.queued[instance] = 0
        self._free_at[instance] = now
        self._nic_free[instance] = now
