"""Store keys of the TensorRT-LLM connector's KV pages (no TensorRT-LLM import).

One object per (page, TP rank): ``mct/<model>/<layout>/tp<rank>of<size>/<chain>``.

- ``<model>``: the model path's last component, unusual characters replaced.
- ``<layout>``: ``bm-<dtype>-t<tokens_per_block>``: the block-major primary pool
  (``[num_blocks, num_layers, kv_factor, tokens_per_block * kv_heads * head_dim]``),
  the KV dtype TensorRT-LLM runs with, and the page size. Pools of another layout,
  dtype or page size never share objects; a pool whose per-block size differs (other
  heads per rank) is caught when an object's size does not match at load time.
- ``tp<rank>of<size>``: each TP rank stores its own shard of a page.
- ``<chain>``: a prefix hash chained over the page's token ids (blake2b, 16 bytes),
  seeded with ``"<model>|<dtype>|<tokens_per_block>|<layout>"``: a page's key depends
  on every token before it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TrtllmKeyScheme", "page_chain", "LAYOUT"]

LAYOUT = "bm"
"""Name of the block-major primary-pool layout in keys."""


def page_chain(seed: str, tokens: Sequence[int], page: int, n_pages: int) -> list[str]:
    """Hex prefix hashes of the first ``n_pages`` full pages of ``tokens``."""
    h = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    out = []
    for i in range(n_pages):
        chunk = tokens[i * page : (i + 1) * page]
        h = hashlib.blake2b(
            h + b"".join(int(t).to_bytes(8, "little", signed=True) for t in chunk),
            digest_size=16,
        ).digest()
        out.append(h.hex())
    return out


def _clean(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def normalize_dtype(dtype: object) -> str:
    """``bfloat16`` for ``torch.bfloat16``, ``"bfloat16"``, ``"bf16"``; ``auto`` stays ``auto``."""
    name = str(dtype or "auto").strip().lower()
    name = name[6:] if name.startswith("torch.") else name
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(
        name, name
    )


@dataclass(frozen=True)
class TrtllmKeyScheme:
    """How one TensorRT-LLM deployment names its KV pages in the store.

    Attributes:
        model: the model path or name as TensorRT-LLM has it (``llm_args.model``).
        dtype: the KV cache dtype (``kv_cache_config.dtype``, else ``llm_args.dtype``;
            ``auto`` means the model's dtype, which the model name fixes).
        tokens_per_block: ``kv_cache_config.tokens_per_block`` (one page).
        tp_size: tensor-parallel size.
    """

    model: str
    dtype: str
    tokens_per_block: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.tokens_per_block <= 0:
            raise ValueError(
                f"kv_cache_config.tokens_per_block must be positive, got {self.tokens_per_block}"
            )
        if self.tp_size <= 0:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tp_size}")

    @property
    def layout(self) -> str:
        return f"{LAYOUT}-{_clean(self.dtype)}-t{self.tokens_per_block}"

    @property
    def seed(self) -> str:
        return f"{self.model}|{self.dtype}|{self.tokens_per_block}|{LAYOUT}"

    def rank_prefix(self, rank: int) -> str:
        """``mct/<model>/<layout>/tp<rank>of<size>/``: the start of every key of that rank."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"TP rank {rank} is outside tensor_parallel_size {self.tp_size}")
        name = _clean(os.path.basename(str(self.model).rstrip("/")) or "model")
        return f"mct/{name}/{self.layout}/tp{rank}of{self.tp_size}/"

    def pages(self, tokens: Sequence[int], n_pages: int | None = None) -> list[str]:
        """Chain hashes of the first ``n_pages`` (default: all full) pages of ``tokens``."""
        n = len(tokens) // self.tokens_per_block if n_pages is None else n_pages
        return page_chain(self.seed, tokens, self.tokens_per_block, n)

    def keys(self, pages: Sequence[str], rank: int) -> list[str]:
        """Keys of ``pages`` for one TP rank."""
        pre = self.rank_prefix(rank)
        return [pre + p for p in pages]

    def exists_keys(self, pages: Sequence[str], ranks: Sequence[int]) -> list[str]:
        """Keys of ``pages`` for ``ranks``, page-major (``len(ranks)`` keys per page)."""
        pres = [self.rank_prefix(r) for r in ranks]
        return [pre + p for p in pages for pre in pres]

    @staticmethod
    def held_pages(exists: Sequence[bool], per_page: int) -> int:
        """Leading pages whose every key exists, from ``batch_exists`` over :meth:`exists_keys`."""
        n = 0
        while (n + 1) * per_page <= len(exists) and all(exists[n * per_page : (n + 1) * per_page]):
            n += 1
        return n
