"""Store keys of ``MooncakeCoreStoreConnector``'s KV pages (no vLLM import).

One object per (page, layer): ``mcv/<model>/tp<rank>of<size>/<chain>/L<layer>``, where
``<model>`` is the model path's last component (sanitised) and ``<chain>`` a prefix hash
chained over the page's token ids, seeded with ``"<model path>|<dtype>|<page size>"``
(``dtype`` as vLLM prints it, e.g. ``torch.float32``). A page is one vLLM block; only
full prompt pages are stored.

This module is the single definition of that scheme: the connector (inside vLLM) and
``mooncake-core proxy --store-master`` (outside vLLM, asking the master which pages
exist) both compute keys here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "StoreKeyScheme",
    "page_chain",
    "key_prefix",
    "rank_dir",
    "normalize_dtype",
    "scheme_of",
    "tp_size_of",
    "WARM_PREFIX",
]

#: keys of the connector's start-up probe (never a KV page: no "mcv/")
WARM_PREFIX = "mcv-warm-up"

_DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
}


def page_chain(seed: str, tokens: Sequence[int], page: int, n_pages: int) -> list[str]:
    """Hex prefix hashes of the first ``n_pages`` full pages of ``tokens``."""
    h = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    out = []
    for i in range(n_pages):
        chunk = tokens[i * page : (i + 1) * page]
        h = hashlib.blake2b(
            h + b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk), digest_size=16
        ).digest()
        out.append(h.hex())
    return out


def key_prefix(model: str) -> str:
    """``mcv/<model>``: the model path's last component, with unusual characters replaced."""
    name = os.path.basename(str(model).rstrip("/")) or "model"
    return "mcv/" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def rank_dir(rank: int, size: int) -> str:
    """Keys of TP rank ``rank`` of ``size``: shards of different TP sizes never collide."""
    return f"/tp{rank}of{size}/"


def normalize_dtype(dtype: object) -> str:
    """``torch.float32`` for ``torch.float32``, ``"float32"``, ``"fp32"``, ``"float"`` (likewise
    others)."""
    name = str(dtype).strip()
    name = name[6:] if name.startswith("torch.") else name
    return "torch." + _DTYPE_ALIASES.get(name.lower(), name.lower())


@dataclass(frozen=True)
class StoreKeyScheme:
    """How one vLLM deployment names its KV pages in the store.

    Attributes:
        model: the model path or name exactly as vLLM has it (its ``--model``).
        dtype: the dtype vLLM runs with (``torch.float32``, ``float32``, ``bf16``, ...; kept
            normalised as ``torch.<name>``).
        block_size: vLLM's KV block size in tokens (one page).
        tp_size: tensor-parallel size (a page counts only when every rank's shard is stored).
    """

    model: str
    dtype: str
    block_size: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {self.tp_size}")

    @property
    def seed(self) -> str:
        return f"{self.model}|{self.dtype}|{self.block_size}"

    def rank_prefix(self, rank: int) -> str:
        """``mcv/<model>/tp<rank>of<size>/``: the start of every key of that rank."""
        return key_prefix(self.model) + rank_dir(rank, self.tp_size)

    @property
    def prefixes(self) -> list[str]:
        return [self.rank_prefix(r) for r in range(self.tp_size)]

    def pages(self, tokens: Sequence[int], n_pages: int | None = None) -> list[str]:
        """Chain hashes of the first ``n_pages`` (default: all full) pages of ``tokens``."""
        n = len(tokens) // self.block_size if n_pages is None else n_pages
        return page_chain(self.seed, tokens, self.block_size, n)

    def lookup_pages(self, tokens: Sequence[int]) -> list[str]:
        """The pages a lookup asks about: full pages, leaving at least one prompt token to
        compute."""
        return self.pages(tokens, max(0, (len(tokens) - 1) // self.block_size))

    def layer_keys(self, pages: Sequence[str], rank: int, layer: int) -> list[str]:
        """Keys of ``pages`` for one rank and layer."""
        pre = self.rank_prefix(rank)
        return [f"{pre}{p}/L{layer}" for p in pages]

    def exists_keys(self, pages: Sequence[str]) -> list[str]:
        """Layer-0 keys of ``pages`` for every rank, page-major (``tp_size`` keys per page)."""
        pres = self.prefixes
        return [f"{pre}{p}/L0" for p in pages for pre in pres]

    def held_pages(self, exists: Sequence[bool]) -> int:
        """Leading pages whose every rank's shard exists, from a ``batch_exists`` over
        :meth:`exists_keys`."""
        r = self.tp_size
        n = 0
        while (n + 1) * r <= len(exists) and all(exists[n * r : (n + 1) * r]):
            n += 1
        return n


def tp_size_of(vllm_config: Any) -> int:
    """The tensor-parallel size of a vLLM config (1 without a parallel config)."""
    return int(
        getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    )


def scheme_of(vllm_config: Any) -> StoreKeyScheme:
    """The key scheme of a vLLM engine's config (model, dtype, block size, TP size)."""
    mc = vllm_config.model_config
    return StoreKeyScheme(
        str(getattr(mc, "model", "?")),
        str(getattr(mc, "dtype", "?")),
        int(vllm_config.cache_config.block_size),
        tp_size_of(vllm_config),
    )
