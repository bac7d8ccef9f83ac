"""One SGLang rank with SGLang's built-in ``MooncakeStore`` on the PUBLISHED wheel.

Run by ``mooncake-core bench sglang --compare-mooncake PYTHON`` with the interpreter of
the scratch venv (``scripts/setup_mooncake_peer.sh --sglang`` installs SGLang's classes
next to ``mooncake-transfer-engine-non-cuda`` there). It imports nothing from
``mooncake_core``: the host pool is SGLang's ``MHATokenToKVPoolHost`` (on CPU, unpinned)
and the backend is built by SGLang's ``StorageBackendFactory.create_backend("mooncake")``,
exactly as the SGLang adapter's test harness builds ours. The inert ``torchvision`` it
needs on a CPU-only machine is the SGLang tests' ``torchvision_stand_in.py``, loaded by
path from this checkout.

    python _mooncake_sglang.py check
    python _mooncake_sglang.py rank writer|reader MASTER METADATA_URL PAGES

A rank answers JSON lines prefixed ``@@ `` on stdout (anything else there is noise):
first ``{"ready": true, "page_bytes": N, "digests": [...]}``, then one answer per
command read from stdin: ``{"cmd": "set"|"get", "keys": [...]}`` ->
``{"s": seconds inside batch_*_v1, "ok": pages, "digests": [...]}`` (a reader zeroes
its pages before each get, outside the timing); ``{"cmd": "clear"}``; ``{"cmd": "exit"}``.
Our side (``mooncake-core bench sglang``) speaks the same protocol with :func:`serve`.
The model: 32 layers, 2 KV heads x 128, bfloat16, 64-token pages, ``page_first``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
#: the SGLang tests' inert torchvision (standard library only)
STAND_IN = os.path.join(
    _HERE, os.pardir, os.pardir, "plugins", "sglang", "tests", "torchvision_stand_in.py"
)

LAYERS, PAGE, HEADS, HEAD_DIM = 32, 64, 2, 128


def _import_sglang() -> None:
    # load the stand-in by path: this venv has neither mooncake_core nor the adapter
    spec = importlib.util.spec_from_file_location(
        "_mc_torchvision_stand_in", os.path.abspath(STAND_IN)
    )
    assert spec is not None and spec.loader is not None
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)
    stand_in.install()
    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    import sglang.srt.mem_cache.storage.mooncake_store.mooncake_store  # noqa: F401


def _pool(pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = torch.bfloat16
    dev_tokens = PAGE * 4  # stand-in for the GPU pool; only its geometry is read
    k = tuple(torch.zeros(dev_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(dev_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    buffers = KVBuffers(
        k=k,
        v=v,
        k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
        v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
        layout=KVBufferLayout.NHD,
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev_tokens,
        start_layer=0,
        end_layer=LAYERS,
        host_token_capacity=(pages + 2) * PAGE,
    )


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(
    backend: Any,
    indices: Callable[[int], Any],
    zero_pool: Callable[[], Any],
    digests: Callable[[], list[str]],
    clear: Callable[[], int],
) -> None:
    """Answer the driver's commands on stdin (the line protocol in the module doc) until ``exit``.

    ``indices(n)`` gives the host-pool token indices of the first ``n`` pages; ``zero_pool``
    clears the pool before a get (outside the timing); ``clear`` removes this setup's
    objects and returns how many. Shared by the published-wheel rank and ours.
    """
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "exit":
            break
        if cmd == "clear":
            say({"removed": clear()})
            continue
        keys = list(msg["keys"])
        sel = indices(len(keys))
        if cmd == "set":
            t = time.perf_counter()
            ok = backend.batch_set_v1(keys, sel)
            dt = time.perf_counter() - t
            say({"s": dt, "ok": sum(bool(x) for x in ok)})
        elif cmd == "get":
            zero_pool()
            t = time.perf_counter()
            ok = backend.batch_get_v1(keys, sel)
            dt = time.perf_counter() - t
            say({"s": dt, "ok": sum(bool(x) for x in ok), "digests": digests()})
        else:
            say({"error": f"unknown command {cmd!r}"})


def rank(role: str, master: str, metadata: str, pages: int) -> int:
    _import_sglang()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = _pool(pages)
    extra = {
        "master_server_address": master,
        "metadata_server": metadata,
        "protocol": "tcp",
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
        "device_name": "",
        "check_server": False,
    }
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/sglang-32l",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("mooncake", cfg, pool)
    backend.register_mem_pool_host(pool)
    slots = list(range(pages))
    check = [0, pages // 2, pages - 1]
    idx = torch.cat([torch.arange(s * PAGE, s * PAGE + PAGE, dtype=torch.int64) for s in slots])

    def digests() -> list[str]:
        return [
            hashlib.sha256(
                pool.get_data_page(s * PAGE, flat=True)
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .tobytes()
            ).hexdigest()
            for s in check
        ]

    if role == "writer":
        n = int(pool.get_dummy_flat_data_page().numel())
        for s in slots:
            g = torch.Generator().manual_seed(s + 1)
            data = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16)
            pool.set_from_flat_data_page(s * PAGE, data.view(torch.bfloat16))
    page_bytes = int(pool.get_dummy_flat_data_page().numel()) * 2
    say({"ready": True, "page_bytes": page_bytes, "digests": digests()})
    serve(
        backend,
        lambda n: idx[: n * PAGE],
        pool.kv_buffer.zero_,
        digests,
        lambda: int(backend.store.remove_all(force=True)),
    )
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        _import_sglang()
        import mooncake.store  # noqa: F401

        print("ok")
        return 0
    if argv[:1] == ["rank"] and len(argv) == 5 and argv[1] in ("writer", "reader"):
        return rank(argv[1], argv[2], argv[3], int(argv[4]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
