"""One side of an SGLang prefill/decode KV transfer (``--disaggregation-transfer-backend
mooncake``) on mooncake_core's compat ``TransferEngine``, run as its own process.

    python _sglang_pd_role.py prefill|decode --model DIR --bootstrap-port N --out RESULT.json \
        --plan '[{"room": 77, "src": [3, 4, 5], "dst": [20, 1, 7], "chunks": 2,
                  "corrupt": false}, ...]'

Everything that runs is SGLang's: ``ServerArgs`` published with SGLang's
``runtime_context.publish`` and a one-rank gloo world from ``init_distributed_environment``
/ ``initialize_model_parallel`` (as a scheduler process builds them), the shared
``MooncakeTransferEngine`` wrapper from ``init_mooncake_transfer_engine``, a CPU
``MHATokenToKVPool`` (SGLang's device KV pool class, allocated on CPU) and
``MetadataBuffers``, ``KVArgs`` filled as ``PrefillBootstrapQueue._init_kv_manager``
fills them, ``MooncakeKVManager``, ``MooncakeKVBootstrapServer`` (prefill side),
``MooncakeKVSender`` (``init`` after the decode's metadata arrived, then ``send`` in
chunks as chunked prefill does) and ``MooncakeKVReceiver`` (``try_ensure_parallel_info``,
``init``, ``send_metadata``). ``mooncake`` is ``mooncake_core.compat``
(``mooncake_sglang.plugin.install_compat``, forced even if a published wheel is
importable). Nothing is faked; the only stand-in is the inert ``torchvision`` module of
``torchvision_stand_in.py`` next to this script (PyPI only has CUDA builds of it).

Both sides walk the same plan, one request (bootstrap room) after another, over one
manager each, as a server handles consecutive requests. The prefill fills its pool with
random bytes and writes the SHA-256 of each page it sent (K and V of every layer); the
decode writes the SHA-256 of each page it received, the aux row the prefill sent with the
last chunk (first output token, bootstrap room) and which pages it never asked for are
not zero. A ``corrupt`` step switches on the test-only transport wrapper
:class:`mooncake_conformance.faults.CorruptWrites` (registered in the prefill's plugin
manager before its engine starts: the real ``shm``/``tcp`` transports then deliver zeros
for that request's writes), so the test can show that its comparison catches bad KV.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16
POOL_TOKENS = 32 * PAGE  # 32 pages (plus SGLang's padding page)
AUX_INDEX = 2
FIRST_TOKEN = 4242

log = logging.getLogger("sglang_pd_role")


def _setup(role: str, model: str, port: int) -> Any:
    os.environ["MOONCAKE_SGLANG_FORCE_COMPAT"] = "1"
    from mooncake_sglang.plugin import install_compat
    from mooncake_sglang.testing import import_sglang_pools
    from torchvision_stand_in import install as install_torchvision_stand_in  # next to this script

    if not install_compat():
        raise SystemExit("mooncake_core.compat could not be installed as `mooncake`")
    import mooncake.engine

    assert mooncake.engine.__name__.startswith("mooncake_core"), mooncake.engine.__name__
    install_torchvision_stand_in()
    import_sglang_pools()
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model,
        skip_tokenizer_init=True,
        device="cpu",
        host="127.0.0.1",
        page_size=PAGE,
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=port,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    # The process groups a scheduler builds (world of one rank; gloo, since there is no GPU).
    import socket

    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dist_port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
        local_rank=0,
        backend="gloo",
    )
    initialize_model_parallel(backend="gloo")
    return sa


def _kv_pool() -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        POOL_TOKENS,
        PAGE,
        torch.bfloat16,
        HEADS,
        HEAD_DIM,
        LAYERS,
        "cpu",
        False,
        enable_alt_stream=False,
    )


def _page_digest(pool: Any, page: int) -> str:
    import torch

    h = hashlib.sha256()
    for bufs in (pool.k_buffer, pool.v_buffer):
        for layer in bufs:
            h.update(
                layer[page * PAGE : (page + 1) * PAGE]
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .tobytes()
            )
    return h.hexdigest()


def _manager(role: str, sa: Any, pool: Any, meta: Any) -> Any:
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
        get_kv_transfer_buf_infos,
        setup_state_kv_args,
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    # As maybe_init_shared_mooncake_transfer_engine does in a scheduler (hostname: SGLANG_HOST_IP).
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    kv_args = get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = None
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = 0
    kv_args.prefill_end_layer = LAYERS
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(
        pool
    )
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = []
    kv_args.kv_head_num = HEADS
    kv_args.total_kv_head_num = HEADS
    kv_args.page_size = PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, LAYERS)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)(kv_args, mode, sa, False)


def _wait(poll: Any, want: int, what: str, timeout: float) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + timeout
    state = poll()
    while time.monotonic() < end:
        state = poll()
        if state == want:
            return
        if state == KVPoll.Failed:
            raise SystemExit(f"{what}: KVPoll.Failed")
        time.sleep(0.01)
    raise SystemExit(f"{what}: still {state} after {timeout:.0f} s (want {want})")


def prefill(args: argparse.Namespace) -> None:
    from mooncake_conformance.faults import install_corrupt_writes

    corrupt = install_corrupt_writes()  # off until a ``corrupt`` step; before the engine starts
    sa = _setup("prefill", args.model, args.bootstrap_port)
    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
    )

    server = get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER)(
        "127.0.0.1", args.bootstrap_port
    )
    pool = _kv_pool()
    g = torch.Generator().manual_seed(1234)
    for bufs in (pool.k_buffer, pool.v_buffer):
        for layer in bufs:
            layer.view(torch.int16).copy_(
                torch.randint(-(2**15), 2**15, layer.shape, generator=g, dtype=torch.int16)
            )
    meta = MetadataBuffers(8, 256, torch.bfloat16, 16)
    mgr = _manager("prefill", sa, pool, meta)
    rooms: list[dict[str, Any]] = []
    for step in args.plan:
        room, src = int(step["room"]), np.array(step["src"], dtype=np.int32)
        meta.output_ids[AUX_INDEX, 0] = FIRST_TOKEN + room
        meta.bootstrap_room[AUX_INDEX, 0] = room
        # created when the request reaches the prefill, before the decode has bootstrapped
        sender = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER)(
            mgr=mgr, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=room
        )
        _wait(
            sender.poll,
            KVPoll.WaitingForInput,
            f"prefill room {room}: decode metadata",
            args.timeout,
        )
        sender.init(len(src), AUX_INDEX)
        corrupt.enabled = bool(step.get("corrupt"))  # delivered bytes become zeros
        t0 = time.perf_counter()
        for chunk in np.array_split(
            src, int(step.get("chunks", 2))
        ):  # chunked prefill: several sends
            sender.send(chunk)
        _wait(sender.poll, KVPoll.Success, f"prefill room {room}: transfer", args.timeout)
        dt = time.perf_counter() - t0
        corrupt.enabled = False
        rooms.append(
            {
                "room": room,
                "digests": [_page_digest(pool, int(p)) for p in src],
                "seconds": dt,
                "bytes": len(src) * sum(mgr.kv_args.kv_item_lens),
            }
        )
        sender.clear()
    _write(args.out, {"rooms": rooms, "session": mgr.get_session_id()})
    faulthandler.cancel_dump_traceback_later()
    sys.stdin.read()  # keep the engine up until the test has the decode's result
    mgr.deregister_buffer_to_engine()
    server.close()


def decode(args: argparse.Namespace) -> None:
    sa = _setup("decode", args.model, args.bootstrap_port)
    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
    )

    pool = _kv_pool()
    for bufs in (pool.k_buffer, pool.v_buffer):
        for layer in bufs:
            layer.zero_()
    meta = MetadataBuffers(8, 256, torch.bfloat16, 16)
    mgr = _manager("decode", sa, pool, meta)
    addr = f"127.0.0.1:{args.bootstrap_port}"
    end = time.monotonic() + args.timeout
    while not mgr.try_ensure_parallel_info(
        addr
    ):  # as DecodePreallocQueue does before each receiver
        if time.monotonic() > end:
            raise SystemExit(f"decode: the prefill's bootstrap server at {addr} did not answer")
        time.sleep(0.1)
    rooms: list[dict[str, Any]] = []
    asked: set[int] = set()
    for step in args.plan:
        room, dst = int(step["room"]), np.array(step["dst"], dtype=np.int32)
        asked.update(int(p) for p in dst)
        meta.output_ids[AUX_INDEX].zero_()
        meta.bootstrap_room[AUX_INDEX].zero_()
        receiver = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)(mgr, addr, room)
        receiver.init(0)
        _wait(receiver.poll, KVPoll.WaitingForInput, f"decode room {room}: bootstrap", args.timeout)
        receiver.send_metadata(dst, AUX_INDEX, None)
        _wait(receiver.poll, KVPoll.Success, f"decode room {room}: transfer", args.timeout)
        rooms.append(
            {
                "room": room,
                "digests": [_page_digest(pool, int(p)) for p in dst],
                "first_token": int(meta.output_ids[AUX_INDEX, 0]),
                "aux_room": int(meta.bootstrap_room[AUX_INDEX, 0]),
            }
        )
        receiver.clear()
    zero = _page_digest(_kv_pool(), 0)
    others = [p for p in range(POOL_TOKENS // PAGE) if p not in asked]
    untouched = [p for p in others if _page_digest(pool, p) != zero]
    # SGLang's own deregistration (what teardown() ends with): compat's batch_unregister_memory
    regions = mgr._registerable_regions()
    rc = mgr.engine.batch_deregister([ptr for ptr, _ in regions])
    _write(
        args.out,
        {
            "rooms": rooms,
            "zero_digest": zero,
            "session": mgr.get_session_id(),
            "untouched_nonzero": untouched,
            "deregister_rc": rc,
            "regions": len(regions),
        },
    )


def _write(path: str, obj: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument(
        "--plan",
        type=json.loads,
        required=True,
        help='JSON list of {"room", "src": prefill pages, "dst": decode pages, '
        '"chunks", "corrupt"}',
    )
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format=f"[{args.role}] %(levelname)s %(name)s: %(message)s"
    )
    faulthandler.dump_traceback_later(
        args.timeout + 60, exit=False
    )  # a hang shows its stacks in the log
    if args.role == "prefill":
        prefill(args)
    else:
        decode(args)
    # A scheduler process is ended by its launcher; SGLang's teardown() is the role-switch
    # path, whose zmq context destroy can block while the decode thread sits in recv.
    # So, as the launcher would, end the process here without running exit hooks.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
