"""Conformance harness for SGLang: SGLang's real classes on CPU, driven as HiCache does.

What is real here: SGLang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` host
pools (allocated on CPU, unpinned), ``HiCacheStorageConfig``,
``StorageBackendFactory.create_backend`` (the ``dynamic`` path, or ``mooncake`` for the
built-in backend on our compat layer), and ``HiCacheController``'s own
``_page_backup`` / ``_page_get_zero_copy`` / ``_generic_page_get`` methods, run on a
minimal controller object. What is not: SGLang's scheduler, GPU pools and server; page
hashes come from :func:`mooncake_sglang.keys.page_hashes` (SGLang's algorithm).

``sglang.srt.mem_cache.pool_host`` pulls in model configs that import ``torchvision``;
PyPI's torchvision builds are CUDA ones that break on a CPU torch, so on a machine
without torchvision the caller installs an inert stand-in module first: the SGLang tests'
``torchvision_stand_in`` (their ``conftest.py`` does; ``mooncake-core bench sglang``
loads it by path). Torch and SGLang are imported inside the functions that use them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mooncake_conformance.harness import EngineHarness, HarnessSpec, KVLayout

from mooncake_sglang.keys import page_hashes

if TYPE_CHECKING:
    import torch

__all__ = ["SGLangHarness", "make_harness", "import_sglang_pools", "build_host_pool"]

STORAGE_BATCH = 128


def import_sglang_pools() -> None:
    """Import SGLang's host pool modules (without torchvision: install the stand-in first, see
    module doc)."""
    if "sglang.srt.mem_cache.pool_host.mha" in sys.modules:
        return
    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mla  # noqa: F401


def build_host_pool(layout: KVLayout, rank: int = 0) -> Any:
    """One of SGLang's host pools for ``layout`` (this rank's heads), on CPU."""
    import torch

    import_sglang_pools()
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = getattr(torch, layout.dtype)
    L, P = layout.num_layers, layout.page_size
    dev_tokens = P * 4  # a tiny stand-in for the GPU pool; only its geometry matters here
    capacity = (layout.num_slots + 1) * P
    common: dict[str, Any] = {
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": dev_tokens,
        "start_layer": 0,
        "end_layer": L,
        "host_token_capacity": capacity,
    }
    if layout.mla:
        bufs = tuple(torch.zeros(dev_tokens, 1, layout.head_dim, dtype=dtype) for _ in range(L))
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        rope = min(8, layout.head_dim // 2)
        info = MLABufferInfo(
            buffers=bufs,
            data_ptrs=ptrs,
            layer_indices=tuple(range(L)),
            device_layer_num=L,
            page_size=P,
            kv_lora_rank=layout.head_dim - rope,
            qk_rope_head_dim=rope,
            kv_cache_dim=layout.head_dim,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        return MLATokenToKVPoolHost(info, 2.0, 0, P, layout.name, target_layer_num=L, **common)
    heads = layout.num_kv_heads // layout.tp_size
    k = tuple(torch.zeros(dev_tokens, heads, layout.head_dim, dtype=dtype) for _ in range(L))
    v = tuple(torch.zeros(dev_tokens, heads, layout.head_dim, dtype=dtype) for _ in range(L))
    buffers = KVBuffers(
        k=k,
        v=v,
        k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
        v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
        layout=KVBufferLayout.NHD,
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=P,
        head_num=heads,
        head_dim=layout.head_dim,
        v_head_dim=layout.head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(info, 2.0, 0, P, layout.name, **common)


class _Operation:
    """The bits of SGLang's StorageOperation/PrefetchOperation the controller methods read."""

    def __init__(self, hashes: list[str], host_indices: torch.Tensor) -> None:
        self.hash_value = hashes
        self.host_indices = host_indices
        self.prefix_keys: list[str] | None = None
        self.completed_tokens = 0
        self.request_id = "conformance"

    def is_terminated(self) -> bool:
        return False


class SGLangHarness(EngineHarness):
    """One SGLang rank: a real host pool, the backend built by SGLang's factory.

    Options: ``backend`` (``"dynamic"``: ours; ``"builtin"``: SGLang's ``MooncakeStore``
    on ``mooncake_core.compat``), ``interface_v1`` (1: zero-copy path, 0: generic flat
    pages), ``failover_timeout_s``, ``global_segment_size`` (default 0: data lives on the
    store node).
    """

    def __init__(self, spec: HarnessSpec) -> None:
        super().__init__(spec)
        import_sglang_pools()
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        lay = spec.layout
        opts = dict(spec.options)
        self.variant = str(opts.pop("backend", "dynamic"))
        self.v1 = bool(opts.pop("interface_v1", 1))
        self.pool = build_host_pool(lay, spec.rank)
        if self.variant == "builtin":
            import mooncake_core.compat as compat

            compat.install()
            extra: dict[str, Any] = {
                "master_server_address": spec.master,
                "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 0,
                "check_server": False,
                "local_hostname": "127.0.0.1",
            }
            name = "mooncake"
        else:
            extra = {
                "backend_name": "mooncake_core",
                "module_path": "mooncake_sglang.hicache",
                "class_name": "MooncakeCoreStorage",
                "interface_v1": int(self.v1),
                "master_server_address": spec.master,
                "global_segment_size": 0,
                "failover_timeout_s": 2.0,
            }
            name = "dynamic"
        extra.update(opts)
        self.storage_config = HiCacheStorageConfig(
            tp_rank=spec.rank,
            tp_size=lay.tp_size,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=lay.mla,
            enable_storage_metrics=False,
            is_page_first_layout=lay.name == "page_first",
            model_name=spec.model,
            extra_config=extra,
        )
        self.backend = StorageBackendFactory.create_backend(name, self.storage_config, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()
        # A controller with just what its storage methods read; the methods are SGLang's.
        ctrl: Any = HiCacheController.__new__(HiCacheController)
        ctrl.storage_backend = self.backend
        ctrl.storage_host_pool = self.pool
        ctrl.mem_pool_host = self.pool
        ctrl.page_size = lay.page_size
        if self.v1 or self.variant == "builtin":
            ctrl.page_get_func = ctrl._page_get_zero_copy
            ctrl.page_set_func = ctrl._page_set_zero_copy
        else:
            ctrl.page_get_func = ctrl._generic_page_get
            ctrl.page_set_func = ctrl._generic_page_set
        self.ctrl = ctrl

    # ------------------------------------------------------------------ engine memory
    def _page_numel(self) -> int:
        return int(self.pool.get_dummy_flat_data_page().numel())

    def fill(self, slot: int, seed: int) -> None:
        import torch

        shard = 0 if self.spec.layout.mla else self.spec.rank
        g = torch.Generator().manual_seed((seed * 1_000_003 + shard) & 0x7FFF_FFFF_FFFF_FFFF)
        n = self._page_numel()
        data = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16)
        flat = (
            data.view(torch.bfloat16)
            if self.pool.dtype == torch.bfloat16
            else data.to(self.pool.dtype)
        )
        self.pool.set_from_flat_data_page(slot * self.page_size, flat)

    def read(self, slot: int) -> bytes:
        import torch

        page = self.pool.get_data_page(slot * self.page_size, flat=True).contiguous()
        return bytes(page.view(torch.uint8).numpy().tobytes())

    # ------------------------------------------------------------------ keys
    def _hashes(self, tokens: Sequence[int]) -> list[str]:
        return page_hashes(tokens, self.page_size)

    def page_keys(self, tokens: Sequence[int]) -> list[list[str]]:
        hashes = self._hashes(tokens)
        if self.variant == "builtin":
            return [self._builtin_keys(h) for h in hashes]
        scheme = self.backend._scheme
        return [scheme.keys(h) for h in hashes]

    def _builtin_keys(self, h: str) -> list[str]:
        """Keys SGLang's MooncakeStore uses for one page (as its batch_exists builds them)."""
        b = self.backend
        tagged = b._tag_keys([h])[0]
        if self.spec.layout.mla:
            return [f"{tagged}_{b.mla_suffix}_k"]
        return [f"{tagged}_{b.mha_suffix}_k", f"{tagged}_{b.mha_suffix}_v"]

    # ------------------------------------------------------------------ adapter calls
    def _indices(self, slots: Sequence[int]) -> torch.Tensor:
        import torch

        P = self.page_size
        if not slots:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([torch.arange(s * P, s * P + P, dtype=torch.int64) for s in slots])

    def save(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        op = _Operation(self._hashes(tokens), self._indices(slots))
        if self.v1 or self.variant == "builtin":
            type(self.ctrl)._page_backup(self.ctrl, op)
        else:
            if len(op.hash_value) != len(slots):
                raise ValueError(f"{len(op.hash_value)} pages but {len(slots)} slots")
            for s in slots:
                if not 0 <= s < self.num_slots:
                    raise IndexError(f"slot {s} is outside the pool's {self.num_slots} pages")
            type(self.ctrl)._page_backup(self.ctrl, op)
        return op.completed_tokens // self.page_size

    def lookup(self, tokens: Sequence[int]) -> int:
        hashes = self._hashes(tokens)
        hit = 0
        for start in range(0, len(hashes), STORAGE_BATCH):
            batch = hashes[start : start + STORAGE_BATCH]
            n = int(self.backend.batch_exists(batch))
            hit += n
            if n < len(batch):
                break
        return hit

    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        hashes = self._hashes(tokens)
        idx = self._indices(slots)
        if not self.v1 and self.variant != "builtin":
            if len(hashes) != len(slots):
                raise ValueError(f"{len(hashes)} pages but {len(slots)} slots")
            for s in slots:
                if not 0 <= s < self.num_slots:
                    raise IndexError(f"slot {s} is outside the pool's {self.num_slots} pages")
        op = _Operation(hashes, idx)
        done = 0
        for start in range(0, len(hashes), STORAGE_BATCH):
            batch = hashes[start : start + STORAGE_BATCH]
            bidx = idx[start * self.page_size : (start + len(batch)) * self.page_size]
            n = int(self.ctrl.page_get_func(op, batch, bidx))
            done += n
            if n < len(batch):
                break
        return done

    def expected_objects(
        self, tokens: Sequence[int], slots: Sequence[int]
    ) -> dict[str, bytes] | None:
        """Objects per SGLang layout, from the pool tensors (independent of the backend's code)."""
        import torch

        if self.variant == "builtin":
            return None
        lay = self.spec.layout
        kv = self.pool.kv_buffer
        parts = [kv] if lay.mla else [kv[0], kv[1]]
        P = self.page_size
        out: dict[str, bytes] = {}
        for keys, slot in zip(self.page_keys(tokens), slots, strict=False):
            for key, part in zip(keys, parts, strict=True):
                if lay.name == "page_first":  # [size, L, H, D]: token-major slice
                    t = part[slot * P : slot * P + P]
                elif lay.name == "page_first_direct":  # [pages, L, P, H, D]
                    t = part[slot]
                else:  # layer_first [L, size, H, D] -> layer-major page
                    t = part[:, slot * P : slot * P + P]
                out[key] = bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
        return out

    def bad_inputs(self) -> dict[str, Callable[[], object]]:
        import torch

        if self.variant == "builtin":
            return {}
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        b, P = self.backend, self.page_size
        key = "ab" * 32
        cfg = self.storage_config

        def unknown_key() -> object:
            bad = dict(cfg.extra_config or {})
            bad["master_adress"] = "127.0.0.1:1"
            c2 = type(cfg)(**{**cfg.__dict__, "extra_config": bad})
            return StorageBackendFactory.create_backend("dynamic", c2, self.pool)

        return {
            "batch_set_v1 with a page not starting on a page boundary": lambda: b.batch_set_v1(
                [key], torch.arange(1, 1 + P)
            ),
            "batch_get_v1 with float host indices": lambda: b.batch_get_v1([key], torch.zeros(P)),
            "batch_set_v1 with a page's indices not consecutive": lambda: (
                b.batch_set_v1([key], torch.arange(0, P).flip(0))
                if P > 1
                else b.batch_set_v1([], [1])
            ),
            "batch_set with a flat page of the wrong size": lambda: b.batch_set(
                [key], [torch.zeros(7, dtype=self.pool.dtype)]
            ),
            "batch_get with a target of the wrong size": lambda: b.batch_get(
                [key], [torch.zeros(3, dtype=self.pool.dtype)]
            ),
            "extra_config with a misspelt key": unknown_key,
        }

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def make_harness(spec: HarnessSpec) -> SGLangHarness:
    """Harness factory for
    ``HarnessSpec.factory = "mooncake_sglang.testing.harness:make_harness"``."""
    return SGLangHarness(spec)
