"""``mooncake-core proxy``: OpenAI-compatible prefill/decode proxy in front of engine instances.

The engine (``--engine``, default vLLM) is served by its installed adapter, which tells the
proxy how to split a PD request, tokenize, read KV events and name store pages.

Example::

    mooncake-core proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    mooncake-core proxy --prefill URL1 URL2 --decode URL3 --policy global-cache --block-tokens 32 \
        --store-master 127.0.0.1:50051 --store-dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from mooncake_core.errors import ConfigError
from mooncake_core.proxy import DEFAULT_ENGINE, POLICIES, ProxyConfig, ProxyServer
from mooncake_core.proxy.storelookup import parse_master_address
from mooncake_core.proxy.upstreams import check_url, wait_for_upstreams

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill instance base URL(s) (vLLM: kv_role kv_producer)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode instance base URL(s) (vLLM: kv_role kv_consumer)",
    )
    p.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        metavar="NAME",
        help="the engine the instances run; an installed adapter serves it "
        f"(default {DEFAULT_ENGINE})",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000; 0 = any)")
    p.add_argument(
        "--policy",
        default="least-load",
        choices=sorted(POLICIES),
        help="instance choice (default least-load)",
    )
    g = p.add_argument_group("global-cache policy (the conductor)")
    g.add_argument(
        "--reject",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="early rejection: answer 429 when the predicted TTFT/TBT misses the SLO (default off)",
    )
    g.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        metavar="S",
        help="TTFT target in seconds (default 10)",
    )
    g.add_argument(
        "--slo-tbt",
        type=float,
        default=None,
        metavar="S",
        help="time-between-tokens target in seconds (default 0.1)",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="cost-model profile JSON from 'mooncake-core conductor fit' "
        "(default: shipped profile)",
    )
    g.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens per KV block of the engines (default 32)",
    )
    g.add_argument(
        "--kv-events",
        nargs="+",
        default=None,
        metavar="ENDPOINT",
        help="one ZMQ endpoint per prefill instance, e.g. tcp://127.0.0.1:5557, bound here; "
        "start each instance publishing its KV events there (vLLM: --kv-events-config "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
        '"endpoint":"<its ENDPOINT>"}\')',
    )
    g.add_argument(
        "--tokenize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="token ids of text prompts from the prefill instances' tokenizer, so they match "
        "KV events and store keys (default on)",
    )
    g.add_argument(
        "--store-master",
        nargs="?",
        const="",
        default=None,
        metavar="HOST:PORT",
        help="store master the instances' store connector saves to; count the pages it holds "
        "as fetchable (no value: master_server_address of the project config)",
    )
    g.add_argument(
        "--store-events",
        default=None,
        metavar="ENDPOINT",
        help="instead of --store-master: the store master's KV-event endpoint "
        "(its --kv-events-endpoint); the pool's holdings come from its events",
    )
    g.add_argument(
        "--store-holders",
        default=None,
        metavar="SEG,SEG",
        help="with --store-events: each prefill instance's store segment name (instance order); "
        "pages in an instance's segment count as cached there",
    )
    g.add_argument(
        "--store-dtype",
        default=None,
        metavar="DTYPE",
        help="with --store-master: the dtype the instances run with (float32, bfloat16, float16)",
    )
    g.add_argument(
        "--store-model",
        default=None,
        metavar="PATH",
        help="with --store-master: the instances' model path (default: from their GET /v1/models)",
    )
    g.add_argument(
        "--store-tp",
        type=int,
        default=1,
        metavar="N",
        help="with --store-master: their TP size (default 1)",
    )
    g.add_argument(
        "--store-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="longest a store lookup may take; slower counts as nothing stored (default 0.5)",
    )
    p.add_argument(
        "--store-loads",
        choices=("on", "off"),
        default="on",
        help="off: every prefill request asks the instances' store connector to load nothing "
        "from the store (only their own prefix cache helps; saves go on). Default on",
    )
    p.add_argument(
        "--prefill-timeout", type=float, default=300.0, help="seconds to wait for a prefill answer"
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=300.0,
        help="longest silence of a decode answer, seconds",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=5.0, help="connect timeout to an instance, seconds"
    )
    p.add_argument(
        "--wait-upstreams",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="at start, wait this long for every instance to answer GET /health or /v1/models, "
        "else fail naming the unreachable ones (default 30; 0 = start without waiting, for "
        "instances that start later)",
    )


async def _serve(cfg: ProxyConfig, wait_upstreams_s: float = 0.0) -> None:
    upstreams = [("prefill", u) for u in cfg.prefill] + [("decode", u) for u in cfg.decode]
    await wait_for_upstreams(upstreams, wait_upstreams_s, probe_timeout_s=cfg.connect_timeout_s)
    server = ProxyServer(cfg)
    url = await server.start()
    print(f"proxy listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    asyncio.run(_serve(config_from_args(args), args.wait_upstreams))
    return 0


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The proxy's settings from its command line; ConfigError (one line) on a bad mix."""
    prefill = [check_url(u, "--prefill") for u in args.prefill]
    decode = [check_url(u, "--decode") for u in args.decode]
    opts: dict[str, Any] = {}
    store = args.store_master
    if args.policy == "global-cache":
        if store is not None:
            if not store:
                from mooncake_core.config import load_config

                store = load_config().master_server_address
            store = parse_master_address(store)
            if not args.store_dtype:
                raise ConfigError(
                    "--store-master needs --store-dtype: the dtype the engine instances run with "
                    "(e.g. float32 or bfloat16)"
                )
            if args.store_events:
                raise ConfigError("give --store-master or --store-events, not both")
        elif args.store_events:
            if not args.store_dtype:
                raise ConfigError(
                    "--store-events needs --store-dtype: the dtype the engine instances run with "
                    "(e.g. float32 or bfloat16)"
                )
        elif args.store_dtype or args.store_model:
            raise ConfigError("--store-dtype and --store-model need --store-master")
        if args.store_holders and not args.store_events:
            raise ConfigError("--store-holders needs --store-events")
        opts = {
            "reject": args.reject,
            "slo_ttft_s": args.slo_ttft,
            "slo_tbt_s": args.slo_tbt,
            "profile": args.profile,
            "block_tokens": args.block_tokens,
            "kv_events": args.kv_events,
            "tokenize": args.tokenize,
            "store_master": store,
            "store_dtype": args.store_dtype,
            "store_model": args.store_model,
            "store_tp": args.store_tp,
            "store_timeout_s": args.store_timeout,
            "store_events": args.store_events,
            "store_holders": (
                [h.strip() for h in args.store_holders.split(",")] if args.store_holders else None
            ),
        }
    elif (
        args.reject
        or args.profile
        or args.slo_ttft
        or args.slo_tbt
        or args.kv_events
        or store is not None
        or args.store_events
    ):
        raise ConfigError(
            "--reject, --slo-*, --profile, --kv-events, --store-master need --policy global-cache "
            f"(got --policy {args.policy})"
        )
    return ProxyConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        host=args.host,
        port=args.port,
        policy=args.policy,
        policy_options=tuple(opts.items()),
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        read_timeout_s=args.read_timeout,
        engine=args.engine,
        store_loads=args.store_loads != "off",
    )
