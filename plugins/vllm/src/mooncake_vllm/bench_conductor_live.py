"""``mooncake-core bench conductor --live`` on vLLM: a trace slice through the proxy, 2 policies.

The live runner the core's ``bench conductor --live`` finds through the entry point
``bench.conductor-live-vllm`` (group ``mooncake_core.cli``); ``mooncake-core bench
conductor-live-vllm [options]`` is the same as ``mooncake-core bench conductor --live
--engine vllm [options]``. The core slices and scales the trace
(:mod:`mooncake_core.bench.conductor_live`); this module runs the engines:

- a store master (``mooncake-core master``);
- two prefill vLLM servers, each pinned to one core (one OpenMP thread,
  :func:`~mooncake_vllm.bench_mixed.omp_env`, and ``taskset -a -p`` on all its threads once
  it is ready; before 2026-12-02 two OpenMP threads shared the one core), with vLLM's
  ``MultiConnector`` over our PD connector (``kv_producer``) and our store connector
  (``kv_both``, all saving to and loading from the one master), KV events published to the
  proxy;
- one decode vLLM server (``kv_consumer``) sharing the first prefill instance's core
  (the proxy is a PD proxy; the decode work is the same under both policies);
- a random-weight Llama built locally (8 layers x 512 hidden, fp32; no hub), run eager
  (``--enforce-eager``: no compilation at start, which took minutes on the loaded cores).

Per phase (one per entry of ``settings.policies``; a policy's phases are merged): the
instances keep running; their prefix caches are reset
(``POST /reset_prefix_cache``, vLLM's dev endpoint, hence ``VLLM_SERVER_DEV_MODE=1``), the
store is emptied (``remove_all``) and every token id of the slice is shifted by a
per-phase bijection (3 + (t - 3 + 37 * phase) mod 400), so prompts keep exactly their
sharing but nothing an earlier phase computed can match. A fresh ``mooncake-core proxy
--policy P`` is started (``global-cache`` with ``--kv-events`` and ``--store-events``, the
master's KV events; ``--store-master``, a lookup per request, with ``--store-holdings lookup``;
``least-load-local``, ``--local-baseline``'s phases: ``--policy least-load --store-loads off``,
so the store connectors load nothing and only each instance's own prefix cache helps),
the requests are sent at their (compressed) arrival times as streaming completions (each
with ``user`` = its :func:`~mooncake_core.bench.conductor_live.request_tag`), the TTFT each
client sees is recorded, and the proxy's decision log (``GET /proxy/decisions``) is kept.
Hit rates come from the prefill instances' Prometheus counters
(``vllm:prefix_cache_queries`` / ``_hits`` and ``vllm:external_prefix_cache_hits``,
differences over the phase). Before the first phase, every instance serves a few unrelated
prompts, and each prefill instance a store hit and a prefix-cache hit (first-use costs).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_core.bench.conductor_live import (
    LOCAL_BASELINE,
    LiveRequest,
    LiveSettings,
    PhaseResult,
    merge_phases,
    request_tag,
)
from mooncake_vllm.bench_mixed import omp_env

__all__ = ["main", "run_conductor_live", "shift_tokens", "parse_counters", "MODEL", "QUICK_MODEL"]

# (layers, hidden, intermediate, heads, kv_heads)
MODEL = (8, 512, 1536, 8, 4)
QUICK_MODEL = (8, 512, 1536, 8, 4)
_VOCAB = 400
_METRICS = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_hits")


def main(argv: list[str] | None = None) -> int:
    """``mooncake-core bench conductor-live-vllm``: the core's live bench on vLLM."""
    from mooncake_core.bench import conductor

    return conductor.main(["--live", "--engine", "vllm", *(argv or [])])


def shift_tokens(prompt: tuple[int, ...], phase: int) -> list[int]:
    """The phase's token ids: a bijection of ids 3..402 (equal stays equal, distinct distinct)."""
    return [3 + (t - 3 + 37 * phase) % _VOCAB for t in prompt]


def _free_port() -> int:
    from mooncake_vllm.testing import free_port

    return free_port()


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data: bytes = r.read()
        return data


def _post(url: str, timeout: float = 30.0) -> Any:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _counters(url: str) -> dict[str, float]:
    return parse_counters(_get(url + "/metrics").decode())


def parse_counters(text: str) -> dict[str, float]:
    """Sum of each of :data:`_METRICS` over its label sets in a Prometheus text page."""
    out = {}
    for name in _METRICS:
        vals = re.findall(rf"^vllm:{name}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        out[name] = sum(float(v) for v in vals)
    return out


@dataclass
class _Proxy:
    proc: subprocess.Popen[bytes]
    url: str

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(_get(self.url + "/proxy/stats"))
        return data

    def decisions(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = json.loads(_get(self.url + "/proxy/decisions"))
        return data

    def stop(self) -> None:
        from mooncake_vllm.testing import stop_process

        stop_process(self.proc)


class _Cluster:
    """Master, two prefill instances and a decode instance (see the module docstring)."""

    def __init__(self, s: LiveSettings) -> None:
        from mooncake_vllm.testing import VLLMServer, build_tiny_llama, engine_env

        self.s = s
        work = s.workdir
        layers, hidden, inter, heads, kv_heads = QUICK_MODEL if s.quick else MODEL
        max_len = max(2048, s.max_prompt_tokens + 64)
        s.log(f"model: random Llama {layers} layers x {hidden} hidden (building if needed)")
        self.model = build_tiny_llama(
            work / f"llama-{layers}x{hidden}",
            layers=layers,
            hidden=hidden,
            intermediate=inter,
            heads=heads,
            kv_heads=kv_heads,
            max_positions=max(4096, max_len),
        )
        port = _free_port()
        self.master = f"127.0.0.1:{port}"
        # the master's KV events: global-cache learns the pool's holdings from them
        self.store_events = f"tcp://127.0.0.1:{_free_port()}"
        extra = ["--kv-events-endpoint", self.store_events] if s.store_holdings == "events" else []
        log = open(work / "master.log", "wb")  # noqa: SIM115 - owned by the child
        self.master_proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_core", "master", "--rpc-port", str(port)]
            + ["--http-port", str(_free_port()), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=engine_env(),
        )
        log.close()
        self.events = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
        self.stats_dirs = [work / "stats" / f"prefill{i}" for i in range(2)]
        bs = s.block_tokens
        cores = [str(c) for c in (list(s.cores) * 2)[:2]]
        self.prefill = []
        for i in range(2):
            srv = VLLMServer(
                self.model,
                name=f"prefill{i}",
                log_path=work / f"prefill{i}.log",
                block_size=bs,
                kv_cache_bytes="256M",
                max_model_len=max_len,
                kv_transfer_config=self._prefill_config(self.stats_dirs[i]),
                log_stats=True,
                env={"VLLM_SERVER_DEV_MODE": "1", **omp_env(cores[i])},
                args=[
                    "--enforce-eager",
                    "--kv-events-config",
                    json.dumps(
                        {
                            "enable_kv_cache_events": True,
                            "publisher": "zmq",
                            "endpoint": self.events[i],
                        }
                    ),
                ],
            )
            self.prefill.append(srv)
        self.decode = VLLMServer(
            self.model,
            name="decode",
            log_path=work / "decode.log",
            block_size=bs,
            kv_cache_bytes="128M",
            max_model_len=max_len,
            kv_transfer_config={
                "kv_connector": "MooncakeCoreConnector",
                "kv_role": "kv_consumer",
                "kv_connector_module_path": "mooncake_vllm.connector",
                "kv_load_failure_policy": "recompute",
            },
            env={"VLLM_SERVER_DEV_MODE": "1", **omp_env(cores[0])},
            args=["--enforce-eager"],
        )
        self.cores = cores

    def _prefill_config(self, stats: Path) -> dict[str, Any]:
        store = {
            "kv_connector": "MooncakeCoreStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "mooncake_vllm.store_connector",
            "kv_connector_extra_config": {
                "mooncake": {"master_server_address": self.master},
                "segment_size": "256MiB",
                "stats_dir": str(stats),
            },
        }
        pd = {
            "kv_connector": "MooncakeCoreConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "mooncake_vllm.connector",
        }
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_producer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [pd, store]},
        }

    @property
    def servers(self) -> list[Any]:
        return [*self.prefill, self.decode]

    def start(self) -> None:
        t0 = time.monotonic()
        for srv in self.servers:
            srv.start()
        for srv in self.servers:
            srv.wait_ready(900)
        # pinned once ready: starting three servers pinned from the outset (imports, model
        # load) took minutes longer on the shared cores
        for srv, core in zip(self.servers, [*self.cores, self.cores[0]], strict=True):
            subprocess.run(
                ["taskset", "-a", "-c", "-p", core, str(srv.proc.pid)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        self.s.log(
            f"instances ready in {time.monotonic() - t0:.0f} s: prefill "
            f"{self.prefill[0].url} (core {self.cores[0]}), {self.prefill[1].url} "
            f"(core {self.cores[1]}); decode {self.decode.url} (core {self.cores[0]})"
        )

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()
        if self.master_proc.poll() is None:
            self.master_proc.terminate()
            try:
                self.master_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.master_proc.kill()
                self.master_proc.wait(5)

    def proxy(self, policy: str, log: Path) -> _Proxy:
        port = _free_port()
        cmd = [sys.executable, "-m", "mooncake_core", "proxy"]
        cmd += ["--prefill", *(s.url for s in self.prefill), "--decode", self.decode.url]
        if policy == LOCAL_BASELINE:  # least-load, the store connectors load nothing
            cmd += ["--port", str(port), "--policy", "least-load", "--store-loads", "off"]
        else:
            cmd += ["--port", str(port), "--policy", policy]
        if policy == "global-cache":
            cmd += ["--block-tokens", str(self.s.block_tokens), "--kv-events", *self.events]
            if self.s.store_holdings == "events":
                cmd += ["--store-events", self.store_events, "--store-dtype", "float32"]
            else:
                cmd += ["--store-master", self.master, "--store-dtype", "float32"]
        from mooncake_vllm.testing import engine_env

        fh = open(log, "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=engine_env()
        )
        fh.close()
        p = _Proxy(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {proc.returncode}; see {log}")
            try:
                _get(p.url + "/health", timeout=1)
                return p
            except OSError:
                time.sleep(0.2)
        p.stop()
        raise TimeoutError(f"the proxy did not answer within 90 s; see {log}")

    def saves_settled(self, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
        """Until the store connectors' save counters stop moving (saves run after the answer)."""
        from mooncake_vllm.testing import read_counters

        def total() -> float:
            return sum(
                read_counters(d, "store-worker-").get("save_objects", 0.0) for d in self.stats_dirs
            )

        deadline = time.monotonic() + timeout_s
        last, since = total(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = total()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def reset(self) -> None:
        """Empty the store and every instance's prefix cache (retried while blocks are held)."""
        from mooncake_core.store.rpc import MasterRPC

        rpc = MasterRPC(self.master, timeout_s=10.0, failover_timeout_s=10.0)
        try:
            removed = int(rpc.call("remove_all", (True,)))
        finally:
            rpc.close()
        for srv in self.servers:
            deadline = time.monotonic() + 60
            while True:
                ok = bool((_post(srv.url + "/reset_prefix_cache") or {}).get("success"))
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{srv.name} did not reset its prefix cache within 60 s")
                time.sleep(0.5)
        self.s.log(f"reset: store emptied ({removed} objects), prefix caches of 3 instances")


def _body(prompt: list[int], max_tokens: int, tag: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if tag:
        body["user"] = tag  # names the request in the proxy's decision log
    return body


def _warm_up(c: _Cluster) -> None:
    """First-request costs of every instance and path, outside the measured phases."""
    from mooncake_vllm.testing import stream_ttft

    proxy = c.proxy("least-load", c.s.workdir / "proxy-warmup.log")
    try:
        for k in range(2):
            prompts = [
                shift_tokens(tuple(range(3 + 40 * k + i, 300 + 40 * k + i)), 99) for i in range(2)
            ]
            with ThreadPoolExecutor(2) as ex:  # two at once: least-load uses both instances
                list(
                    ex.map(
                        lambda p: stream_ttft(proxy.url + "/v1/completions", _body(p, 2)), prompts
                    )
                )
    finally:
        proxy.stop()
    # each prefill instance asks (directly) for both prompts of the first round: one the other
    # instance computed (a store hit; the first one maps the peer's segment), one its own (a
    # prefix-cache hit), so neither first-use cost falls into the phase that runs first
    c.saves_settled()
    for srv in c.prefill:
        for i in range(2):
            p = shift_tokens(tuple(range(3 + i, 300 + i)), 99)
            stream_ttft(srv.url + "/v1/completions", _body([*p, 5, 6, 7], 2))


def _phase(c: _Cluster, policy: str, index: int, reqs: list[LiveRequest]) -> PhaseResult:
    from mooncake_vllm.testing import stream_ttft

    s = c.s
    c.saves_settled()
    c.reset()
    proxy = c.proxy(policy, s.workdir / f"proxy-{policy}.log")
    res = PhaseResult()
    lock = threading.Lock()
    before = [_counters(p.url) for p in c.prefill]
    done = [0]
    client: dict[str, float] = {}

    def one(r: LiveRequest) -> None:
        try:
            ttft, _ = stream_ttft(
                proxy.url + "/v1/completions",
                _body(shift_tokens(r.prompt, index), r.max_tokens, request_tag(r)),
                timeout=600,
            )
            with lock:
                res.ttft_s.append(ttft)
                res.tagged_ttft.append((request_tag(r), ttft))
                client[request_tag(r)] = round(ttft, 4)
        except (OSError, RuntimeError, ValueError) as exc:
            with lock:
                res.errors += 1
                if res.errors <= 3:
                    s.log(f"{policy}: request {r.rid} failed: {exc}")
        with lock:
            done[0] += 1
            if done[0] % 10 == 0 or done[0] == len(reqs):
                s.log(f"{policy}: {done[0]}/{len(reqs)} answered")

    s.log(f"phase {index + 1} ({policy}): {len(reqs)} requests over {reqs[-1].arrival_s:.0f} s")
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=len(reqs)) as ex:
            for r in reqs:
                delay = t0 + r.arrival_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                ex.submit(one, r)
        res.wall_s = time.monotonic() - t0
        stats = proxy.stats()
        res.routed = {i["url"]: int(i["served"]) for i in stats["prefill"]}
        ps = stats.get("policy_stats") or {}
        res.decisions = proxy.decisions()
        for d in res.decisions:  # which phase, and the TTFT its client saw
            d["phase"] = index
            if d.get("tag") in client:
                d["client_ttft_s"] = client[d["tag"]]
        if policy == "global-cache":
            res.notes["kv_events"] = int(ps.get("kv_events", 0))
            res.notes["fetch_from_store"] = int(ps.get("fetch_from_store", 0))
            res.notes["kept_by_margin"] = int(ps.get("kept_by_margin", 0))
            res.notes["store_blocks_seen"] = int(ps.get("store_blocks_seen", 0))
    finally:
        proxy.stop()
    after = [_counters(p.url) for p in c.prefill]
    for b, a in zip(before, after, strict=True):
        res.prompt_tokens += a["prefix_cache_queries"] - b["prefix_cache_queries"]
        res.prefix_hit_tokens += a["prefix_cache_hits"] - b["prefix_cache_hits"]
        res.store_hit_tokens += a["external_prefix_cache_hits"] - b["external_prefix_cache_hits"]
    return res


def run_conductor_live(
    requests: list[LiveRequest], settings: LiveSettings
) -> dict[str, PhaseResult]:
    """Run the phases (see the module docstring); policy -> what it measured."""

    def _term(signum: int, frame: Any) -> None:  # e.g. `timeout`: stop the servers first
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _term) if main_thread else None
    c = _Cluster(settings)
    try:
        c.start()
        _warm_up(c)
        phases: dict[str, list[PhaseResult]] = {}
        for i, pol in enumerate(settings.policies):
            phases.setdefault(pol, []).append(_phase(c, pol, i, requests))
        return {pol: merge_phases(rs) for pol, rs in phases.items()}
    except (urllib.error.URLError, OSError, RuntimeError, TimeoutError) as exc:
        settings.log(f"failed: {exc}; logs in {settings.workdir}")
        raise
    finally:
        c.stop()
        if main_thread:
            signal.signal(signal.SIGTERM, old)
