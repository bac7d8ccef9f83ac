"""Prefill-instance selection policies.

Contract: a :class:`Policy` gets a :class:`PrefillView` (per-instance queue wait, locally
cached prefix, the best prefix anywhere and the TTFT estimates the conductor already
computed) and returns a :class:`PrefillChoice`: which instance runs the prefill and whether
it first fetches the missing prefix from the best remote holder. Policies are pure apart
from the seeded RNG of ``random``; the conductor owns all state.

Policies (command-line names):

- ``random``: a uniformly random instance (seeded).
- ``least-load``: the instance with the least queued prefill work (load balancing).
- ``local-cache``: minimum of queue + prefill time given the instance's *own* cached
  prefix (each instance's prefix cache, no pooling).
- ``global-cache``: Mooncake's Algorithm 1; for each instance the better of recomputing
  beyond its own prefix and fetching the longer prefix held by another instance or the
  store (only if it is longer by more than the balancing threshold), minimum TTFT wins.

All policies still use whatever prefix the chosen instance holds locally.

This module is the one definition of these concepts: the PD proxy (``mooncake-core
proxy``) routes with the same rules over live instances: its ``least-load`` picks with
:func:`least_loaded` (ties rotate there, so an idle cluster is spread), its
``global-cache`` runs a :class:`~mooncake_core.conductor.Conductor` with
:class:`GlobalCachePolicy`, and both it and the KV-event listener name prompt blocks with
:func:`prefix_blocks` / :func:`chain_block`.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_core.errors import ConfigError

__all__ = [
    "POLICIES",
    "Policy",
    "PrefillChoice",
    "PrefillView",
    "chain_block",
    "least_loaded",
    "make_policy",
    "prefix_blocks",
    "token_chunk",
]

logger = logging.getLogger(__name__)

_ID_MASK = (1 << 62) - 1


def token_chunk(tokens: Sequence[int]) -> bytes:
    """The bytes one block of token ids is hashed over."""
    return ",".join(map(str, tokens)).encode()


def chain_block(prev: bytes, chunk: bytes) -> tuple[bytes, int]:
    """Chain one block onto ``prev`` (``b""`` at a prompt's start): its digest and block id."""
    h = hashlib.blake2b(prev + chunk, digest_size=8).digest()
    return h, int.from_bytes(h, "little") & _ID_MASK


def prefix_blocks(prompt: Sequence[int] | str, block_tokens: int = 32) -> tuple[int, ...]:
    """Chained ids of a prompt's full blocks (text prompts: 4 characters ~ 1 token)."""
    if isinstance(prompt, str):
        unit = prompt.encode()
        step = block_tokens * 4
        chunks = [unit[i : i + step] for i in range(0, len(unit) - step + 1, step)]
    else:
        toks = list(prompt)
        chunks = [
            token_chunk(toks[i : i + block_tokens])
            for i in range(0, len(toks) - block_tokens + 1, block_tokens)
        ]
    out: list[int] = []
    h = b""
    for c in chunks:
        h, bid = chain_block(h, c)
        out.append(bid)
    return tuple(out)


def least_loaded(loads: Sequence[Any] | np.ndarray, start: int = 0) -> int:
    """Index of the smallest of ``loads``; ties go to the first at or after ``start``, cyclically.

    ``loads`` are comparable values (numbers, or tuples for tie-breaking keys).
    """
    n = len(loads)
    return min(((start + k) % n for k in range(n)), key=loads.__getitem__)


@dataclass(frozen=True, slots=True)
class PrefillView:
    """What a policy sees for one request (arrays have one entry per prefill instance).

    Attributes:
        wait_s: Predicted time until each instance can start this prefill.
        local_blocks: Prefix length (blocks) each instance holds.
        ttft_local_s: Predicted TTFT when computing everything beyond the local prefix.
        ttft_fetch_s: Predicted TTFT when first fetching the best remote prefix
            (``inf`` where fetching is not allowed or not worth it).
        fetch_reach_blocks: Prefix length (blocks) an instance has after that fetch (the
            remote source's match; 0 when nothing can be fetched).
    """

    wait_s: np.ndarray
    local_blocks: np.ndarray
    ttft_local_s: np.ndarray
    ttft_fetch_s: np.ndarray
    fetch_reach_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """A policy's answer: the instance and whether it fetches the remote prefix."""

    instance: int
    fetch: bool


class Policy(ABC):
    """Base of the prefill selection policies.

    Attributes:
        name: Command-line name.
        uses_remote: Whether the conductor should compute fetch options for it.
    """

    name: str = ""
    uses_remote: bool = False

    @abstractmethod
    def choose(self, view: PrefillView) -> PrefillChoice:
        """Pick the prefill instance for one request.

        Called by: :meth:`Conductor.decide`, once per request. Blocking: no.
        """


class RandomPolicy(Policy):
    """Uniformly random instance from a seeded generator."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def choose(self, view: PrefillView) -> PrefillChoice:
        return PrefillChoice(int(self._rng.integers(len(view.wait_s))), False)


class LeastLoadPolicy(Policy):
    """Least queued work (:func:`least_loaded`); ties go to the lowest index."""

    name = "least-load"

    def choose(self, view: PrefillView) -> PrefillChoice:
        return PrefillChoice(least_loaded(view.wait_s), False)


class LocalCachePolicy(Policy):
    """Minimum TTFT using only each instance's own cached prefix."""

    name = "local-cache"

    def choose(self, view: PrefillView) -> PrefillChoice:
        return PrefillChoice(int(np.argmin(view.ttft_local_s)), False)


class GlobalCachePolicy(Policy):
    """Minimum TTFT over instances x {recompute, fetch the best remote prefix}.

    Args:
        holder_margin: The instance holding the longest local prefix (strictly longer than
            any other's) keeps the request unless another option is predicted faster by more
            than this share of the best prediction: it runs there when its TTFT is at most
            ``(1 + holder_margin)`` times the minimum. 0 (default) is the plain minimum, right
            when the predictions are exact (the simulator). A live proxy predicts with each
            instance's *measured* speed, an estimate whose error between like instances
            easily exceeds the few percent a short prefix saves; without a margin that error
            alone sends a request away from an idle holder of its prefix. The margin only
            guards a prefix that would be lost: when the best option fetches a prefix at
            least as long as the holder's (the store holds all of it), leaving the holder
            costs only the fetch, which the prediction already counts, so the plain minimum
            decides (a busy holder no longer keeps its later turns).
    """

    name = "global-cache"
    uses_remote = True

    def __init__(self, holder_margin: float = 0.0) -> None:
        if not (holder_margin >= 0 and np.isfinite(holder_margin)):
            raise ConfigError(f"holder_margin must be a finite number >= 0, got {holder_margin!r}")
        self.holder_margin = float(holder_margin)
        #: decisions where the margin kept the request on its holder (the minimum was elsewhere)
        self.kept_by_margin = 0

    def choose(self, view: PrefillView) -> PrefillChoice:
        i = int(np.argmin(view.ttft_local_s))
        j = int(np.argmin(view.ttft_fetch_s))
        if view.ttft_fetch_s[j] < view.ttft_local_s[i]:
            best, t_best = PrefillChoice(j, True), float(view.ttft_fetch_s[j])
        else:
            best, t_best = PrefillChoice(i, False), float(view.ttft_local_s[i])
        if self.holder_margin > 0 and best.instance != (h := self.holder(view.local_blocks)):
            if h >= 0 and best.fetch and view.fetch_reach_blocks >= int(view.local_blocks[h]):
                return best  # nothing the holder has is lost by going elsewhere
            if h >= 0 and view.ttft_local_s[h] <= (1.0 + self.holder_margin) * t_best:
                self.kept_by_margin += 1
                return PrefillChoice(h, False)
        return best

    @staticmethod
    def holder(local_blocks: np.ndarray) -> int:
        """The instance with the strictly longest local prefix, -1 if none (ties or none)."""
        if len(local_blocks) == 0:
            return -1
        h = int(np.argmax(local_blocks))
        top = int(local_blocks[h])
        if top <= 0 or int(np.count_nonzero(local_blocks == top)) > 1:
            return -1
        return h


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RandomPolicy, LeastLoadPolicy, LocalCachePolicy, GlobalCachePolicy)
}


def make_policy(name: str, seed: int = 0, holder_margin: float = 0.0) -> Policy:
    """Build the policy named ``name`` (see :data:`POLICIES`); ``holder_margin`` is
    :class:`GlobalCachePolicy`'s (ignored by the others).

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if cls is RandomPolicy:
        return RandomPolicy(seed)
    if cls is GlobalCachePolicy:
        return GlobalCachePolicy(holder_margin)
    return cls()
