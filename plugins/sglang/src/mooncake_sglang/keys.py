"""Store keys for SGLang pages (no SGLang import).

SGLang names a page by a hash chain (``sglang.srt.mem_cache.utils.get_hash_str``): page
*i*'s key is ``sha256(digest of page i-1 || page i's token ids)`` in hex, the tokens as
little-endian uint32 (uint64 after a ``0xff`` tag byte if any id needs it).
:func:`page_hashes` reproduces it, for tests and tools; the backend itself receives
the hashes from SGLang and never recomputes them.

A page hash only names tokens; the bytes depend on who stored them. :class:`KeyScheme`
turns a hash into store keys that also carry everything the bytes depend on, so a
reader with another model, shard or geometry misses instead of reading wrong bytes::

    sgl/<namespace/><model>/<geometry>/<shard>/<page hash>/<part>

- ``geometry``: 12 hex digits over the object format (token-major for ``page_first``,
  layer-major for ``page_first_direct`` and ``layer_first``, which share objects),
  layers, heads of this shard, head dim, dtype, page size and MHA/MLA;
- ``shard``: ``tp<r>of<T>`` for MHA (each rank its heads; ``_pp<p>of<P>``,
  ``_cp<c>of<C>`` when used), ``mla`` for MLA (one copy for all ranks; ``_pp..`` too);
- ``part``: ``k`` and ``v`` for MHA (two objects per page), ``kv`` for MLA.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["page_hashes", "KeyScheme"]

_U32 = 0xFFFFFFFF


def page_hashes(tokens: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's page hash chain over the full pages of ``tokens``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out: list[str] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = [int(t) for t in tokens[start : start + page_size]]
        h = hashlib.sha256(prior)
        if all(0 <= t <= _U32 for t in page):
            h.update(struct.pack(f"<{page_size}I", *page))
        else:
            h.update(b"\xff")
            h.update(struct.pack(f"<{page_size}Q", *(t & 0xFFFFFFFFFFFFFFFF for t in page)))
        prior = h.digest()
        out.append(prior.hex())
    return out


@dataclass(frozen=True)
class KeyScheme:
    """How one backend instance (one rank) names its objects.

    Attributes:
        model: served model name (``/`` kept, spaces replaced).
        token_major: object bytes ordered token, layer, head (``page_first``) rather
            than layer, token, head.
        num_layers, heads, head_dim, dtype, page_size: geometry of one object.
        mla: one replicated latent object per page instead of K and V per rank.
        tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size: the shard.
        namespace: optional tenant prefix.
    """

    model: str
    token_major: bool
    num_layers: int
    heads: int
    head_dim: int
    dtype: str
    page_size: int
    mla: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    namespace: str = ""

    @property
    def parts(self) -> tuple[str, ...]:
        return ("kv",) if self.mla else ("k", "v")

    @property
    def geometry(self) -> str:
        text = (
            f"v1|{'tok' if self.token_major else 'lyr'}|L{self.num_layers}|H{self.heads}"
            f"|D{self.head_dim}|{self.dtype}|P{self.page_size}|{'mla' if self.mla else 'mha'}"
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def shard(self) -> str:
        s = "mla" if self.mla else f"tp{self.tp_rank}of{self.tp_size}"
        if self.pp_size > 1:
            s += f"_pp{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1 and not self.mla:
            s += f"_cp{self.cp_rank}of{self.cp_size}"
        return s

    @property
    def model_prefix(self) -> str:
        """Every key of this model (all geometries and shards) starts with this."""
        model = (self.model or "unnamed-model").strip().replace(" ", "_")
        ns = f"{self.namespace.strip('/')}/" if self.namespace else ""
        return f"sgl/{ns}{model}/"

    @property
    def prefix(self) -> str:
        """Every key of this rank's shard starts with this."""
        return f"{self.model_prefix}{self.geometry}/{self.shard}/"

    def keys(self, page_hash: str) -> list[str]:
        """The store keys of one page, one per part."""
        if not page_hash:
            raise ValueError("empty page hash: SGLang passes one hex hash per page")
        return [f"{self.prefix}{page_hash}/{p}" for p in self.parts]

    def batch_keys(self, page_hashes_: Sequence[str]) -> list[str]:
        """Keys of many pages, page-major (``len(parts)`` per page)."""
        out: list[str] = []
        for h in page_hashes_:
            out.extend(self.keys(h))
        return out
