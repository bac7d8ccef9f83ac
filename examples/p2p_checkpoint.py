"""Distribute a safetensors checkpoint to N reader processes through the P2P store.

Run:  .venv/bin/python examples/p2p_checkpoint.py [--readers 4] [--etcd etcd://h:p]

Without ``--etcd`` it starts Debian's etcd on a free loopback port for the run. A seeder
process saves a small torch model as two safetensors files and publishes the directory;
the readers start together, fetch it from the swarm (each verified shard is served on to
the others at once), load it into their own copy of the model with ``load_state_dict``
and report a hash of every parameter's bytes. The launcher checks that every reader's
weights equal the seeder's, byte for byte, and prints where the shards came from.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from mooncake_core.errors import MooncakeError
from mooncake_core.etcd import LocalEtcd
from mooncake_core.p2p import P2PStore

NAME = "example/ckpt"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(8192, 512),
        torch.nn.Linear(512, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 512),
        torch.nn.LayerNorm(512),
        torch.nn.Linear(512, 8192, bias=False),
    )


def weight_hashes(model: torch.nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


def seeder_main(url: str, ckpt: str, q: Any, stop: Any) -> None:
    model = make_model()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    half = len(keys) // 2
    os.makedirs(ckpt, exist_ok=True)
    save_file(
        {k: sd[k] for k in keys[:half]}, os.path.join(ckpt, "model-00001-of-00002.safetensors")
    )
    save_file(
        {k: sd[k] for k in keys[half:]}, os.path.join(ckpt, "model-00002-of-00002.safetensors")
    )
    with P2PStore(url) as store:
        rep = store.register(NAME, ckpt, max_shard_size="4MB", force=True, meta={"layout": "dir"})
        q.put(
            {
                "role": "seeder",
                "hashes": weight_hashes(model),
                "size": rep.size,
                "files": rep.labels,
            }
        )
        stop.wait(300)


def reader_main(url: str, idx: int, q: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    with P2PStore(url) as store:
        t0 = time.monotonic()
        rep = store.get_replica(NAME)
        dt = time.monotonic() - t0
        state: dict[str, torch.Tensor] = {}
        for buf in rep.buffers:  # one buffer per safetensors file
            state.update(st_load(bytes(buf)))
        model = make_model()
        for p in model.parameters():  # forget the seed's values: only the checkpoint counts
            torch.nn.init.zeros_(p)
        model.load_state_dict(state, strict=True)
        q.put(
            {
                "role": "reader",
                "idx": idx,
                "hashes": weight_hashes(model),
                "s": dt,
                "stats": rep.stats,
            }
        )
        stop.wait(300)  # keep serving until everyone is done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--etcd", default=None, help="etcd://host:port (default: start one)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(
        prefix="mc-p2p-example-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    etcd = None
    url = args.etcd
    if url is None:
        try:
            etcd = LocalEtcd(os.path.join(tmp, "etcd"), name="ex")
        except MooncakeError as exc:
            raise SystemExit(f"etcd did not start: {exc}") from None
        url = etcd.url
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=seeder_main, args=(url, os.path.join(tmp, "ckpt"), q, stop))]
    try:
        procs[0].start()
        seed = q.get(timeout=120)
        print(f"seeder: published {NAME}: {seed['size'] / 2**20:.1f} MiB in files {seed['files']}")
        for i in range(args.readers):
            procs.append(ctx.Process(target=reader_main, args=(url, i, q, stop)))
        for p in procs[1:]:
            p.start()
        ok = True
        for _ in range(args.readers):
            r = q.get(timeout=300)
            same = r["hashes"] == seed["hashes"]
            ok &= same
            st = r["stats"]
            print(
                f"reader {r['idx']}: {r['s']:.2f}s, {len(r['hashes'])} tensors "
                f"{'byte-equal to the seeder' if same else 'DIFFER from the seeder'} "
                f"(shards from peers {st['from_peers']}, from the seeder {st['from_origin']})"
            )
        print("all readers hold the seeder's weights exactly" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if etcd is not None:
            etcd.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
