"""Where a page's bytes live in SGLang's host memory pool, per layout.

SGLang's host pools (``sglang.srt.mem_cache.pool_host``) keep K and V as two halves
of ``kv_buffer`` (MHA) or one latent buffer (MLA). Per layout, the part of one page
that becomes one store object is:

==================  =========================  ==========================  ===========
layout              MHA part (K or V)          MLA part                    object
==================  =========================  ==========================  ===========
page_first          ``[size, L, H, D][s:s+P]`` ``[size, L, 1, D][s:s+P]``  contiguous, token-major
page_first_direct   ``[pages, L, P, H, D][p]`` ``[pages, L, P, 1, D][p]``  contiguous, layer-major
layer_first         ``[L, size, H, D][:, s:s+P]`` ``[L, size, 1, D][:, ..]``  gathered, layer-major
==================  =========================  ==========================  ===========

Contiguous parts move zero-copy from their address in the (registered) pool;
``layer_first`` parts are gathered into a staging tensor (one copy) and scattered back
on load. ``page_first_direct`` and ``layer_first`` objects have the same bytes, so the
two layouts share stored pages; ``page_first`` objects are token-major and get keys of
their own (see :mod:`mooncake_sglang.keys`). Other layouts (``page_head``,
``page_first_kv_split``, ``page_unified``) are refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mooncake_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PoolView", "SUPPORTED_LAYOUTS"]

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "layer_first")


class PoolView:
    """Byte-level view of one SGLang host pool (MHA or MLA).

    Args:
        pool: the ``HostKVCache`` SGLang registered (needs ``kv_buffer``, ``layout``,
            ``page_size``, ``size``).
        mla: whether the pool holds one replicated latent (``storage_config.is_mla_model``).
    """

    def __init__(self, pool: Any, mla: bool) -> None:
        layout = str(getattr(pool, "layout", ""))
        if layout not in SUPPORTED_LAYOUTS:
            raise ConfigError(
                f"host pool layout {layout!r} is not supported by mooncake_core's SGLang backend; "
                f"use --hicache-mem-layout {' or '.join(SUPPORTED_LAYOUTS)}"
            )
        if int(getattr(pool, "dcp_size", 1)) != 1:
            raise ConfigError(
                "decode context parallelism (dcp_size > 1) is not supported by mooncake_core's "
                "SGLang backend yet"
            )
        kv = pool.kv_buffer
        if isinstance(kv, (list, tuple)):
            raise ConfigError(
                f"host pool {type(pool).__name__} has split buffers; only single-buffer MHA/MLA "
                "pools are supported"
            )
        self.pool = pool
        self.layout = layout
        self.mla = mla
        self.page_size = int(pool.page_size)
        self.size = int(pool.size)
        self.token_major = layout == "page_first"
        self.contiguous = layout != "layer_first"
        want = {"page_first": 4, "page_first_direct": 5, "layer_first": 4}[layout] + (
            0 if mla else 1
        )
        if kv.dim() != want:
            kind = "MLA" if mla else "MHA"
            raise ConfigError(
                f"{kind} host pool with layout {layout!r} should have a {want}-d kv_buffer, "
                f"got shape {tuple(kv.shape)}; is storage_config.is_mla_model right?"
            )
        self.parts: list[torch.Tensor] = [kv] if mla else [kv[0], kv[1]]
        self.part_names = ("kv",) if mla else ("k", "v")
        p0 = self.parts[0]
        self.itemsize = int(p0.element_size())
        self.dtype = str(p0.dtype).removeprefix("torch.")
        if layout == "page_first":  # [size, L, H, D]
            self.num_layers, self.heads, self.head_dim = (int(x) for x in p0.shape[1:])
        elif layout == "page_first_direct":  # [pages, L, P, H, D]
            self.num_layers, self.heads, self.head_dim = (
                int(p0.shape[1]),
                int(p0.shape[3]),
                int(p0.shape[4]),
            )
        else:  # [L, size, H, D]
            self.num_layers, self.heads, self.head_dim = (
                int(p0.shape[0]),
                int(p0.shape[2]),
                int(p0.shape[3]),
            )
        self.object_shape = (
            (self.page_size, self.num_layers, self.heads, self.head_dim)
            if self.token_major
            else (self.num_layers, self.page_size, self.heads, self.head_dim)
        )
        self.object_nbytes = (
            self.page_size * self.num_layers * self.heads * self.head_dim * self.itemsize
        )
        self.page_nbytes = self.object_nbytes * len(self.parts)
        for t in self.parts:
            if not t.is_contiguous() and self.contiguous:
                raise ConfigError("host pool buffers must be contiguous")

    # ------------------------------------------------------------------ validation
    def page_starts(self, host_indices: Any, npages: int) -> list[int]:
        """First token index of each page; raises ``ValueError`` on anything SGLang would not
        send."""
        import torch

        if not isinstance(host_indices, torch.Tensor):
            host_indices = torch.as_tensor(host_indices)
        if (
            host_indices.dim() != 1
            or host_indices.dtype.is_floating_point
            or host_indices.dtype == torch.bool
        ):
            raise ValueError(
                f"host_indices must be a 1-d integer tensor, got {host_indices.dtype} with shape "
                f"{tuple(host_indices.shape)}"
            )
        P = self.page_size
        if host_indices.numel() != npages * P:
            raise ValueError(
                f"{npages} page keys need {npages * P} host indices (page_size {P}), got "
                f"{host_indices.numel()}"
            )
        if npages == 0:
            return []
        idx = host_indices.to(torch.int64).view(npages, P)
        starts = idx[:, 0]
        lo, hi = int(starts.min()), int(starts.max())
        if lo < 0 or hi + P > self.size:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"host index {bad} is outside the host pool of {self.size} tokens "
                f"({self.size // P} pages of {P})"
            )
        if bool((starts % P != 0).any()):
            raise ValueError(
                f"page {int((starts % P != 0).nonzero()[0, 0])} does not start on a page boundary "
                f"(page_size {P}); host_indices must be whole pages"
            )
        if P > 1 and not bool((idx - starts[:, None] == torch.arange(P)).all()):
            raise ValueError("each page's host indices must be consecutive tokens of one host page")
        return [int(s) for s in starts.tolist()]

    # ------------------------------------------------------------------ contiguous layouts
    def address(self, part: int, start: int) -> int:
        """Address of one page's part (contiguous layouts)."""
        t = self.parts[part]
        if self.layout == "page_first":
            off = start * int(t.stride(0))
        else:  # page_first_direct
            off = (start // self.page_size) * int(t.stride(0))
        return int(t.data_ptr()) + off * self.itemsize

    def region(self, part: int) -> tuple[int, int]:
        """(address, bytes) of a whole part buffer, for registration."""
        t = self.parts[part]
        return int(t.data_ptr()), int(t.numel()) * self.itemsize

    # ------------------------------------------------------------------ layer_first
    def _token_index(self, starts: list[int]) -> torch.Tensor:
        import torch

        base = torch.tensor(starts, dtype=torch.int64)[:, None]
        return (base + torch.arange(self.page_size)).reshape(-1)

    def gather(self, part: int, starts: list[int]) -> torch.Tensor:
        """Pages of ``part`` as a contiguous ``[n, L, P, H, D]`` tensor (layer_first)."""
        t = self.parts[part]
        n = len(starts)
        sel = t.index_select(1, self._token_index(starts))  # [L, n*P, H, D]
        return (
            sel.view(self.num_layers, n, self.page_size, self.heads, self.head_dim)
            .transpose(0, 1)
            .contiguous()
        )

    def scatter(self, part: int, starts: list[int], pages: torch.Tensor) -> None:
        """Write ``[n, L, P, H, D]`` pages back into ``part`` (layer_first)."""
        t = self.parts[part]
        n = len(starts)
        src = pages.view(n, self.num_layers, self.page_size, self.heads, self.head_dim).transpose(
            0, 1
        )
        t.index_copy_(
            1,
            self._token_index(starts),
            src.reshape(self.num_layers, n * self.page_size, self.heads, self.head_dim),
        )

    def staging(self, npages: int) -> torch.Tensor:
        """A fresh ``[n, L, P, H, D]`` tensor of this pool's dtype."""
        import torch

        return torch.empty(
            (npages, self.num_layers, self.page_size, self.heads, self.head_dim),
            dtype=self.parts[0].dtype,
        )
