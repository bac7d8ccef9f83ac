"""SGLang's ``--disaggregation-transfer-backend mooncake`` on mooncake_core's compat engine.

A prefill process and a decode process (``_sglang_pd_role.py``) run SGLang's own PD
classes on CPU: ``MooncakeKVManager`` in each role, ``MooncakeKVBootstrapServer`` on the
prefill, ``MooncakeKVSender`` / ``MooncakeKVReceiver`` per request, SGLang's
``MooncakeTransferEngine`` wrapper around ``mooncake.engine.TransferEngine`` -- which is
``mooncake_core.compat.engine.TransferEngine`` here. The KV is SGLang's
``MHATokenToKVPool`` allocated on CPU (registered by address), the aux rows its
``MetadataBuffers``. No GPU call is reached on this path, so no shim is applied; the
only stand-in is the inert ``torchvision`` module of ``torchvision_stand_in.py`` (these tests').

Requests, in order, on one manager per side (SGLang's default protocol, ``rdma``, which
our compat engine serves over TCP on a machine without RDMA):

1. room 77: 5 prefill pages -> 5 other decode pages (out of order), sent in 2 chunks;
2. room 78: 3 pages, 3 chunks, the first request's connection reused;
3. room 79: the prefill's writes go through the test-only transport wrapper
   ``mooncake_conformance.faults.CorruptWrites`` (zeros delivered): the decode must see
   the damage (which shows that the byte comparison of 1 and 2 would catch bad KV).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup.sh)"
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]

ROLE = Path(__file__).with_name("_sglang_pd_role.py")
PLAN: list[dict[str, Any]] = [
    {"room": 77, "src": [3, 4, 5, 9, 10], "dst": [20, 1, 7, 8, 30], "chunks": 2},
    {"room": 78, "src": [11, 12, 2], "dst": [14, 13, 31], "chunks": 3},
    {"room": 79, "src": [15, 16], "dst": [21, 22], "chunks": 1, "corrupt": True},
]
# a small Llama config: SGLang's ServerArgs reads the model's config.json (no weights)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "head_dim": 64,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [
        ln for ln in text.splitlines() if "warnings.warn" not in ln and "UserWarning" not in ln
    ]
    return "\n".join(lines[-40:])


@pytest.fixture(scope="module")
def transfer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("sglang-pd")
    model = base / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    port = _free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1")
    env.pop("MOONCAKE_PROTOCOL", None)
    common = [
        "--model",
        str(model),
        "--bootstrap-port",
        str(port),
        "--plan",
        json.dumps(PLAN),
        "--timeout",
        "120",
    ]
    logs = {r: base / f"{r}.log" for r in ("prefill", "decode")}
    outs = {r: base / f"{r}.json" for r in ("prefill", "decode")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role in ("prefill", "decode"):
            with open(logs[role], "wb") as log:
                procs[role] = subprocess.Popen(
                    [sys.executable, str(ROLE), role, *common, "--out", str(outs[role])],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
        try:
            rc = procs["decode"].wait(420)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the decode did not finish; decode log:\n{_tail(logs['decode'])}\nprefill log:\n"
                f"{_tail(logs['prefill'])}"
            )
        assert rc == 0, (
            f"decode exited {rc}; decode log:\n{_tail(logs['decode'])}\n"
            f"prefill log:\n{_tail(logs['prefill'])}"
        )
        assert outs["prefill"].exists(), (
            f"prefill wrote no result; its log:\n{_tail(logs['prefill'])}"
        )
        result = {r: json.loads(outs[r].read_text()) for r in ("prefill", "decode")}
        result["logs"] = {r: str(p) for r, p in logs.items()}
        return result
    finally:
        p = procs.get("prefill")
        if p is not None:
            if p.stdin is not None:
                p.stdin.close()  # lets the prefill tear down
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        d = procs.get("decode")
        if d is not None and d.poll() is None:
            d.kill()
            d.wait()


def test_decode_receives_byte_identical_kv_pages(transfer: dict[str, Any]) -> None:
    sent, got = transfer["prefill"]["rooms"], transfer["decode"]["rooms"]
    assert [r["room"] for r in sent] == [r["room"] for r in got] == [s["room"] for s in PLAN]
    for step, s, g in zip(PLAN, sent, got, strict=True):
        if step.get("corrupt"):
            continue
        assert g["digests"] == s["digests"], (
            f"room {step['room']}: decode pages {step['dst']} differ from "
            f"prefill pages {step['src']}"
        )
        assert len(set(s["digests"])) == len(
            s["digests"]
        )  # distinct random pages, not one repeated


def test_aux_row_arrives_with_the_last_chunk(transfer: dict[str, Any]) -> None:
    for step, g in zip(PLAN, transfer["decode"]["rooms"], strict=True):
        if step.get("corrupt"):
            continue
        assert g["first_token"] == 4242 + step["room"]
        assert g["aux_room"] == step["room"]


def test_no_stray_writes_outside_the_requested_pages(transfer: dict[str, Any]) -> None:
    assert transfer["decode"]["untouched_nonzero"] == []


def test_kv_and_aux_buffers_deregister(transfer: dict[str, Any]) -> None:
    """SGLang's MooncakeTransferEngine.batch_deregister -> compat batch_unregister_memory."""
    assert transfer["decode"]["regions"] >= 2 * 4  # K and V of 4 layers, plus the aux rows
    assert transfer["decode"]["deregister_rc"] == 0


def test_sessions_are_compat_engines_on_loopback(transfer: dict[str, Any]) -> None:
    p, d = transfer["prefill"]["session"], transfer["decode"]["session"]
    assert p.startswith("127.0.0.1:") and d.startswith("127.0.0.1:") and p != d


def test_corrupted_delivery_is_detected(transfer: dict[str, Any]) -> None:
    """With the prefill's writes corrupted (test transport wrapper), the decode's pages are
    zeros, not the prefill's."""
    i = next(i for i, s in enumerate(PLAN) if s.get("corrupt"))
    s, g = transfer["prefill"]["rooms"][i], transfer["decode"]["rooms"][i]
    zero = transfer["decode"]["zero_digest"]
    assert all(x != y for x, y in zip(g["digests"], s["digests"], strict=True))
    assert g["digests"] == [zero] * len(g["digests"])
