"""Configuration of one elastic EP layer (identical on every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_core.ep.routing import POLICIES, Policy
from mooncake_core.errors import ConfigError

__all__ = ["TRANSPORTS", "EPConfig"]

TRANSPORTS: tuple[str, ...] = ("auto", "shm", "collective")


@dataclass(frozen=True)
class EPConfig:
    """Sizes, policy and timeouts of an elastic EP layer.

    Attributes:
        num_experts: logical experts ``E``.
        num_seats: EP ranks ``R`` (seat capacity; ranks may die and rejoin).
        slots_per_rank: physical expert slots per rank ``S``; ``R*S - E`` are redundant.
        hidden: hidden size ``H``.
        top_k: experts per token ``K``.
        policy: what to do with an expert that has no live replica.
        timeout_s: per-collective timeout; a rank silent for longer is treated as failed.
        connect_timeout_s: rendezvous timeout of ``start()`` (process start-up is slow).
        heartbeat_s: heartbeat period.
        stale_s: a heartbeat older than this marks its rank dead during a transition.
        join_poll_s: how often the leader checks for join requests.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA; untested here).
        transport: where dispatch/combine rows travel. ``"auto"``: the same-host shared-memory
            plane (:mod:`mooncake_core.ep.shm`) when every member of the epoch can map the
            others' buffers, else the group's all-to-all; ``"shm"``: require the plane (an
            epoch whose members cannot use it fails to install); ``"collective"``: always
            the group's all-to-all. Headers always go over the group.
        host: address the backend binds to.
        prefix: store key prefix (one per EP layer group).
    """

    num_experts: int
    num_seats: int
    slots_per_rank: int
    hidden: int
    top_k: int
    policy: Policy = "renormalize"
    timeout_s: float = 2.0
    connect_timeout_s: float = 60.0
    heartbeat_s: float = 0.1
    stale_s: float = 1.0
    join_poll_s: float = 0.2
    backend: str = "gloo"
    transport: str = "auto"
    host: str = "127.0.0.1"
    prefix: str = "mooncake/ep"

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_seats", "slots_per_rank", "hidden", "top_k"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ep.{name} must be positive; got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"ep.policy {self.policy!r} is not one of {POLICIES}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"ep.top_k {self.top_k} > num_experts {self.num_experts}")
        if self.slots_per_rank > self.num_experts:
            raise ConfigError(
                f"ep.slots_per_rank {self.slots_per_rank} > num_experts {self.num_experts}: "
                "a rank holds each expert at most once"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"ep.transport {self.transport!r} is not one of {TRANSPORTS}")
        if (
            min(self.timeout_s, self.heartbeat_s, self.stale_s) <= 0
            or self.stale_s <= self.heartbeat_s
        ):
            raise ConfigError("ep timeouts must be positive and stale_s > heartbeat_s")
