"""The parallel topology of one weight placement: axis sizes and the participants."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mooncake_core.compat.reshard.contracts import ParticipantId, TopologyId
from mooncake_core.compat.reshard.weight.types import (
    ParallelRank,
    canonical_json_sha,
    check_int,
    check_text,
    require_manifest_items,
)

__all__ = ["ParallelTopology", "TopologyParticipant"]

_AXES = ("tp", "pp", "ep", "dp")


@dataclass(frozen=True)
class TopologyParticipant:
    """One runtime participant and its parallel coordinates."""

    participant_id: ParticipantId
    rank: ParallelRank

    def __post_init__(self) -> None:
        check_text(self.participant_id, "participant_id")
        if not isinstance(self.rank, ParallelRank):
            raise ValueError("topology participant rank must be a ParallelRank")


@dataclass(frozen=True, init=False)
class ParallelTopology:
    """TP/PP/EP/DP sizes and the participants (sorted by id), with a canonical id.

    ``world_size`` counts the participants; it is not the product of the sizes (TP and
    EP may share workers, and a placement may hold one DP replica of a larger run)."""

    tp_size: int
    pp_size: int
    ep_size: int
    dp_size: int
    participants: tuple[TopologyParticipant, ...]
    topology_id: TopologyId

    def __init__(
        self,
        *,
        tp_size: int,
        pp_size: int,
        ep_size: int,
        dp_size: int,
        participants: tuple[TopologyParticipant, ...],
        topology_id: TopologyId | None = None,
    ) -> None:
        sizes = {"tp": tp_size, "pp": pp_size, "ep": ep_size, "dp": dp_size}
        for axis in _AXES:
            check_int(sizes[axis], f"{axis}_size", minimum=1)
        members = require_manifest_items(
            participants, "ParallelTopology participants", TopologyParticipant
        )
        if not members:
            raise ValueError("parallel topology participants must not be empty")
        members = tuple(sorted(members, key=lambda p: p.participant_id))
        if len({p.participant_id for p in members}) != len(members):
            raise ValueError("duplicate topology participant_id")
        if len({p.rank for p in members}) != len(members):
            raise ValueError("duplicate topology parallel rank")
        for member in members:
            for axis in _AXES:
                if getattr(member.rank, axis) >= sizes[axis]:
                    raise ValueError(
                        f"{axis} rank is out of range for participant {member.participant_id}"
                    )
        content = {
            "schema": "weight-parallel-topology",
            **{f"{axis}_size": sizes[axis] for axis in _AXES},
            "participants": [asdict(p) for p in members],
        }
        canonical = TopologyId(f"sha256:{canonical_json_sha(content)}")
        if topology_id is not None and topology_id != canonical:
            raise ValueError("topology_id does not match canonical topology")
        for axis in _AXES:
            object.__setattr__(self, f"{axis}_size", sizes[axis])
        object.__setattr__(self, "participants", members)
        object.__setattr__(self, "topology_id", canonical)

    @property
    def world_size(self) -> int:
        """How many participants there are."""
        return len(self.participants)

    def participant(self, participant_id: ParticipantId) -> TopologyParticipant:
        """The participant with this id (``ValueError`` if none)."""
        for member in self.participants:
            if member.participant_id == participant_id:
                return member
        raise ValueError(f"unknown topology participant: {participant_id}")
