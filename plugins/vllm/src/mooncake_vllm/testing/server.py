"""Real-engine helpers for tests, the PD demo and the benchmark (no hub access).

- :func:`build_tiny_llama` writes a random-weight Llama plus a tokenizer trained
  locally with ``tokenizers`` (deterministic: fixed seed, fixed corpus).
- :class:`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server`` in a
  subprocess on a free loopback port with the environment vLLM needs on this CPU.

Importing this module does not import vLLM, torch or transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mooncake_core.config import environment

__all__ = [
    "build_tiny_llama",
    "VLLMServer",
    "free_port",
    "engine_env",
    "http_json",
    "stream_ttft",
    "read_counters",
    "pd_transfer_config",
    "store_transfer_config",
]

logger = logging.getLogger(__name__)

API_SERVER = "vllm.entrypoints.openai.api_server"

#: vLLM servers get SIGTERM when the process that started them dies, however it dies (a
#: killed pytest or xdist worker never runs ``stop()``; in their own session they were left
#: running, 7 servers per killed module).
_SETPRIV = shutil.which("setpriv")
_DIE_WITH_US: list[str] = [_SETPRIV, "--pdeathsig", "TERM"] if _SETPRIV else []

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "mooncake is a kvcache centric architecture for serving large language models",
    "prefill and decode run on separate instances and move the kv cache between them",
    "a distributed store keeps kv cache pages so that any instance can reuse a prefix",
    "tokens attention heads layers blocks pages transfers bytes seconds",
    "zero one two three four five six seven eight nine ten hundred thousand",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM subprocess on this CPU (loopback, offline, no stats)."""
    env = dict(environment())
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
            "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def build_tiny_llama(
    out: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 4096,
    vocab_cap: int = 512,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama and a locally trained BPE tokenizer to ``out``.

    Runs in a subprocess so the caller's process never imports torch/transformers
    (vLLM and other tests pin threads and RNGs). Returns ``out``; skips existing models.
    """
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        max_positions=max_positions,
        vocab_cap=vocab_cap,
        seed=seed,
        corpus=_CORPUS,
        out=str(out),
    )
    code = r"""
import json, sys
spec = json.loads(sys.argv[1])
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=spec["vocab_cap"], special_tokens=["<s>", "</s>", "<unk>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(spec["corpus"] * 4, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                               unk_token="<unk>")
fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")
fast.save_pretrained(spec["out"])
torch.manual_seed(spec["seed"])
cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=spec["hidden"],
                  intermediate_size=spec["intermediate"], num_hidden_layers=spec["layers"],
                  num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                  max_position_embeddings=spec["max_positions"], bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False, torch_dtype="float32")
model = LlamaForCausalLM(cfg)
model.save_pretrained(spec["out"], safe_serialization=True)
print(tok.get_vocab_size())
"""
    env = engine_env({"CUDA_VISIBLE_DEVICES": ""})
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        timeout=600,
    )
    return out


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    """POST ``body`` (or GET when None) and decode the JSON answer; raises on HTTP errors."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


class VLLMServer:
    """One OpenAI-compatible vLLM server in a subprocess (loopback only).

    Args:
        model: model directory.
        kv_transfer_config: the ``--kv-transfer-config`` object, or None.
        env: extra environment variables.
        log_path: where stdout/stderr go (a file, so a full pipe never blocks the server).
        args: extra command-line arguments.
        log_stats: keep vLLM's statistics on (its /metrics counters need them).
        enforce_eager: ``--enforce-eager``: no torch.compile warm-up at start (on these
            2 cores it took 100-130 s per server when several started together); compare
            outputs only between servers that agree on it.
        fork_engine: start vLLM's engine core by fork, not spawn, through
            :mod:`mooncake_vllm.testing.forked_engine` (vLLM is imported once per server
            instead of twice: about half the start-up CPU). Used by the engine tests at TP=1
            and TP=2 (TP workers forked from the engine core).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        block_size: int = 32,
        kv_cache_bytes: str = "64M",
        max_model_len: int = 2048,
        args: list[str] | None = None,
        name: str = "vllm",
        log_stats: bool = False,
        enforce_eager: bool = False,
        fork_engine: bool = False,
    ) -> None:
        self.model = str(model)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/{name}-{self.port}.log")
        cmd = [
            sys.executable,
            "-m",
            "mooncake_vllm.testing.forked_engine" if fork_engine else API_SERVER,
            "--model",
            self.model,
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--kv-cache-memory-bytes",
            kv_cache_bytes,
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
        ]
        if not log_stats:  # stats also feed /metrics (prefix-cache hit counters)
            cmd.append("--disable-log-stats")
        if enforce_eager:
            cmd.append("--enforce-eager")
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(args or [])
        self.cmd = cmd
        self.env = engine_env(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def _new_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [*_DIE_WITH_US, *self.cmd],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> VLLMServer:
        """Wait until /health answers. The API port was free when it was picked, but vLLM binds
        it only after loading the model, and another process may take it meanwhile: then the
        server is started again on a new port (up to 3 times; ``url`` and ``port`` follow)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if restarts < 3 and "Address already in use" in self.log_text():
                    restarts += 1
                    self._new_port()
                    self.start()
                    continue
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise TimeoutError(
            f"{self.name} not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}"
        )

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5).close()
            return True
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server and every process it started (its own process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def completion(self, prompt: Any, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        out: dict[str, Any] = http_json(self.url + "/v1/completions", body)
        return out

    def __enter__(self) -> VLLMServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stream_ttft(url: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[float, str]:
    """Send a streaming request; return (seconds to the first token, whole text)."""
    body = {**body, "stream": True}
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            for c in ev.get("choices", []):
                t = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if t and not first:
                    first = time.perf_counter() - t0
                parts.append(t)
    return first or (time.perf_counter() - t0), "".join(parts)


def read_counters(stats_dir: str | os.PathLike[str], prefix: str) -> dict[str, float]:
    """Sum the connector counters in ``stats_dir/<prefix>*.json``."""
    total: dict[str, float] = {}
    for f in Path(stats_dir).glob(prefix + "*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k, v in data.items():
            if isinstance(v, (int, float)) and k not in ("pid", "time"):
                total[k] = total.get(k, 0) + v
    return total


def pd_transfer_config(role: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for MooncakeCoreConnector (decode: recompute on failure)."""
    cfg: dict[str, Any] = {
        "kv_connector": "MooncakeCoreConnector",
        "kv_connector_module_path": "mooncake_vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": dict(extra),
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def store_transfer_config(master: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for MooncakeCoreStoreConnector against ``master``."""
    return {
        "kv_connector": "MooncakeCoreStoreConnector",
        "kv_connector_module_path": "mooncake_vllm.store_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mooncake": {"master_server_address": master}, **extra},
    }
