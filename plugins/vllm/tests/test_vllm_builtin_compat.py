"""vLLM's built-in ``MooncakeConnector`` and ``MooncakeStoreConnector`` on our compat layer.

vLLM 0.32.0 ships both connectors; they import the published ``mooncake`` package
(``mooncake.engine.TransferEngine``, ``mooncake.store.MooncakeDistributedStore``). Here
that package is absent, so our ``vllm.general_plugins`` entry point installs
``mooncake_core.compat`` as ``mooncake`` in every vLLM process and the connectors run on
our transfer engine and store.

``MooncakeStoreConnector`` runs unmodified. ``MooncakeConnector`` does not: vLLM's
``MooncakeConnectorWorker.__init__`` calls ``torch.accelerator.current_device_index()``
(``mooncake_connector.py:1186``), which raises on a host without an accelerator. The first
test proves that on a real server; the PD servers run with ``MOONCAKE_CORE_CPU_SHIM=1``
(our plugin patches exactly that call; see docs/vllm.md).

One module-scoped set of servers (all started at once): a monolithic reference (the
conftest's ``vllm_reference``, shared with ``test_vllm_pd``), a prefill (``kv_producer``)
and decode (``kv_consumer``) pair with the built-in ``MooncakeConnector``, a decode without
the shim (expected to die at start-up), a store master (``mooncake-core master``) and two
``MooncakeStoreConnector`` instances A and B.
PD requests follow the flow of vLLM's Mooncake proxy example: a shared ``transfer_id``,
the prefill engine id read from its bootstrap server (``GET /query``), prefill
(``max_tokens=1``) and decode sent concurrently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mooncake_conformance.faults import corrupt_writes_env
from mooncake_vllm.testing import StoreMaster, VLLMServer, free_port, http_json
from vllm_helpers import BLOCK, needs_vllm, token_prompt, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 16
SHIM = {"MOONCAKE_CORE_CPU_SHIM": "1"}
DETAILS = ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens


@dataclass
class Servers:
    mono: VLLMServer
    prefill: VLLMServer
    decode: VLLMServer
    noshim: VLLMServer
    a: VLLMServer
    b: VLLMServer
    master: StoreMaster
    master_http: str
    bootstrap: str
    base: Path
    corrupt: VLLMServer  # prefill whose writes deliver zeros (test-only transport wrapper)
    corrupt_bootstrap: str


def _pd(role: str, module_path: str | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    if module_path:  # the published wheel's spelling (mooncake.mooncake_connector_v1)
        cfg["kv_connector_module_path"] = module_path
    return cfg


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, vllm_reference: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    base = tmp_path_factory.mktemp("builtin")
    boot_port, boot2 = free_port(), free_port()
    master = StoreMaster(base / "master.log").start()
    # the file vLLM's MooncakeStoreConnector reads (vllm/distributed/mooncake_store.py)
    cfg = base / "mooncake.json"
    cfg.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master.addr,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "64MB",
                "local_buffer_size": "16MB",
            }
        )
    )
    store = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    store_env = {"MOONCAKE_CONFIG_PATH": str(cfg)}  # no shim: the store connector runs unmodified

    def mk(model: Path, **kw: Any) -> VLLMServer:
        # no compile warm-up, one vLLM import per server (conftest)
        return VLLMServer(model, enforce_eager=True, fork_engine=True, **kw)

    own = [
        mk(
            tiny_model,
            name="prefill",
            log_path=base / "prefill.log",
            block_size=BLOCK,
            kv_transfer_config=_pd("kv_producer"),
            env={**SHIM, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_port)},
        ),
        mk(
            tiny_model,
            name="decode",
            log_path=base / "decode.log",
            block_size=BLOCK,
            # loaded through the published module path: the same connector class
            kv_transfer_config=_pd("kv_consumer", "mooncake.mooncake_connector_v1"),
            env=SHIM,
            args=DETAILS,
        ),
        mk(
            tiny_model,
            name="noshim",
            log_path=base / "noshim.log",
            block_size=BLOCK,
            kv_transfer_config=_pd("kv_consumer"),
            env={"MOONCAKE_CORE_CPU_SHIM": "0"},
        ),
        mk(
            tiny_model,
            name="A",
            log_path=base / "A.log",
            block_size=BLOCK,
            kv_transfer_config=store,
            env=store_env,
        ),
        mk(
            tiny_model,
            name="B",
            log_path=base / "B.log",
            block_size=BLOCK,
            kv_transfer_config=store,
            env=store_env,
            args=DETAILS,
        ),
        mk(
            tiny_model,
            name="corrupt",
            log_path=base / "corrupt.log",
            block_size=BLOCK,
            kv_transfer_config=_pd("kv_producer"),
            env={
                **SHIM,
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot2),
                **corrupt_writes_env(base / "faults"),
            },
        ),
    ]
    prefill, decode, noshim, a, b, corrupt = own
    mono = vllm_reference
    try:
        for s in own:
            s.start()
        for s in (mono, prefill, decode, a, b, corrupt):
            s.wait_ready(600)
        yield Servers(
            mono,
            prefill,
            decode,
            noshim,
            a,
            b,
            master,
            master.http_url,
            f"http://127.0.0.1:{boot_port}",
            base,
            corrupt,
            f"http://127.0.0.1:{boot2}",
        )
    finally:
        for s in own:
            s.stop()
        master.stop()


def _text(ans: dict[str, Any]) -> str:
    return str(ans["choices"][0]["text"])


def _cached(ans: dict[str, Any]) -> int:
    details = (ans.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_builtin_connector_needs_an_accelerator_without_the_shim(servers: Servers) -> None:
    """Unpatched, vLLM's MooncakeConnectorWorker dies on CPU inside vLLM, after our compat
    layer satisfied its ``mooncake.engine`` import."""
    proc = servers.noshim.proc
    assert proc is not None
    wait_for(lambda: proc.poll() is not None, 300, "the unpatched server to exit")
    log = servers.noshim.log_text()
    assert (
        "Initializing Mooncake Transfer Engine worker" in log
    )  # TransferEngine was importable (ours)
    assert "Mooncake is not available" not in log
    assert 'mooncake_connector.py", line 1186, in __init__' in log
    assert "RuntimeError: Cannot access accelerator device when none is available." in log


def _pd_request(
    s: Servers,
    prompt: list[int],
    engine_id: str,
    prefill: VLLMServer | None = None,
    bootstrap: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    tid = str(uuid.uuid4())
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(
            (prefill or s.prefill).completion,
            prompt,
            1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": tid,
            },
        )
        fd = ex.submit(
            s.decode.completion,
            prompt,
            MAX_TOKENS,
            kv_transfer_params={
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "remote_engine_id": engine_id,
                "remote_bootstrap_addr": bootstrap or s.bootstrap,
                "transfer_id": tid,
            },
        )
        return fp.result(), fd.result()


def test_builtin_pd_outputs_equal_monolithic(servers: Servers) -> None:
    # the prefill worker registered itself with its bootstrap server (vLLM's side channel)
    entry = http_json(servers.bootstrap + "/query")["0"]
    engine_id = entry["engine_id"]
    assert entry["worker_addr"]["0"]["0"].startswith("tcp://127.0.0.1:")
    assert (
        "MOONCAKE_CORE_CPU_SHIM=1: patched torch.accelerator.current_device_index"
        in servers.decode.log_text()
    )
    cached: dict[int, int] = {}
    for n in (1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 1, 500):
        prompt = token_prompt(n, salt=20)
        want = _text(servers.mono.completion(prompt, MAX_TOKENS))
        _, got = _pd_request(servers, prompt, engine_id)
        assert _text(got) == want, f"prompt of {n} tokens: PD {_text(got)!r} != monolithic {want!r}"
        # the decode instance never saw this prompt: its cached tokens are the ones the
        # prefill instance pushed (vLLM counts connector-loaded tokens as cached; it
        # recomputes the last one when the whole prompt was loaded)
        cached[n] = _cached(got)
    assert all(cached[n] in (n - 1, n) for n in cached) and cached[500] >= 499, cached
    print("decode cached tokens per prompt length:", cached)
    for s in (servers.prefill, servers.decode):
        assert s.healthy()
        assert "Traceback" not in s.log_text()


def test_builtin_pd_decode_really_uses_the_transferred_kv(servers: Servers) -> None:
    """The same PD request from a prefill instance whose writes deliver zeros (the test-only
    transport wrapper of ``mooncake_conformance.faults``, loaded in that server through the
    ``mooncake_core.transports`` entry point) gives a different answer than the monolithic one."""
    engine_id = http_json(servers.corrupt_bootstrap + "/query")["0"]["engine_id"]
    prompt = token_prompt(5 * BLOCK + 1, salt=22)
    want = _text(servers.mono.completion(prompt, MAX_TOKENS))
    _, good = _pd_request(
        servers, prompt, http_json(servers.bootstrap + "/query")["0"]["engine_id"]
    )
    assert _text(good) == want
    # a prompt the decode instance has never seen (else its own prefix cache would answer)
    fresh = token_prompt(5 * BLOCK + 1, salt=25)
    want_fresh = _text(servers.mono.completion(fresh, MAX_TOKENS))
    _, bad = _pd_request(servers, fresh, engine_id, servers.corrupt, servers.corrupt_bootstrap)
    assert (
        _cached(bad) >= 5 * BLOCK
    )  # the decode instance loaded (zeroed) KV rather than recomputing
    assert _text(bad) != want_fresh, (
        "zeroing the transferred KV did not change the output: it was not used"
    )


def test_builtin_pd_through_the_published_proxy_cli(servers: Servers) -> None:
    """The published proxy's command line (``python -m mooncake.vllm_v1_proxy_server``, here
    ``mooncake_core.compat.vllm_v1_proxy_server``) in front of the real prefill/decode pair.
    Its flow (prefill with ``do_remote_decode`` and no ``transfer_id``, then decode with what
    the prefill answered) moves no KV with vLLM's current connector: the prefill instance says
    so and the decode instance recomputes, and the answer equals the monolithic one."""
    port = free_port()
    cmd = [sys.executable, "-m", "mooncake_core.compat.vllm_v1_proxy_server", "--port", str(port)]
    cmd += ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(servers.prefill.port)]
    cmd += ["--decoder-hosts", "127.0.0.1", "--decoder-ports", str(servers.decode.port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return bool(http_json(url + "/healthcheck", timeout=5)["status"] == "ok")
            except OSError:
                return False

        wait_for(up, 60, "the proxy")
        prompt = token_prompt(3 * BLOCK + 1, salt=27)
        want = _text(servers.mono.completion(prompt, MAX_TOKENS))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS}
        got = http_json(url + "/v1/completions", {**body, "temperature": 0, "ignore_eos": True})
        assert _text(got) == want
        assert "Missing transfer_id in kv_transfer_params" in servers.prefill.log_text()
        assert _cached(got) < BLOCK  # computed by the decode instance itself
    finally:
        proc.terminate()
        proc.wait(10)


def _objects(s: Servers) -> int:
    return int(http_json(s.master_http + "/stats")["objects"])


def test_builtin_store_hit_on_fresh_instance(servers: Servers) -> None:
    assert "MOONCAKE_CORE_CPU_SHIM=1: patched" not in servers.a.log_text()
    prompt = token_prompt(500, salt=21)
    before = _objects(servers)
    want = _text(servers.a.completion(prompt, MAX_TOKENS))
    # A saved its full pages into our master's pool (asynchronously)
    wait_for(lambda: _objects(servers) >= before + 500 // BLOCK, 60, "A's pages in the pool")
    ans = servers.b.completion(prompt, MAX_TOKENS)
    assert _text(ans) == want
    # B never saw the prompt: every cached token came from the pool (all full pages)
    assert _cached(ans) == (500 // BLOCK) * BLOCK, ans.get("usage")
    # partial hit: A computes a new prompt; B, which never saw it, gets a prompt sharing only
    # its first 8 pages and loads exactly those 8 pages from the pool
    p2 = token_prompt(12 * BLOCK, salt=24)
    before2 = _objects(servers)
    servers.a.completion(p2, MAX_TOKENS)
    wait_for(lambda: _objects(servers) >= before2 + 12, 60, "A's second prompt in the pool")
    part = p2[: 8 * BLOCK] + token_prompt(3 * BLOCK + 7, salt=23)
    want_part = _text(servers.mono.completion(part, MAX_TOKENS))
    ans2 = servers.b.completion(part, MAX_TOKENS)
    assert _text(ans2) == want_part
    assert _cached(ans2) == 8 * BLOCK, ans2.get("usage")
    for s in (servers.a, servers.b):
        assert s.healthy()
        assert "Traceback" not in s.log_text()
