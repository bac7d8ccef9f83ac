"""``mooncake-core bench soak [--minutes N] [--json]``: a long run under faults that must not
leak, lose or corrupt anything.

Processes (all on 127.0.0.1, started here, in one temporary directory): a real etcd (Debian's
``etcd`` binary); two ``mooncake-core master`` with HA on it (a leader and a standby); two
``mooncake-core store`` nodes (a *stable* one and a *victim*); ``--workers`` worker processes
(:mod:`~mooncake_core.bench.soak_worker`), each a store client lending its own segment, doing
a mixed put / get / remove load on a shared key space many times larger than the pool (so the
master evicts all the time), keeping a bounded set of hard-pinned two-replica *durable*
objects, and moving blocks between each other through the transfer engine as a prefill
instance hands KV blocks to a decode instance (write into the peer's registered buffer,
notify, the peer checks the bytes and acknowledges).

Faults, scaled with ``--minutes``: the victim store node is SIGKILLed every
``clamp(minutes*60/4, 15 s, 180 s)`` and restarted a few seconds later (empty, a new
segment); the master leader is SIGKILLed once (at 10 % of the run, at most 2 minutes in); the
standby takes over and the old one is restarted as the new standby.

What is asserted (exit 1 when any fails):

- ``rss_growth_pct_max < 5``: every process judged (see :mod:`.soak_report`) grows its RSS by
  less than 5 % from just after warm-up to the end;
- ``lost_acked == 0``: *acknowledged objects that must survive* are the durable objects (put
  returned success, hard-pinned so never evicted, two replicas, not removed since). Only the
  victim is ever killed, one incarnation at a time, and no segment holds two replicas of one
  object, so each keeps a replica on a live process the whole run: a miss when its owner
  reads it during the run, or when another worker reads the whole set at the end, is a loss.
  The ephemeral ``e/*`` objects may be evicted or removed by any worker, so a miss there is
  not a loss (it is counted as ``get_miss``);
- ``corrupted_reads == 0``: every hit, ephemeral or durable, and every PD block is compared
  with the bytes derived from its key;
- ``hung_ops == 0``: no store call or PD transfer took longer than ``--op-deadline``;
- the faults really happened (node kills, one leader failover), the master evicted, and every
  worker ran to the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mooncake_core.bench import soak_procs as sp
from mooncake_core.bench.soak_report import Series, growth, plot

logger = logging.getLogger(__name__)

RSS_LIMIT_PCT = 5.0


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


class Soak:
    def __init__(self, a: argparse.Namespace, run_dir: Path) -> None:
        self.a = a
        self.dir = run_dir
        self.cluster = f"soak-{uuid.uuid4().hex[:8]}"
        self.duration = float(a.minutes) * 60
        self.warm = _clamp(0.2 * self.duration, 15, 300)
        self.leader_kill_at = _clamp(0.1 * self.duration, 6, 120)
        self.kill_every = _clamp(self.duration / 4, 15, 180)
        self.down_s = _clamp(self.kill_every / 4, 3, 10)
        self.lock = threading.Lock()
        self.series: list[Series] = []
        self.tracked: list[tuple[sp.Proc, Series]] = []
        self.events: list[tuple[float, str]] = []
        self.evictions: dict[str, int] = {}
        self.t0 = 0.0
        self.masters: list[sp.MasterProc] = []
        self.etcd: sp.Etcd | None = None
        self.stable: sp.StoreNode | None = None
        self.victim: sp.StoreNode | None = None
        self.workers: list[sp.WorkerProc] = []
        self.back_after_failover = 0.0
        self.node_kills = 0
        self.victim_deaths: list[tuple[float, int]] = []  # (when, pid) of killed victims
        #: label -> MiB of killed victims' memory a live process still maps (must be none)
        self.dead_mapped: dict[str, float] = {}
        self.failovers = 0
        self.stepdowns = 0  # masters that stepped down by themselves (and were restarted)
        self.killed: list[sp.MasterProc] = []
        self.chaos_errors: list[str] = []
        self.done = threading.Event()

    # ------------------------------------------------------------------ processes
    def now(self) -> float:
        return time.monotonic() - self.t0 if self.t0 else 0.0

    def track(self, p: sp.Proc, role: str) -> None:
        s = Series(p.label, role, self.now())
        with self.lock:
            self.series.append(s)
            self.tracked.append((p, s))

    def master(self, label: str) -> sp.MasterProc:
        extra = ["--ha-lease-ttl", "2", "--ha-snapshot-every", "200", "--client-ttl", "4"]
        extra += ["--eviction-high-watermark", "0.85", "--eviction-ratio", "0.1"]
        m = sp.MasterProc(label, self.dir, self.url, self.cluster, extra)
        self.masters.append(m)
        self.track(m, "master")
        return m

    def store(self, label: str) -> sp.StoreNode:
        n = sp.StoreNode(label, self.dir, self.url, self.cluster, self.a.store_segment_mb << 20)
        self.track(n, "store")
        return n

    def start(self) -> None:
        self.etcd = sp.Etcd(self.dir)
        self.url = self.etcd.url
        self.track(self.etcd, "etcd")
        m1 = self.master("master-a")
        m1.wait_role("leader", 30)
        self.master("master-b").wait_role("standby", 30)
        self.stable = self.store("store-stable")
        self.victim = self.store("store-victim#1")
        n = self.a.workers
        for i in range(n):
            args = ["--master", self.url, "--cluster-id", self.cluster, "--index", str(i)]
            args += ["--workers", str(n), "--segment-size", str(self.a.worker_segment_mb << 20)]
            args += ["--op-deadline", str(self.a.op_deadline), "--seed", str(self.a.seed)]
            args += ["--keyspace", str(self.a.keyspace), "--pause", str(self.a.pause)]
            w = sp.WorkerProc(f"worker{i}", self.dir, args)
            self.workers.append(w)
            self.track(w, "worker")
        peers = [
            {"index": i, "name": w.hello["name"], "recv": w.hello["recv"]}
            for i, w in enumerate(self.workers)
        ]
        self.t0 = time.monotonic()
        with self.lock:
            for _p, s in self.tracked:
                s.start = 0.0
        for w in self.workers:
            w.send({"cmd": "peers", "peers": peers})
        for w in self.workers:
            w.read(60)

    def leader(self) -> sp.MasterProc | None:
        for m in self.masters:
            if m.alive() and m.role() == "leader":
                return m
        return None

    # ------------------------------------------------------------------ faults
    def chaos(self) -> None:
        next_kill = self.leader_kill_at + self.kill_every / 2
        leader_done = False
        while not self.done.is_set():
            t = self.now()
            try:
                self.supervise()
                if not leader_done and t >= self.leader_kill_at:
                    leader_done = True
                    self.kill_leader()
                elif t >= next_kill and t < self.duration - self.down_s - 3:
                    next_kill += self.kill_every
                    self.kill_victim()
            except Exception as exc:  # noqa: BLE001 - reported, fails the run
                logger.exception("soak: fault injection failed")
                self.chaos_errors.append(f"{type(exc).__name__}: {exc}")
            self.done.wait(0.2)

    def supervise(self) -> None:
        """Restart, as a new standby, a master that exited on its own (a leader that lost its etcd
        lease steps down and exits, for its supervisor to start it again)."""
        for m in list(self.masters):
            if m in self.killed or m.alive():
                continue
            self.killed.append(m)
            self.stepdowns += 1
            self.events.append((self.now(), f"master {m.label} stepped down"))
            logger.warning(
                "soak: %.0fs: master %s exited by itself (code %s); restarting it",
                self.now(),
                m.label,
                m.proc.returncode,
            )
            m.log.close()
            self.master(f"master-r{self.stepdowns}")

    def kill_leader(self) -> None:
        m = self.leader()
        if m is None:
            raise RuntimeError("no leader to kill")
        standby = next(x for x in self.masters if x is not m and x.alive())
        self.events.append((self.now(), f"leader {m.label} killed"))
        logger.info("soak: %.0fs: SIGKILL the leader %s", self.now(), m.label)
        self.sample_master_counters()
        self.killed.append(m)
        m.kill()
        took = standby.wait_role("leader", 30)
        self.failovers += 1
        logger.info("soak: %s took over in %.1fs", standby.label, took)
        m.log.close()
        self.master("master-c").wait_role("standby", 30)
        self.back_after_failover = self.now()

    def kill_victim(self) -> None:
        assert self.victim is not None
        self.node_kills += 1
        self.events.append((self.now(), f"{self.victim.label} killed"))
        logger.info("soak: %.0fs: SIGKILL %s", self.now(), self.victim.label)
        self.victim.kill()
        self.victim_deaths.append((self.now(), self.victim.pid))
        self.victim.log.close()
        self.done.wait(self.down_s)
        self.victim = self.store(f"store-victim#{self.node_kills + 1}")

    # ------------------------------------------------------------------ sampling
    def sample(self) -> None:
        t = self.now()
        with self.lock:
            tracked = list(self.tracked)
        for p, s in tracked:
            if s.ended is not None:
                continue
            r = sp.rss_of(p.pid) if p.alive() else None
            if r is None:
                s.ended = t
            else:
                s.samples.append((t, *r))

    def sample_master_counters(self) -> None:
        for m in list(self.masters):
            if not m.alive():
                continue
            try:
                st = json.loads(m.http("/stats"))
            except (OSError, ValueError):
                continue
            if m.role() == "leader":
                self.evictions[m.label] = max(
                    self.evictions.get(m.label, 0), int(st.get("evictions", 0))
                )

    def progress(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for w in self.workers:
            try:
                c = w.call({"cmd": "progress"}, 30)["progress"]
            except (OSError, RuntimeError, TimeoutError):
                continue
            for k, v in c.items():
                total[k] = total.get(k, 0) + int(v)
        return total

    def run(self) -> None:
        chaos = threading.Thread(target=self.chaos, name="soak-chaos", daemon=True)
        chaos.start()
        step = _clamp(self.duration / 400, 1, 5)
        report_every = max(10.0, self.duration / 10)
        next_report = report_every
        while self.now() < self.duration:
            self.sample()
            if self.now() >= next_report:
                next_report += report_every
                self.sample_master_counters()
                p = self.progress()
                logger.warning(
                    "soak: %.1f/%.0f min: %d ops, %d PD transfers, %d node kills, %d failovers",
                    self.now() / 60,
                    self.duration / 60,
                    p.get("ops", 0),
                    p.get("pd_transfers", 0),
                    self.node_kills,
                    self.failovers,
                )
            time.sleep(step)
        self.done.set()
        chaos.join(120)
        self.sample()
        self.sample_master_counters()
        self.check_dead_mappings()

    def check_dead_mappings(self, grace_s: float = 3.0) -> None:
        """Which live processes still map memory of a victim killed over ``grace_s`` ago (the
        transfer engine drops such mappings within a second of its next transfer)."""
        dead = {pid for t, pid in self.victim_deaths if self.now() - t > grace_s}
        with self.lock:
            tracked = [p for p, s in self.tracked if s.ended is None]
        for p in tracked:
            if not p.alive():
                continue
            kept = sum(n for owner, n in sp.mapped_engine_memory(p.pid).items() if owner in dead)
            if kept:
                self.dead_mapped[p.label] = round(kept / 2**20, 1)

    # ------------------------------------------------------------------ the end
    def finish(self) -> dict[str, Any]:
        finals: list[dict[str, Any] | None] = []
        for w in self.workers:
            try:
                w.send({"cmd": "stop"})
            except OSError:
                pass
        for w in self.workers:
            try:
                finals.append(w.read(self.a.op_deadline + 60)["final"])
            except (OSError, RuntimeError, TimeoutError, KeyError) as exc:
                logger.error("soak: %s gave no final report: %s", w.label, exc)
                finals.append(None)
        missing: list[str] = []
        corrupted_final: list[str] = []
        verify_errors: list[str] = []
        n = len(self.workers)
        for i, w in enumerate(self.workers):  # worker i reads the durable set of worker i+1
            f = finals[(i + 1) % n]
            if f is None or finals[i] is None:
                continue
            try:
                v = w.call({"cmd": "verify", "keys": f["durable"]}, 300)["verified"]
            except (OSError, RuntimeError, TimeoutError, KeyError) as exc:
                verify_errors.append(f"{w.label}: {exc}")
                continue
            missing += v["missing"]
            corrupted_final += v["corrupted"]
            verify_errors += v["errors"]
        ok_finals = [f for f in finals if f is not None]
        counts: dict[str, int] = {}
        errors: dict[str, int] = {}
        for f in ok_finals:
            for k, val in f["counts"].items():
                counts[k] = counts.get(k, 0) + int(val)
            for k, val in f["errors"].items():
                errors[k] = errors.get(k, 0) + int(val)
        lost = set(missing)
        for f in ok_finals:
            lost.update(f["lost"])
        return {
            "counts": counts,
            "errors": errors,
            "lost": sorted(lost),
            "corrupted": counts.get("corrupted", 0) + len(corrupted_final),
            "hung": counts.get("hung", 0),
            "workers_failed": sum(1 for f in finals if f is None),
            "durable_checked": sum(len(f["durable"]) for f in ok_finals),
            "verify_errors": verify_errors[:5],
            "samples": [s for f in ok_finals for s in f["samples"]][:10],
        }

    def close(self) -> None:
        self.done.set()
        for p in [*self.workers, self.victim, self.stable, *self.masters]:
            if p is not None:
                try:
                    p.stop()
                except Exception:  # noqa: BLE001 - best effort on the way out
                    logger.debug("soak: stopping %s failed", p.label, exc_info=True)
        if self.etcd is not None:
            self.etcd.stop()


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench soak", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--worker-segment-mb", type=int, default=16)
    ap.add_argument("--store-segment-mb", type=int, default=32)
    ap.add_argument("--keyspace", type=int, default=4000, help="shared ephemeral keys")
    ap.add_argument("--op-deadline", type=float, default=40.0, help="seconds before an op is hung")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds each loop sleeps per op")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default="", help="PNG path (default: soak-rss.png in the run dir)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.workers < 2:
        ap.error("--minutes must be positive and --workers at least 2")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(list(argv or []))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    run_dir = Path(tempfile.mkdtemp(prefix="mc-soak-"))
    soak = Soak(a, run_dir)
    # SIGTERM (a timeout, a supervisor) unwinds like Ctrl-C, so close() stops every process
    # this run started instead of leaving them running on their own
    signal.signal(signal.SIGTERM, lambda sig, _f: sys.exit(128 + sig))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        soak.start()
        soak.run()
        res = soak.finish()
    except BaseException:
        logger.error("soak: failed; logs in %s", run_dir)
        raise
    finally:
        soak.close()
    return _report(a, soak, res, started, run_dir)


def _report(
    a: argparse.Namespace, soak: Soak, res: dict[str, Any], started: str, run_dir: Path
) -> int:
    warm_end = max(soak.warm, soak.back_after_failover + 10)
    min_span = max(15.0, 0.3 * (soak.duration - warm_end))
    judged: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []
    for s in soak.series:
        if s.role == "etcd":
            continue
        g = growth(s, warm_end, soak.warm, min_span)
        (judged if g is not None else shown).append(g or {"label": s.label})
    growth_max = max((g["growth_pct"] for g in judged), default=float("nan"))
    shm_max = max((g["shm_mib_end"] - g["shm_mib_start"] for g in judged), default=0.0)
    png = a.plot or str(run_dir / "soak-rss.png")
    title = f"mooncake-core bench soak --minutes {a.minutes:g}: RSS per process ({started})"
    png_out = plot(soak.series, soak.events, warm_end, png, title)
    c = res["counts"]
    out = {
        "minutes": a.minutes,
        "workers": a.workers,
        "ops": c.get("ops", 0),
        "puts": c.get("op_put", 0),
        "gets": c.get("op_get", 0),
        "removes": c.get("op_remove", 0),
        "get_hits": c.get("get_hit", 0),
        "get_misses": c.get("get_miss", 0),
        "pd_transfers": c.get("pd_transfers", 0),
        "pd_verified": c.get("pd_verified", 0),
        "pd_mib": round(c.get("pd_bytes", 0) / 2**20, 1),
        "evictions": sum(soak.evictions.values()),
        "node_kills": soak.node_kills,
        "leader_failovers": soak.failovers,
        "master_stepdowns": soak.stepdowns,
        "rss_growth_pct_max": growth_max,
        "shm_growth_mib_max": round(shm_max, 1),
        "dead_peer_mapped_mib": soak.dead_mapped,
        "rss": judged,
        "rss_not_judged": [g["label"] for g in shown],
        "durable_checked": res["durable_checked"],
        "lost_acked": len(res["lost"]),
        "corrupted_reads": res["corrupted"],
        "hung_ops": res["hung"],
        "workers_failed": res["workers_failed"],
        "errors": res["errors"],
        "plot": png_out,
    }
    failed = []
    if not judged or not growth_max < RSS_LIMIT_PCT:
        failed.append(f"RSS growth {growth_max}% (limit {RSS_LIMIT_PCT}%)")
    # Shared RSS may grow as the run touches more pages of live peers' segments (that is no
    # leak): what must not stay is a mapping of a peer that died.
    if soak.dead_mapped:
        failed.append(f"mappings of killed store nodes kept (MiB): {soak.dead_mapped}")
    for key in ("lost_acked", "corrupted_reads", "hung_ops", "workers_failed"):
        if out[key]:
            failed.append(f"{key} = {out[key]}")
    if soak.node_kills < 1 or soak.failovers != 1:
        failed.append(f"faults missing: {soak.node_kills} node kills, {soak.failovers} failovers")
    if out["evictions"] < 1:
        failed.append("the master never evicted: no eviction pressure")
    if soak.chaos_errors:
        failed.append(f"fault injection failed: {soak.chaos_errors[0]}")
    out["ok"] = not failed
    out["failed"] = failed
    print(f"soak: {a.minutes:g} min, {a.workers} workers, started {started}")
    print("RSS judged: the process's own pages (VmRSS - RssShmem); shm: mapped segments")
    print(
        f"{'process':<16}{'window s':>12}{'own MiB start':>15}{'end':>8}{'growth %':>10}"
        f"{'shm MiB start':>15}{'end':>8}"
    )
    for g in judged:
        win = f"{g['from_s']:.0f}-{g['to_s']:.0f}"
        print(
            f"{g['label']:<16}{win:>12}{g['rss_mib_start']:>15.1f}"
            f"{g['rss_mib_end']:>8.1f}{g['growth_pct']:>10.2f}"
            f"{g['shm_mib_start']:>15.1f}{g['shm_mib_end']:>8.1f}"
        )
    if shown:
        print(f"not judged (lived too short after warm-up): {', '.join(out['rss_not_judged'])}")
    for key in (
        "ops",
        "puts",
        "gets",
        "get_hits",
        "get_misses",
        "removes",
        "pd_transfers",
        "evictions",
        "node_kills",
        "leader_failovers",
        "master_stepdowns",
        "durable_checked",
        "lost_acked",
        "corrupted_reads",
        "hung_ops",
    ):
        print(f"  {key:<18}{out[key]}")
    if res["errors"]:
        print(f"  errors (retried or counted, not failures): {res['errors']}")
    for s in res["samples"]:
        print(f"  ! {s}")
    print(f"RSS plot: {png_out or 'not drawn (matplotlib is not installed)'}")
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    if a.keep or failed:
        print(f"logs: {run_dir}")
    else:
        _cleanup(run_dir, keep=png_out if png_out and png_out.startswith(str(run_dir)) else None)
    if a.json:
        print(json.dumps(out))
    return 0 if not failed else 1


def _cleanup(run_dir: Path, keep: str | None) -> None:
    import shutil

    for p in run_dir.iterdir():
        if keep and str(p) == keep:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if not keep:
        run_dir.rmdir()
