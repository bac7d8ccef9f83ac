"""A transfer-engine peer process for the tests (commands as JSON lines on stdin).

Commands: alloc(size) -> addr; register_numpy(size) -> addr (private memory, not memfd);
fill(addr, length, seed); digest(addr, length) -> sha256; read/write(peer, ...);
tensor_get(key); tensor_put(peer, key, ...); exit.
Configuration comes from MOONCAKE_* environment variables.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np

from mooncake_core.transfer import TransferEngine
from mooncake_core.transfer.memory import host_view


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    eng = TransferEngine().start()
    keep: list[object] = []
    print(json.dumps({"name": eng.name, "pid": os.getpid(), "port": eng.port}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        try:
            if cmd == "exit":
                print(json.dumps({"ok": True}), flush=True)
                break
            if cmd == "alloc":
                buf = eng.allocate(int(msg["size"]), prefault=True)
                keep.append(buf)
                out: dict[str, object] = {"addr": buf.addr}
            elif cmd == "register_numpy":
                arr = np.zeros(int(msg["size"]), dtype=np.uint8)
                keep.append(arr)
                out = {"addr": eng.register(arr).addr}
            elif cmd == "fill":
                rng = np.random.default_rng(int(msg["seed"]))
                data = rng.integers(0, 256, int(msg["length"]), dtype=np.uint8)
                host_view(int(msg["addr"]), int(msg["length"]))[:] = data.tobytes()
                out = {"ok": True}
            elif cmd == "digest":
                out = {
                    "sha": hashlib.sha256(
                        host_view(int(msg["addr"]), int(msg["length"]))
                    ).hexdigest()
                }
            elif cmd == "write" or cmd == "read":
                getattr(eng, cmd)(
                    msg["peer"], int(msg["local"]), int(msg["remote"]), int(msg["length"])
                )
                out = {"ok": True}
            elif cmd == "tensor_get":
                t = eng.get_tensor(msg["key"], timeout=float(msg.get("timeout", 10)))
                arr = t.numpy() if hasattr(t, "numpy") and not isinstance(t, np.ndarray) else t
                out = {
                    "type": type(t).__module__.split(".")[0],
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "sum": float(arr.astype(np.float64).sum()),
                }
            elif cmd == "ping":
                out = {"alive": eng.ping(msg["peer"])}
            else:
                out = {"error": f"unknown command {cmd}"}
        except Exception as exc:  # reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
