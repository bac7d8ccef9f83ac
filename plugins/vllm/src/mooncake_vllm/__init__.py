"""Mooncake-core adapter for vLLM.

- :mod:`mooncake_vllm.connector`: ``MooncakeCoreConnector``, prefill/decode disaggregation
  (the decode instance pulls KV blocks through mooncake-core's transfer engine).
- :mod:`mooncake_vllm.store_connector`: ``MooncakeCoreStoreConnector``, a KV-cache pool
  shared by instances through mooncake-core's store (its worker-process half:
  :mod:`mooncake_vllm.store_worker`).
- :mod:`mooncake_vllm.register`: the ``vllm.general_plugins`` entry point that makes both
  selectable by name.
- :mod:`mooncake_vllm.adapter`: the ``mooncake_core.adapters`` entry point (adapter info,
  and :mod:`mooncake_vllm.proxy_support` for ``mooncake-core proxy --engine vllm``).
- :mod:`mooncake_vllm.pd_demo`, :mod:`mooncake_vllm.bench`: ``mooncake-core pd-demo`` and
  ``mooncake-core bench vllm`` (entry-point group ``mooncake_core.cli``).
- :mod:`mooncake_vllm.testing`: tiny local model and vLLM server helpers
  (``testing.server``) and the conformance harness (``testing.harness``).

Importing this package does not import vLLM.
"""

from __future__ import annotations

__all__ = ["ENGINE", "CONNECTORS"]

ENGINE = "vllm"
CONNECTORS = {
    "MooncakeCoreConnector": "mooncake_vllm.connector",
    "MooncakeCoreStoreConnector": "mooncake_vllm.store_connector",
}
