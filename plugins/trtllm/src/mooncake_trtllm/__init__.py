"""Mooncake-core adapter for TensorRT-LLM: a KV-cache store connector.

Select it in ``kv_connector_config`` with ``connector_module: mooncake_trtllm.connector``
(see :mod:`mooncake_trtllm.connector` and docs/trtllm.md). Importing this package does
not import TensorRT-LLM.
"""

from __future__ import annotations

__all__ = ["ENGINE", "SCHEDULER_CLASS", "WORKER_CLASS", "CONNECTOR_MODULE"]

ENGINE = "trtllm"
CONNECTOR_MODULE = "mooncake_trtllm.connector"
SCHEDULER_CLASS = "MooncakeStoreConnectorScheduler"
WORKER_CLASS = "MooncakeStoreConnectorWorker"
