"""What an adapter hands the conformance suite: its KV layout and a harness that drives it.

Contract, in engine-neutral words (an adapter's harness translates them):

- A *page* is the engine's unit of stored KV: an SGLang page, a vLLM block. It covers
  ``page_size`` tokens; only full pages are stored.
- A *slot* is where one page lives in the engine's own KV memory: a page of SGLang's
  host pool, a vLLM GPU block id. A harness owns ``num_slots`` of them.
- ``fill(slot, seed)`` writes deterministic content derived from ``seed`` (and, for
  sharded layouts, from the rank) into every part of the slot this rank holds;
  ``read(slot)`` returns those bytes in a fixed order. The suite only compares them.
- ``save(tokens, slots)`` stores page *i* of ``tokens`` from ``slots[i]`` and returns
  how many pages, counted from the first, the adapter reports stored.
- ``lookup(tokens)`` is the engine's hit query: how many leading pages are present.
- ``load(tokens, slots)`` reads page *i* into ``slots[i]`` and returns how many leading
  pages the adapter reports loaded. Pages at or past that count are not looked at.
- ``page_keys(tokens)`` lists, per full page, the store keys the adapter uses for it;
  ``expected_objects`` (optional) says which bytes each key must hold, computed
  independently of the adapter, so the suite can check the mapping onto store objects.

Failures of the store must come back as counts (a miss, a shorter prefix), never as
exceptions; bad input from the engine (wrong sizes, unknown slots) must raise
``ValueError``/``IndexError``/``KeyError`` (or a ``MooncakeError``) with a message.

A :class:`HarnessSpec` is plain data, so worker processes can build the same harness:
``build_harness(spec)`` imports ``spec.factory`` (``"module:function"``) and calls it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = ["KVLayout", "HarnessSpec", "EngineHarness", "build_harness"]


@dataclass(frozen=True)
class KVLayout:
    """One KV layout an engine offers, small enough for tests.

    Attributes:
        name: the engine's name for the memory layout (``"page_first"``, ``"layer_first"``).
        num_layers: layers of the model (of this pipeline stage).
        page_size: tokens per page.
        num_kv_heads: KV heads of the whole model; a TP rank holds ``num_kv_heads // tp_size``.
        head_dim: per-head width (for MLA: the latent width ``kv_lora_rank + rope dim``).
        dtype: element type, a torch/numpy name.
        mla: one latent copy replicated on every rank (MLA); only one rank writes.
        tp_size: tensor-parallel ranks; every rank runs its own harness.
        num_slots: pages of KV memory each harness allocates.
    """

    name: str
    num_layers: int = 4
    page_size: int = 16
    num_kv_heads: int = 4
    head_dim: int = 32
    dtype: str = "bfloat16"
    mla: bool = False
    tp_size: int = 1
    num_slots: int = 32

    @property
    def label(self) -> str:
        """Short id for test names: ``page_first-mha-tp2``."""
        return f"{self.name}-{'mla' if self.mla else 'mha'}-tp{self.tp_size}"

    def replace(self, **changes: Any) -> KVLayout:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class HarnessSpec:
    """Everything needed to build a harness, in this process or another one.

    Attributes:
        factory: ``"module:function"``; ``function(spec) -> EngineHarness``.
        layout: the KV layout to use.
        master: store master address (``127.0.0.1:PORT``).
        model: model name the engine would report (keys must depend on it).
        rank: tensor-parallel rank of this harness (``0 <= rank < layout.tp_size``).
        options: adapter-specific knobs (timeouts, backend variant, ...), JSON-serialisable.
    """

    factory: str
    layout: KVLayout
    master: str
    model: str = "conformance/model-a"
    rank: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> HarnessSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["options"] = dict(self.options)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HarnessSpec:
        d = json.loads(text)
        d["layout"] = KVLayout(**d["layout"])
        return cls(**d)


class EngineHarness(ABC):
    """One engine rank driving its adapter, with ``num_slots`` pages of its own KV memory.

    *Called by* the suite, from one thread at a time unless a check says otherwise.
    """

    def __init__(self, spec: HarnessSpec) -> None:
        self.spec = spec

    # ------------------------------------------------------------------ geometry
    @property
    def page_size(self) -> int:
        return self.spec.layout.page_size

    @property
    def num_slots(self) -> int:
        return self.spec.layout.num_slots

    @property
    def is_writer(self) -> bool:
        """Whether this rank's saves reach the store (False for MLA ranks other than 0)."""
        return not self.spec.layout.mla or self.spec.rank == 0

    # ------------------------------------------------------------------ engine memory
    @abstractmethod
    def fill(self, slot: int, seed: int) -> None:
        """Write content derived from ``seed`` (and the rank, unless MLA) into ``slot``."""

    @abstractmethod
    def read(self, slot: int) -> bytes:
        """This rank's bytes of ``slot``, in a fixed order."""

    # ------------------------------------------------------------------ adapter calls
    @abstractmethod
    def page_keys(self, tokens: Sequence[int]) -> list[list[str]]:
        """Store keys the adapter uses, per full page of ``tokens``."""

    @abstractmethod
    def save(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Store the full pages of ``tokens`` from ``slots``; leading pages reported stored."""

    @abstractmethod
    def lookup(self, tokens: Sequence[int]) -> int:
        """Leading full pages of ``tokens`` the adapter reports present."""

    @abstractmethod
    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Read the full pages of ``tokens`` into ``slots``; leading pages reported loaded."""

    def expected_objects(
        self, tokens: Sequence[int], slots: Sequence[int]
    ) -> dict[str, bytes] | None:
        """The store objects saving ``slots`` must create, computed independently of the
        adapter; ``None`` if the adapter's object format is opaque (the check is skipped)."""
        return None

    def bad_inputs(self) -> dict[str, Callable[[], object]]:
        """Engine-specific bad calls, by description; each must raise a clear error."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook, nothing to release by default)
        """Release the adapter and the engine memory."""

    def __enter__(self) -> EngineHarness:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def build_harness(spec: HarnessSpec) -> EngineHarness:
    """Import ``spec.factory`` and build the harness it describes."""
    modname, sep, attr = spec.factory.partition(":")
    if not sep or not attr:
        raise ValueError(
            f"harness factory {spec.factory!r} must look like 'package.module:function'"
        )
    fn = getattr(importlib.import_module(modname), attr)
    harness = fn(spec)
    if not isinstance(harness, EngineHarness):
        raise TypeError(f"{spec.factory} returned {type(harness).__name__}, not an EngineHarness")
    return harness
