"""Helpers for the store integration tests: real masters, client processes, etcd.

Run as a script (``python store_support.py agent --master ADDR ...``) it is a client
*agent*: a separate process with its own :class:`StoreClient` that executes JSON-line
commands from stdin and answers on stdout, so tests drive several client processes.
Payloads are derived from the key, so any process can verify bytes it did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def payload(key: str, size: int, salt: str = "") -> bytes:
    """Deterministic bytes for ``key`` (fast: a repeated 64-byte digest, offset-tagged)."""
    if size <= 0:
        return b""
    seed = hashlib.blake2b(f"{salt}|{key}|{size}".encode(), digest_size=64).digest()
    reps = size // 64 + 1
    out = bytearray(seed * reps)[:size]
    for off in range(0, size, 4096):  # make pages distinct so a misplaced page is caught
        out[off : off + 4] = (off // 4096).to_bytes(4, "little")
    return bytes(out[:size])


def _wait_json(
    path: Path, proc: subprocess.Popen[Any], what: str, timeout: float = 30.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready within {timeout}s")


class Master:
    """``mooncake-core master`` in a subprocess."""

    def __init__(self, tmp: Path, *args: str, name: str = "master") -> None:
        self.ready = tmp / f"{name}-{time.monotonic_ns()}.json"
        self.log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115
        cmd = [
            PY,
            "-m",
            "mooncake_core",
            "--log-level",
            "INFO",
            "master",
            "--rpc-port",
            "0",
            "--http-port",
            "0",
            "--ready-file",
            str(self.ready),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        info = _wait_json(self.ready, self.proc, name)
        self.rpc_port = int(info["rpc_port"])
        self.http_port = int(info["http_port"])
        self.address = f"127.0.0.1:{self.rpc_port}"

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Agent:
    """A client process executing commands (see module doc)."""

    def __init__(
        self,
        master: str,
        *,
        segment_size: int = 32 << 20,
        ssd_path: str = "",
        env: dict[str, str] | None = None,
        log: Path | None = None,
        cluster_id: str = "default",
    ) -> None:
        cmd = [
            PY,
            str(Path(__file__).resolve()),
            "agent",
            "--master",
            master,
            "--segment-size",
            str(segment_size),
            "--cluster-id",
            cluster_id,
        ]
        if ssd_path:
            cmd += ["--ssd-path", ssd_path]
        self._log = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=e,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        hello = self._read()
        if "error" in hello:
            raise RuntimeError(f"agent failed to start: {hello['error']}")
        self.segment: str = hello["segment"]
        self.peer: str = hello["peer"]
        self.pid = self.proc.pid

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent {self.proc.pid} exited ({self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, op: str, **kw: Any) -> Any:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            res = self._read()
        if "error" in res:
            raise AgentError(res["type"], res["error"])
        return res.get("result")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]


class AgentError(Exception):
    def __init__(self, typ: str, msg: str) -> None:
        super().__init__(f"{typ}: {msg}")
        self.type = typ
        self.msg = msg


# ---------------------------------------------------------------------- the agent process
def _agent(argv: list[str]) -> int:
    import argparse
    import logging

    import numpy as np

    from mooncake_core.store import StoreClient

    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--segment-size", type=int, default=32 << 20)
    ap.add_argument("--ssd-path", default="")
    ap.add_argument("--cluster-id", default="default")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("mooncake_core.store").setLevel(logging.INFO)
    out = sys.stdout
    try:
        client = StoreClient(
            master=a.master,
            segment_size=a.segment_size,
            ssd_path=a.ssd_path,
            cluster_id=a.cluster_id,
            failover_timeout_s=20.0,
        ).start()
    except Exception as exc:
        out.write(
            json.dumps({"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}) + "\n"
        )
        return 1
    out.write(
        json.dumps(
            {
                "segment": client.segment_names[0] if client.segment_names else "",
                "peer": client.hostname,
            }
        )
        + "\n"
    )
    out.flush()
    reg = np.zeros(8 << 20, dtype=np.uint8)
    client.register_buffer(reg)

    def cfg(c: dict[str, Any]) -> dict[str, Any]:
        return {
            k: c[k]
            for k in ("replica_num", "preferred_segment", "hard_pin", "soft_pin_ttl_s", "strategy")
            if k in c
        }

    def run(c: dict[str, Any]) -> Any:
        op = c["op"]
        if op == "put":
            client.put(c["key"], payload(c["key"], c["size"], c.get("salt", "")), **cfg(c))
            return None
        if op == "put_from_registered":
            data = np.frombuffer(payload(c["key"], c["size"]), dtype=np.uint8)
            reg[: c["size"]] = data
            client.put_from(c["key"], int(reg.ctypes.data), c["size"], **cfg(c))
            return None
        if op == "get":
            data = client.get(c["key"])
            return {
                "size": len(data),
                "match": data == payload(c["key"], len(data), c.get("salt", "")),
            }
        if op == "get_into_registered":
            n = client.get_into(c["key"], int(reg.ctypes.data), reg.nbytes)
            return {"size": n, "match": bytes(reg[:n]) == payload(c["key"], n)}
        if op == "get_into":
            buf = bytearray(c["cap"])
            n = client.get_into(c["key"], buf)
            return {"size": n, "match": bytes(buf[:n]) == payload(c["key"], n)}
        if op == "put_batch":
            res = client.put_batch(c["keys"], [payload(k, c["size"]) for k in c["keys"]], **cfg(c))
            return [None if r is None else type(r).__name__ for r in res]
        if op == "get_batch":
            got = client.get_batch(c["keys"])
            return [
                None if g is None else g == payload(k, len(g))
                for k, g in zip(c["keys"], got, strict=True)
            ]
        if op == "batch_get_into":
            bufs = [bytearray(c["cap"]) for _ in c["keys"]]
            res = client.batch_get_into(c["keys"], bufs)
            salts = c.get("salts", {})
            return [
                bytes(b[:r]) == payload(k, r, salts.get(k, ""))
                if isinstance(r, int)
                else type(r).__name__
                for k, b, r in zip(c["keys"], bufs, res, strict=True)
            ]
        if op == "put_array":
            client.put_array(c["key"], np.arange(c["n"], dtype=c["dtype"]).reshape(c["shape"]))
            return None
        if op == "get_array":
            arr = client.get_array(c["key"])
            return {"dtype": arr.dtype.str, "shape": list(arr.shape), "sum": float(arr.sum())}
        if op == "put_tensor":
            import torch

            client.put_tensor(
                c["key"],
                torch.arange(c["n"], dtype=torch.float32).reshape(c["shape"]).to(torch.bfloat16),
            )
            return None
        if op == "get_tensor":
            t = client.get_tensor(c["key"])
            return {"dtype": str(t.dtype), "shape": list(t.shape), "sum": float(t.float().sum())}
        if op == "stress":
            return _stress(client, c)
        if op == "zipf":  # Zipf-distributed gets (test_store_hotkeys.py)
            return _zipf(client, c)
        if op == "call":
            return getattr(client, c["method"])(*c.get("args", []), **c.get("kwargs", {}))
        if op == "attr":
            return getattr(client, c["name"])
        if (
            op == "remembered"
        ):  # key -> the holders (peer names) of the replica the client remembers
            return {k: [s.peer for s in v.replica] for k, v in client._where.snapshot().items()}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        c = json.loads(line)
        try:
            res = run(c)
            out.write(json.dumps({"result": res}, default=str) + "\n")
        except Exception as exc:
            out.write(json.dumps({"error": str(exc), "type": type(exc).__name__}) + "\n")
        out.flush()
    client.close()
    return 0


def _zipf(client: Any, c: dict[str, Any]) -> dict[str, Any]:
    """``n`` gets of ``keys`` with Zipf(``s``) popularity; per key, the reads each segment
    served, and how many reads did not return the key's bytes."""
    import random

    from mooncake_core.errors import LeaseExpired

    rng = random.Random(c["seed"])
    expired = 0
    keys: list[str] = c["keys"]
    weights = [1.0 / (i + 1) ** c.get("s", 1.1) for i in range(len(keys))]
    want: dict[str, bytes] = {}
    served: dict[str, dict[str, int]] = {}
    bad = 0
    rb = client.reads_by_segment
    for i in rng.choices(range(len(keys)), weights, k=c["n"]):
        k = keys[i]
        for attempt in range(5):  # a loaded machine can outlast the test's short lease
            before = dict(rb)
            try:
                data = client.get(k)
                break
            except LeaseExpired:
                expired += 1
                if attempt == 4:
                    raise
        if k not in want:
            want[k] = payload(k, len(data))
        bad += data != want[k]
        per = served.setdefault(k, {})
        for seg, n in rb.items():
            if n != before.get(seg, 0):
                per[seg] = per.get(seg, 0) + 1
    return {"mismatch": bad, "served": served, "lease_expired_retries": expired}


def _stress(client: Any, c: dict[str, Any]) -> dict[str, int]:
    """Writers and readers on overlapping keys: each value is self-describing, so a torn
    or misplaced read is detected (returns counters; ``torn`` must stay 0)."""
    import random

    from mooncake_core.errors import LeaseExpired, ObjectExists, ObjectNotFound, StoreError

    keys: list[str] = c["keys"]
    deadline = time.monotonic() + float(c["seconds"])
    counts = {
        "puts": 0,
        "gets": 0,
        "torn": 0,
        "exists": 0,
        "missing": 0,
        "removes": 0,
        "errors": 0,
        "lease_expired": 0,
    }
    lock = threading.Lock()
    first_error: list[str] = []

    def writer(wid: str) -> None:
        rng = random.Random(wid)
        while time.monotonic() < deadline:
            k = rng.choice(keys)
            size = rng.choice([4096, 65536, 300_000])
            try:
                if rng.random() < 0.3:
                    client.remove(k)
                    with lock:
                        counts["removes"] += 1
                else:
                    client.put(k, payload(k, size, wid) + wid.encode().ljust(16))
                    with lock:
                        counts["puts"] += 1
            except (ObjectExists, ObjectNotFound):
                with lock:
                    counts["exists"] += 1
            except StoreError as exc:  # busy (leased) removes, etc.
                if type(exc).__name__ != "ObjectBusy":
                    with lock:
                        counts["errors"] += 1
                        first_error.append(repr(exc))
            except (
                Exception
            ) as exc:  # anything else is a bug: count it instead of losing the thread
                with lock:
                    counts["errors"] += 1
                    first_error.append(repr(exc))

    def reader(rid: str) -> None:
        rng = random.Random(rid)
        while time.monotonic() < deadline:
            k = rng.choice(keys)
            time.sleep(rng.uniform(0, float(c.get("reader_pause_s", 0.004))))
            try:
                data = client.get(k)
            except ObjectNotFound:
                with lock:
                    counts["missing"] += 1
                continue
            except LeaseExpired:  # a slow read is refused, never returned torn
                with lock:
                    counts["lease_expired"] += 1
                continue
            except Exception as exc:  # StoreError, or a bug: counted, never lost with the thread
                with lock:
                    counts["errors"] += 1
                    first_error.append(repr(exc))
                continue
            wid = data[-16:].rstrip(b" ").decode(errors="replace")
            ok = data[:-16] == payload(k, len(data) - 16, wid)
            with lock:
                counts["gets"] += 1
                if not ok:
                    counts["torn"] += 1

    threads = [
        threading.Thread(target=writer, args=(f"{c['name']}-w{i}",)) for i in range(c["writers"])
    ]
    threads += [
        threading.Thread(target=reader, args=(f"{c['name']}-r{i}",)) for i in range(c["readers"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if first_error:
        counts["first_error"] = first_error[0]  # type: ignore[assignment]
    return counts


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        sys.path.insert(0, str(ROOT))
        raise SystemExit(_agent(sys.argv[2:]))
    raise SystemExit(
        "usage: store_support.py agent --master ADDR [--segment-size N] [--ssd-path DIR]"
    )
