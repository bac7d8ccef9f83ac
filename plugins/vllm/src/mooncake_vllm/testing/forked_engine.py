"""vLLM's OpenAI API server with its engine core forked instead of spawned (tests only).

vLLM 0.32's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in
``CpuPlatform.check_and_update_config``, so the API server starts its engine core process
as a fresh interpreter that imports torch, transformers and vLLM a second time: 15-20 s of
CPU per server on this machine (the API server's own import costs as much again). Run
through this module, the engine core is forked from the API server once the configuration
is settled and inherits those imports: one tiny-model server was healthy after 22 s
instead of 43 s, with the same greedy output.

The engine core then runs the same code (model runner, scheduler, KV connectors, general
plugins) in a process that was forked, which is vLLM's default start method on other
platforms. The engine tests use it at tensor-parallel sizes 1 and 2; at TP=2 the workers are
forked from the engine core too (test_vllm_tp: setup 56 s instead of 138 s, and the 5-11 s
whole-server stalls after a first request that broke TP=2 PD handshakes with spawn are gone).
:class:`~mooncake_vllm.testing.server.VLLMServer` uses it with ``fork_engine=True``.

Usage: ``python -m mooncake_vllm.testing.forked_engine <api_server arguments>``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

API_SERVER = "vllm.entrypoints.openai.api_server"


def _fork_engine_core() -> None:
    """Keep ``VLLM_WORKER_MULTIPROC_METHOD=fork`` after the CPU platform set it to spawn."""
    from vllm.platforms import cpu

    original: Any = cpu.CpuPlatform.check_and_update_config  # bound to the class

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(check_and_update_config))  # noqa: B010


def main() -> None:
    _fork_engine_core()
    sys.argv[0] = API_SERVER
    runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
