"""``mooncake-core bench sglang``: HiCache L3 page throughput through our SGLang backend.

Processes, all on loopback: a master and a store node that lends the memory, and two
SGLang ranks (SGLang's real MHA host pool, our ``MooncakeCoreStorage`` built by SGLang's
backend factory): the *writer* stores pages with ``batch_set_v1``, the *reader* loads
them with ``batch_get_v1`` into its zeroed pool and checks three of them (SHA-256)
against the writer's. Pages: 64 tokens of a 32-layer model (2 KV heads x 128 dims,
bfloat16, ``page_first``: 2 MiB a page, K and V), 64 pages a batch. Each rank times only
its own ``batch_*_v1`` call; figures are medians over rounds, after warm-up rounds
(which also touch the lent memory). Stored pages are removed after every round.

``--compare-mooncake PYTHON`` runs the same workload through SGLang's built-in
``MooncakeStore`` backend on the published wheel in that Python's venv
(``scripts/setup_mooncake_peer.sh --sglang`` installs SGLang there): the published
``mooncake_master`` with its HTTP metadata server, a holder lending the same amount of
memory, and two ranks (``benchmarks/published/_mooncake_sglang.py`` of the checkout),
protocol tcp. Both setups stay up and
their rounds alternate (the order flips every round), so machine drift hits both. The
JSON then adds ``mooncake_<key>`` and ``<key>_ratio_vs_mooncake`` (ours / theirs) for
``set_gbps``, ``get_gbps``, ``pages_per_s``, ``set_pages_per_s``.

``--transport``: ``auto`` (default: what our backend picks, shared memory between
processes on one host), ``tcp`` (forced, like the published side) or ``shm``. With
``--json`` the last line is one JSON object.

Registered as ``bench.sglang`` in the entry-point group ``mooncake_core.cli`` (so
``mooncake-core bench sglang`` runs :func:`main`); a rank is ``python -m
mooncake_sglang.bench --rank writer|reader``. Both ranks speak the line protocol of the
published rank script (its ``say`` / ``serve``, loaded from the checkout by
:mod:`mooncake_core.bench.published`). On a CPU-only machine without torchvision the ranks
load the SGLang tests' inert stand-in (``plugins/sglang/tests/torchvision_stand_in.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from mooncake_core import config
from mooncake_core.bench import published

logger = logging.getLogger(__name__)

PAGES = 64
CHECK = (0, PAGES // 2, PAGES - 1)
SEGMENT = 512 << 20  # memory the store node / holder lends: 4 batches of 128 MiB
WARMUP_ROUNDS = 3
PUBLISHED_RANK = "_mooncake_sglang"
#: the SGLang tests' inert torchvision, next to this package in the checkout
STAND_IN = Path(__file__).resolve().parents[2] / "tests" / "torchvision_stand_in.py"
RATIO_KEYS = ("set_gbps", "get_gbps", "pages_per_s", "set_pages_per_s")


# ---------------------------------------------------------------------- our rank process
def _protocol() -> ModuleType:
    """The published rank script: its ``say`` / ``serve`` are the ranks' line protocol."""
    return published.load(PUBLISHED_RANK)


def install_torchvision_stand_in() -> None:
    """Load the SGLang tests' inert torchvision (only acts when torchvision is absent)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None or not STAND_IN.is_file():
        return
    spec = importlib.util.spec_from_file_location("_mc_torchvision_stand_in", STAND_IN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install()


def _harness(master: str, transport: str) -> Any:
    from mooncake_conformance.harness import HarnessSpec, KVLayout

    from mooncake_sglang.testing.harness import make_harness

    install_torchvision_stand_in()

    lay = KVLayout(
        name="page_first",
        num_layers=32,
        page_size=64,
        num_kv_heads=2,
        head_dim=128,
        dtype="bfloat16",
        num_slots=PAGES + 1,
    )
    opts: dict[str, Any] = {"failover_timeout_s": 5.0}
    if transport != "auto":
        opts["protocol"] = transport
    return make_harness(
        HarnessSpec(
            factory="mooncake_sglang.testing.harness:make_harness",
            layout=lay,
            master=master,
            model="bench/sglang-32l",
            options=opts,
        )
    )


def rank_main(role: str, master: str, transport: str) -> int:
    """One SGLang rank on our backend; the line protocol of the published rank script."""
    proto = _protocol()
    h = _harness(master, transport)
    slots = list(range(PAGES))
    idx = h._indices(slots)
    if role == "writer":
        for s in slots:
            h.fill(s, seed=s + 1)

    def digests() -> list[str]:
        return [hashlib.sha256(h.read(s)).hexdigest() for s in CHECK]

    proto.say({"ready": True, "page_bytes": len(h.read(0)), "digests": digests()})
    backend = h.backend

    def clear() -> int:
        prefix = "^" + re.escape(backend._require()[1].prefix)
        return int(backend.client.remove_by_regex(prefix, force=True))

    proto.serve(backend, lambda n: idx[: n * h.page_size], h.pool.kv_buffer.zero_, digests, clear)
    h.close()
    return 0


# ---------------------------------------------------------------------- driver side
class _Side:
    """One setup (ours or the published one): its processes and its two ranks."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []
        self._logs: list[IO[str]] = []
        self.writer: subprocess.Popen[str] | None = None
        self.reader: subprocess.Popen[str] | None = None
        self.page_bytes = 0
        self.want: list[str] = []
        self.set_s: list[float] = []
        self.get_s: list[float] = []

    def start(
        self, tag: str, argv: list[str], env: dict[str, str] | None = None, pipes: bool = False
    ) -> subprocess.Popen[str]:
        log = open(self.workdir / f"{self.name}-{tag}.log", "w")  # closed in close()
        self._logs.append(log)
        p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else log,
            stderr=log,
            text=True,
            env=env,
            cwd=self.workdir,
        )
        self.procs.append((tag, p))
        return p

    def log(self, tag: str) -> str:
        try:
            return (self.workdir / f"{self.name}-{tag}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def answer(self, p: subprocess.Popen[str], tag: str, timeout: float = 120.0) -> dict[str, Any]:
        """The next ``@@ {...}`` line of rank ``p``."""
        assert p.stdout is not None
        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            while time.monotonic() < end:
                if not sel.select(max(0.0, end - time.monotonic())):
                    break
                line = p.stdout.readline()
                if not line:
                    break
                if line.startswith("@@ "):
                    out: dict[str, Any] = json.loads(line[3:])
                    if "error" in out:
                        raise RuntimeError(f"{self.name} {tag}: {out['error']}")
                    return out
        raise RuntimeError(
            f"{self.name} {tag} gave no answer within {timeout:.0f} s (exit {p.poll()}); "
            f"its log ends:\n{self.log(tag)}"
        )

    def ask(self, p: subprocess.Popen[str], tag: str, msg: dict[str, Any]) -> dict[str, Any]:
        assert p.stdin is not None
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()
        return self.answer(p, tag)

    def ranks(
        self, writer: list[str], reader: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.writer = self.start("writer", writer, env, pipes=True)
        self.reader = self.start("reader", reader, env, pipes=True)
        w = self.answer(self.writer, "writer", 300)
        self.answer(self.reader, "reader", 300)
        self.page_bytes = int(w["page_bytes"])
        self.want = list(w["digests"])

    def round(self, keys: list[str], measured: bool, clear: bool = True) -> None:
        assert self.writer is not None and self.reader is not None
        s = self.ask(self.writer, "writer", {"cmd": "set", "keys": keys})
        if s["ok"] != len(keys):
            raise RuntimeError(
                f"{self.name}: batch_set_v1 stored {s['ok']} of {len(keys)} pages; writer log:\n"
                f"{self.log('writer')}"
            )
        g = self.ask(self.reader, "reader", {"cmd": "get", "keys": keys})
        if g["ok"] != len(keys) or g["digests"] != self.want:
            raise RuntimeError(
                f"{self.name}: reader got {g['ok']} of {len(keys)} pages; SHA-256 of pages "
                f"{list(CHECK)} match: {g['digests'] == self.want}"
            )
        if measured:
            self.set_s.append(float(s["s"]))
            self.get_s.append(float(g["s"]))
        if clear:
            self.ask(self.writer, "writer", {"cmd": "clear"})

    def figures(self) -> dict[str, Any]:
        nbytes = PAGES * self.page_bytes
        set_med, get_med = statistics.median(self.set_s), statistics.median(self.get_s)
        return {
            "set_gbps": round(nbytes / set_med / 1e9, 3),
            "get_gbps": round(nbytes / get_med / 1e9, 3),
            "pages_per_s": round(PAGES / get_med, 1),
            "set_pages_per_s": round(PAGES / set_med, 1),
            "set_ms": round(set_med * 1e3, 2),
            "get_ms": round(get_med * 1e3, 2),
        }

    def close(self) -> None:
        for p in (self.writer, self.reader):
            if p is not None and p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    p.stdin.close()
                except OSError:
                    pass
        for _, p in reversed(self.procs):
            try:
                p.wait(10 if p in (self.writer, self.reader) else 0.1)
            except subprocess.TimeoutExpired:
                p.terminate()
        for _, p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()


def _wait_file(path: Path, proc: subprocess.Popen[Any], what: str) -> dict[str, Any]:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            out: dict[str, Any] = json.loads(path.read_text())
            return out
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within 60 s")


def _wait_port(port: int, proc: subprocess.Popen[Any], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f} s")


def start_ours(side: _Side, transport: str) -> None:
    py = sys.executable
    env = dict(config.environment(), MOONCAKE_LOG_LEVEL="WARNING")
    mready = side.workdir / "master.json"
    m = side.start(
        "master",
        [
            py,
            "-m",
            "mooncake_core",
            "--log-level",
            "WARNING",
            "master",
            "--rpc-port",
            "0",
            "--http-port",
            "-1",
            "--ready-file",
            str(mready),
        ],
        env,
    )
    master = f"127.0.0.1:{_wait_file(mready, m, 'master')['rpc_port']}"
    nready = side.workdir / "node.json"
    n = side.start(
        "node",
        [
            py,
            "-m",
            "mooncake_core",
            "--log-level",
            "WARNING",
            "store",
            "--master",
            master,
            "--segment-size",
            f"{SEGMENT >> 20}MB",
            "--prefault",
            "--ready-file",
            str(nready),
        ],
        env,
    )
    _wait_file(nready, n, "store node")
    logger.info(
        "ours: master %s, store node lending %d MiB; starting the two ranks", master, SEGMENT >> 20
    )
    rank = [
        py,
        "-m",
        "mooncake_sglang.bench",
        "--master",
        master,
        "--transport",
        transport,
        "--rank",
    ]
    side.ranks(rank + ["writer"], rank + ["reader"], env)


def check_published(python: str) -> str:
    """The absolute path of ``python`` if its venv has the published wheel and SGLang, else
    RuntimeError."""
    mooncake_env = published.peer().mooncake_env

    py = os.path.abspath(python) if os.sep in python else python
    master_bin = Path(py).parent / "mooncake_master"
    if not master_bin.is_file():
        raise RuntimeError(
            f"{master_bin} not found: {python} is not the scratch venv with the published wheel; "
            "run scripts/setup_mooncake_peer.sh --sglang"
        )
    chk = subprocess.run(
        [py, str(published.script(PUBLISHED_RANK + ".py")), "check"],
        capture_output=True,
        text=True,
        env=mooncake_env(),
        timeout=300,
    )
    if chk.returncode != 0:
        tail = (chk.stderr or chk.stdout).strip().splitlines()[-1:] or [""]
        raise RuntimeError(
            f"SGLang's MooncakeStore does not import with {python} ({tail[0]}); run "
            "scripts/setup_mooncake_peer.sh --sglang"
        )
    return py


def start_published(side: _Side, python: str) -> None:
    peer = published.peer()
    store_script, free_port, mooncake_env = peer.STORE_SCRIPT, peer.free_port, peer.mooncake_env

    py = os.path.abspath(python) if os.sep in python else python
    env = mooncake_env()
    rpc, http, metrics = free_port(), free_port(), free_port()
    m = side.start("master", peer.master_command(py, rpc, http, metrics), env)
    _wait_port(rpc, m, "published mooncake_master")
    _wait_port(http, m, "published mooncake_master (HTTP metadata)")
    master, metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    holder = side.start(
        "holder", [py, str(store_script), "holder", master, metadata, str(SEGMENT)], env, pipes=True
    )
    assert holder.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(holder.stdout, selectors.EVENT_READ)
        line = holder.stdout.readline().strip() if sel.select(60) else ""
    if line != "ready":
        raise RuntimeError(f"published holder said {line!r}; log:\n{side.log('holder')}")
    logger.info(
        "published: mooncake_master %s (metadata %s), holder lending %d MiB; "
        "starting the two ranks",
        master,
        metadata,
        SEGMENT >> 20,
    )
    rank = [py, str(published.script(PUBLISHED_RANK + ".py")), "rank"]
    side.ranks(
        rank + ["writer", master, metadata, str(PAGES)],
        rank + ["reader", master, metadata, str(PAGES)],
        env,
    )


def _keys(tag: str, r: int) -> list[str]:
    """SGLang-like page keys (64 hex digits), fresh for every round."""
    return [
        hashlib.sha256(f"{tag}-{os.getpid()}-{r}-{i}".encode()).hexdigest() for i in range(PAGES)
    ]


def run(rounds: int, transport: str = "auto", compare: str | None = None) -> dict[str, Any]:
    """Measure ours (and the published backend when ``compare`` is a Python); see module doc."""
    with tempfile.TemporaryDirectory(prefix="mc-bench-sglang-") as tmp:
        ours = _Side("ours", Path(tmp))
        theirs = _Side("published", Path(tmp)) if compare else None
        try:
            start_ours(ours, transport)
            if theirs is not None and compare:
                start_published(theirs, compare)
            sides = [ours] if theirs is None else [ours, theirs]
            for side in sides:  # warm-up: connections, page tables, first touch of the lent memory
                for w in range(WARMUP_ROUNDS):
                    side.round(
                        _keys(side.name + "-warm", w), measured=False, clear=w == WARMUP_ROUNDS - 1
                    )
            for r in range(rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    side.round(_keys(side.name, r), measured=True)
        finally:
            for opened in (ours, theirs):
                if opened is not None:
                    opened.close()
    res: dict[str, Any] = {
        "pages": PAGES,
        "page_bytes": ours.page_bytes,
        "rounds": rounds,
        "transport": transport,
    }
    res.update(ours.figures())
    if theirs is not None:
        t = theirs.figures()
        for k, v in t.items():
            res[f"mooncake_{k}"] = v
        for k in RATIO_KEYS:
            res[f"{k}_ratio_vs_mooncake"] = round(res[k] / t[k], 3) if t[k] else None
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench sglang", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="measured batches per backend (default 5)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--transport",
        choices=["auto", "tcp", "shm"],
        default="auto",
        help="our backend's path to the store node (default auto: shared memory on one host)",
    )
    ap.add_argument(
        "--compare-mooncake",
        metavar="PYTHON",
        default=None,
        help="also run SGLang's built-in MooncakeStore on the published wheel in this "
        "Python's venv (scripts/setup_mooncake_peer.sh --sglang prints it)",
    )
    ap.add_argument("--rank", choices=["writer", "reader"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(args.rank, args.master, args.transport)
    if args.rounds < 1:
        raise SystemExit("mooncake-core: error: --rounds must be at least 1")
    if args.compare_mooncake:
        try:
            args.compare_mooncake = check_published(args.compare_mooncake)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            raise SystemExit(f"mooncake-core: error: --compare-mooncake: {exc}") from None
    what = (
        "ours and SGLang's built-in backend on the published wheel, alternating"
        if args.compare_mooncake
        else "our backend"
    )
    print(
        f"bench sglang: {what}; master, store node, writer and reader ranks on loopback ...",
        file=sys.stderr,
        flush=True,
    )
    r = run(args.rounds, args.transport, args.compare_mooncake)
    mib = r["page_bytes"] / (1 << 20)
    print(
        f"{PAGES} pages x {mib:.2f} MiB a batch (32 layers, 64 tokens, K+V), "
        f"median of {r['rounds']} rounds; our transport: {r['transport']}"
    )
    print(
        f"{'backend':<22} {'op':<13} {'ms/batch':>9} {'GB/s':>7} "
        f"{'pages/s':>9} {'ours/published':>15}"
    )
    rows = [("ours (mooncake_core)", "")]
    if "mooncake_set_gbps" in r:
        rows.append(("published (built-in)", "mooncake_"))
    for name, p in rows:
        for op, k in (("batch_set_v1", "set"), ("batch_get_v1", "get")):
            pps = r[f"{p}set_pages_per_s"] if k == "set" else r[f"{p}pages_per_s"]
            ratio = r.get(f"{k}_gbps_ratio_vs_mooncake") if p == "" else None
            col = f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else ""
            print(
                f"{name:<22} {op:<13} {r[f'{p}{k}_ms']:>9.1f} {r[f'{p}{k}_gbps']:>7.2f} "
                f"{pps:>9.0f} {col:>15}"
            )
    print("(each reader verified every batch: page count and SHA-256 of three pages)")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
