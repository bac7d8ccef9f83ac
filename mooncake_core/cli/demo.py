"""``mooncake-core demo``: two processes on loopback move KV-cache-shaped tensors through
the transfer engine (shared memory and TCP), verify them byte for byte, and print what
moved and how fast.

The receiver process registers a buffer; the sender writes a batch of per-layer KV
blocks into it with one batched transfer per transport, then ships a tensor with
``put_tensor_async`` that the receiver picks up with ``get_tensor``. The receiver checks
SHA-256 digests of everything it got.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from mooncake_core.config import format_size
from mooncake_core.transfer import TransferEngine, TransferRequest

LAYERS, BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 32, 16, 8, 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--nbytes", type=int, default=0, help=argparse.SUPPRESS
    )  # receiver's buffer
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help=f"KV layers to move (default {LAYERS})"
    )
    parser.add_argument(
        "--blocks", type=int, default=BLOCKS, help=f"KV blocks per layer (default {BLOCKS})"
    )


def _receiver(nbytes: int) -> int:
    eng = TransferEngine(protocol="tcp").start()
    buf = eng.allocate(nbytes, prefault=True, name="kv_cache")
    print(json.dumps({"name": eng.name, "addr": buf.addr}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "digest":
            a, n = int(msg["offset"]), int(msg["length"])
            print(json.dumps({"sha": hashlib.sha256(buf.view[a : a + n]).hexdigest()}), flush=True)
        elif msg["cmd"] == "tensor":
            t = eng.get_tensor(msg["key"], timeout=30)
            print(
                json.dumps(
                    {
                        "shape": list(t.shape),
                        "dtype": str(t.dtype),
                        "sha": hashlib.sha256(_as_bytes(t).data).hexdigest(),
                    }
                ),
                flush=True,
            )
        elif msg["cmd"] == "exit":
            break
    eng.close()
    return 0


def _kv_blocks(layers: int, blocks: int) -> Any:
    try:
        import torch

        g = torch.Generator().manual_seed(0)
        return torch.randn(
            layers, 2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float32
        ).to(torch.bfloat16)
    except ImportError:  # numpy fallback
        return np.random.default_rng(0).standard_normal(
            (layers, 2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float32
        )


def _as_bytes(t: Any) -> np.ndarray:
    if hasattr(t, "view") and type(t).__module__.startswith("torch"):
        import torch

        out: np.ndarray = t.contiguous().view(torch.uint8).numpy().reshape(-1)
        return out
    return np.ascontiguousarray(t).view(np.uint8).reshape(-1)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("mooncake_core").setLevel(logging.WARNING)
    kv = _kv_blocks(args.layers, args.blocks)
    raw = _as_bytes(kv)
    nbytes = raw.nbytes
    if args.role == "receiver":
        return _receiver(args.nbytes)
    cmd = [
        sys.executable,
        "-m",
        "mooncake_core",
        "--log-level",
        "WARNING",
        "demo",
        "--role",
        "receiver",
        "--nbytes",
        str(nbytes),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(**msg: Any) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()
        out: dict[str, Any] = json.loads(proc.stdout.readline())
        return out

    try:
        line = proc.stdout.readline()
        if not line:
            print(
                "mooncake-core: error: the demo's receiver process failed to start "
                "(see its log above)",
                file=sys.stderr,
            )
            return 1
        info = json.loads(line)
        peer, base = info["name"], int(info["addr"])
        print(f"receiver process pid {proc.pid} listening as {peer}; sender pid {os.getpid()}")
        print(
            f"KV cache: {args.layers} layers x (K,V) x {args.blocks} blocks x "
            f"{BLOCK_TOKENS} tokens x {KV_HEADS} heads x {HEAD_DIM} dims, "
            f"{getattr(kv, 'dtype', 'float32')} = {format_size(nbytes)}"
        )
        with TransferEngine(protocol="tcp") as eng:
            local = eng.allocate(nbytes, prefault=True)
            local.numpy()[:] = raw
            per_layer = nbytes // args.layers
            want = hashlib.sha256(raw.data).hexdigest()
            rows = []
            for transport in ("shm", "tcp"):
                # one request per layer: a batch, as a prefill instance pushes its KV to decode
                reqs = [
                    TransferRequest(
                        "write",
                        peer,
                        local.addr + i * per_layer,
                        per_layer,
                        base + i * per_layer,
                        transport=transport,
                    )
                    for i in range(args.layers)
                ]
                eng.transfer(reqs)  # warm (first touch, connections)
                t = time.perf_counter()
                reps = 5
                for _ in range(reps):
                    eng.transfer(reqs)
                dt = (time.perf_counter() - t) / reps
                ok = ask(cmd="digest", offset=0, length=nbytes)["sha"] == want
                rows.append((f"write {args.layers} layers", transport, nbytes, dt, ok))
                back = np.ones(
                    nbytes, dtype=np.uint8
                )  # pre-touched pages (first touch is slow here)
                t = time.perf_counter()
                eng.read(peer, back, base, transport=transport)
                dt = time.perf_counter() - t
                rows.append(
                    (
                        "read back",
                        transport,
                        nbytes,
                        dt,
                        hashlib.sha256(back.data).hexdigest() == want,
                    )
                )
            eng.put_tensor_async(kv[1], peer, "warm").result(30)
            ask(cmd="tensor", key="warm")
            t = time.perf_counter()
            eng.put_tensor_async(kv[0], peer, "layer0").result(30)
            dt = time.perf_counter() - t
            got = ask(cmd="tensor", key="layer0")
            l0 = _as_bytes(kv[0])
            rows.append(
                (
                    f"put_tensor {list(kv[0].shape)}",
                    "tcp",
                    l0.nbytes,
                    dt,
                    got["sha"] == hashlib.sha256(l0.data).hexdigest(),
                )
            )
        print(f"{'what':<34} {'transport':<9} {'bytes':>10} {'time':>9} {'GB/s':>7}  verified")
        for what, tr, n, dt, ok in rows:
            print(
                f"{what:<34} {tr:<9} {format_size(n):>10} {dt * 1e3:7.1f}ms "
                f"{n / dt / 1e9:7.2f}  {'yes' if ok else 'NO'}"
            )
        proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        proc.stdin.flush()
        proc.wait(10)
        if not all(r[4] for r in rows):
            print("demo: verification FAILED", file=sys.stderr)
            return 1
        print("all transfers verified byte for byte")
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
