"""One worker process of ``mooncake-core bench soak`` (run as ``python -m`` this module).

The worker owns a :class:`~mooncake_core.store.StoreClient` (which lends a segment to the
pool) and runs three threads:

- *store*: a random mix of put / get / remove on a shared key space ``e/K`` (every worker
  reads, writes and removes the same keys; the pool is far smaller than the key space, so the
  master evicts) and on the worker's own *durable* keys ``d/W/SEQ`` (hard-pinned, two
  replicas; the worker keeps at most ``--durable-cap`` of them, removing the oldest);
- *pd*: prefill-to-decode style transfers through the transfer engine: write a block into a
  slot of another worker's registered receive buffer, notify it, and wait for its
  acknowledgement once it has checked the bytes;
- *watchdog*: counts every operation that runs past ``--op-deadline`` seconds as hung.

Every value is derived from its key (:func:`payload`), so any process checks bytes it did not
write. Commands arrive as JSON lines on stdin (``peers``, ``stop``, ``verify``, ``exit``);
answers and progress leave as JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
from typing import Any

from mooncake_core.errors import MooncakeError, ObjectExists, ObjectNotFound

logger = logging.getLogger("mooncake_core.bench.soak")

EPHEMERAL_SIZES = (4096, 32768, 131072, 524288)
DURABLE_SIZE = 16384
PD_SLOT = 256 << 10


def payload(key: str, size: int) -> bytes:
    """The bytes stored under ``key``: a digest of the key repeated, each 4 KiB page tagged with
    its index (a misplaced page is caught, not only a wrong object)."""
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    out = bytearray((seed * (size // 64 + 1))[:size])
    for off in range(0, size, 4096):
        out[off : off + 4] = (off // 4096).to_bytes(4, "little")[: min(4, size - off)]
    return bytes(out)


class Payloads:
    """:func:`payload` written into one reused buffer (no allocation per operation, so the
    benchmark's own garbage does not blur the RSS of the client it measures)."""

    def __init__(self, cap: int) -> None:
        import numpy as np

        self.np = np
        self.buf = np.zeros(cap, dtype=np.uint8)

    def make(self, key: str, size: int) -> memoryview:
        """The bytes of ``key`` (a view valid until the next call); ``size`` % 64 == 0."""
        np = self.np
        seed = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
        out = self.buf[:size]
        out.reshape(-1, 64)[:] = seed
        out.view(np.uint32)[::1024] = np.arange((size + 4095) // 4096, dtype=np.uint32)
        return memoryview(out.data).cast("B")


def ephemeral_key(k: int) -> tuple[str, int]:
    return f"e/{k}", EPHEMERAL_SIZES[k % len(EPHEMERAL_SIZES)]


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        from mooncake_core.store import StoreClient

        self.a = a
        self.idx = int(a.index)
        self.rng = random.Random(a.seed * 1000 + self.idx)
        self.client = StoreClient(
            master=a.master,
            segment_size=a.segment_size,
            cluster_id=a.cluster_id,
            failover_timeout_s=a.failover_timeout,
            prefault=True,
        ).start()
        eng = self.client.engine
        self.recv = eng.allocate(PD_SLOT * a.workers, prefault=True)
        self.send = eng.allocate(PD_SLOT, prefault=True)
        self.peers: list[dict[str, Any]] = []
        self.pay = Payloads(max(EPHEMERAL_SIZES))  # for the store thread (and verify, after it)
        self.pay_pd = Payloads(PD_SLOT)  # for the PD thread
        self.rbuf = bytearray(max(EPHEMERAL_SIZES))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.samples: list[str] = []  # first few problems, for the report
        self.inflight: dict[str, tuple[str, str, float]] = {}
        self.flagged: set[tuple[str, float]] = set()
        self.durable: collections.deque[str] = collections.deque()
        self.lost: set[str] = set()
        self.pending_remove: list[str] = []  # removes that failed: their outcome is unknown
        self.threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ bookkeeping
    def bump(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n

    def note(self, what: str, detail: str) -> None:
        with self.lock:
            self.counts[what] += 1
            if len(self.samples) < 20:
                self.samples.append(f"{what}: {detail}")
        logger.warning("worker %d %s: %s", self.idx, what, detail)

    def op(self, name: str, key: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run ``fn()`` as one timed operation (the watchdog sees it while it runs)."""
        tname = threading.current_thread().name
        t0 = time.monotonic()
        with self.lock:
            self.inflight[tname] = (name, key, t0)
        try:
            return fn(*args, **kw)
        finally:
            with self.lock:
                self.inflight.pop(tname, None)
                self.counts["ops"] += 1
                self.counts[f"op_{name}"] += 1

    def error(self, name: str, exc: BaseException) -> None:
        with self.lock:
            self.errors[f"{name}:{type(exc).__name__}"] += 1

    def watchdog(self) -> None:
        while not self.stop.wait(0.5):
            self.check_hung()

    def check_hung(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = [
                v
                for v in self.inflight.values()
                if now - v[2] > self.a.op_deadline and (v[1], v[2]) not in self.flagged
            ]
            for v in late:
                self.flagged.add((v[1], v[2]))
        for name, key, t0 in late:
            self.note("hung", f"{name} {key} running for {now - t0:.1f}s")

    # ------------------------------------------------------------------ the store mix
    def store_loop(self) -> None:
        c, rng = self.client, self.rng
        seq = 0
        while not self.stop.is_set():
            r = rng.random()
            key, size = ephemeral_key(rng.randrange(self.a.keyspace))
            try:
                if r < 0.40:
                    data = self.pay.make(key, size)
                    try:
                        self.op("put", key, c.put, key, data)
                    except ObjectExists:
                        self.bump("put_exists")
                elif r < 0.75:
                    self.get_check(key, size, durable=False)
                elif r < 0.83:
                    try:
                        self.op("remove", key, c.remove, key)
                    except ObjectNotFound:
                        pass
                elif r < 0.91:
                    seq += 1
                    self.durable_put(f"d/{self.idx}/{seq}")
                elif self.durable:
                    dk = self.durable[rng.randrange(len(self.durable))]
                    self.get_check(dk, DURABLE_SIZE, durable=True)
            except MooncakeError as exc:
                if type(exc).__name__ != "ObjectBusy":
                    self.error("store", exc)
            except Exception as exc:  # a bug in the client: count it, keep the loop alive
                self.note("unexpected", f"{type(exc).__name__}: {exc}")
            if self.a.pause:
                time.sleep(self.a.pause)

    def get_check(self, key: str, size: int, *, durable: bool) -> bool:
        c = self.client
        try:
            if self.rng.random() < 0.5:
                got: Any = self.op("get", key, c.get, key)
            else:
                n = self.op("get", key, c.get_into, key, self.rbuf)
                got = memoryview(self.rbuf)[:n]
        except ObjectNotFound:
            if durable:
                self.lost.add(key)
                self.note("lost", f"{key} not found")
            else:
                self.bump("get_miss")
            return False
        if got != self.pay.make(key, size):
            self.note("corrupted", f"{key}: {len(got)} bytes, expected {size}")
            return False
        self.bump("get_hit")
        return True

    def durable_put(self, key: str) -> None:
        c = self.client
        data = self.pay.make(key, DURABLE_SIZE)
        try:
            self.op("put", key, c.put, key, data, hard_pin=True, replica_num=2)
        except MooncakeError:
            self.pending_remove.append(key)  # maybe stored, maybe not: never counted as acked
            raise
        self.durable.append(key)
        while len(self.durable) > self.a.durable_cap:
            self.pending_remove.append(self.durable.popleft())
        self.flush_removes()

    def flush_removes(self) -> None:
        c = self.client
        while self.pending_remove:
            key = self.pending_remove[-1]
            try:
                self.op("remove", key, c.remove, key, force=True)
            except ObjectNotFound:
                pass
            self.pending_remove.pop()

    # ------------------------------------------------------------------ PD transfers
    def pd_loop(self) -> None:
        eng = self.client.engine
        rng = random.Random(self.a.seed * 7 + self.idx)
        seq = 0
        while not self.stop.is_set():
            others = [p for p in self.peers if p["index"] != self.idx]
            if not others:
                self.handle_notifies(None)
                time.sleep(0.05)
                continue
            peer = rng.choice(others)
            seq += 1
            n = rng.choice((4096, 65536, PD_SLOT))
            self.send.view[:n] = self.pay_pd.make(f"pd/{self.idx}/{seq}", n)
            remote = int(peer["recv"]) + self.idx * PD_SLOT
            msg = json.dumps({"from": self.idx, "seq": seq, "n": n, "name": eng.name})
            try:
                self.op(
                    "pd_write",
                    str(seq),
                    eng.write,
                    peer["name"],
                    self.send.view[:n],
                    remote,
                )
                self.op("pd_notify", str(seq), eng.notify, peer["name"], "pd", msg)
            except MooncakeError as exc:
                self.error("pd", exc)
                continue
            t0 = time.monotonic()
            tname = threading.current_thread().name
            with self.lock:
                self.inflight[tname] = ("pd_ack", str(seq), t0)
            acked = False
            while not self.stop.is_set() and time.monotonic() - t0 < self.a.op_deadline + 5:
                if self.handle_notifies(seq):
                    acked = True
                    break
                time.sleep(0.002)
            with self.lock:
                self.inflight.pop(tname, None)
            if acked:
                self.bump("pd_transfers")
                self.bump("pd_bytes", n)
            elif not self.stop.is_set():
                self.note("hung", f"pd transfer {seq} to worker {peer['index']} never acknowledged")
                with self.lock:
                    self.flagged.add((str(seq), t0))
            if self.a.pause:
                time.sleep(self.a.pause)

    def handle_notifies(self, awaited: int | None) -> bool:
        """Check the blocks peers wrote to us, acknowledge them; True if ``awaited`` was acked."""
        eng = self.client.engine
        got = False
        for name, body in eng.get_notifies():
            m = json.loads(body)
            if name == "pdack":
                got = got or m["seq"] == awaited
                continue
            if name != "pd":
                continue
            off = int(m["from"]) * PD_SLOT
            n = int(m["n"])
            want = self.pay_pd.make(f"pd/{m['from']}/{m['seq']}", n)
            if self.recv.view[off : off + n] != want:
                self.note("corrupted", f"pd block {m['seq']} from worker {m['from']}")
            else:
                self.bump("pd_verified")
            try:
                eng.notify(m["name"], "pdack", json.dumps({"seq": m["seq"]}))
            except MooncakeError as exc:
                self.error("pdack", exc)
        return got

    # ------------------------------------------------------------------ commands
    def start_threads(self) -> None:
        for name, fn in (
            ("store", self.store_loop),
            ("pd", self.pd_loop),
            ("watchdog", self.watchdog),
        ):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        end = time.monotonic() + self.a.op_deadline + 10
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))
        self.check_hung()
        stuck = [t.name for t in self.threads if t.is_alive()]
        for name in stuck:
            self.note("hung", f"thread {name} did not finish")
        try:
            self.flush_removes()
        except MooncakeError as exc:
            self.error("final_remove", exc)
        with self.lock:
            return {
                "counts": dict(self.counts),
                "errors": dict(self.errors),
                "samples": list(self.samples),
                "durable": list(self.durable),
                "lost": sorted(self.lost),
            }

    def verify(self, keys: list[str]) -> dict[str, Any]:
        """Read every key of another worker's durable set; answer what is missing or wrong."""
        missing: list[str] = []
        corrupted: list[str] = []
        errors: list[str] = []
        for key in keys:
            try:
                got = self.op("get", key, self.client.get, key)
            except ObjectNotFound:
                missing.append(key)
                continue
            except MooncakeError as exc:
                errors.append(f"{key}: {type(exc).__name__}: {exc}")
                continue
            if got != self.pay.make(key, DURABLE_SIZE):
                corrupted.append(key)
        return {"missing": missing, "corrupted": corrupted, "errors": errors[:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soak-worker")
    ap.add_argument("--master", required=True)
    ap.add_argument("--cluster-id", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--segment-size", type=int, default=16 << 20)
    ap.add_argument("--keyspace", type=int, default=4000)
    ap.add_argument("--durable-cap", type=int, default=150)
    ap.add_argument("--op-deadline", type=float, default=40.0)
    ap.add_argument("--failover-timeout", type=float, default=25.0)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    w = Worker(a)
    say({"hello": True, "pid": os.getpid(), "name": w.client.hostname, "recv": w.recv.addr})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "peers":
            w.peers = list(cmd["peers"])
            w.start_threads()
            say({"started": True})
        elif cmd["cmd"] == "progress":
            with w.lock:
                say({"progress": dict(w.counts)})
        elif cmd["cmd"] == "stop":
            say({"final": w.finish()})
        elif cmd["cmd"] == "verify":
            say({"verified": w.verify(list(cmd["keys"]))})
        elif cmd["cmd"] == "exit":
            break
    w.stop.set()
    w.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
