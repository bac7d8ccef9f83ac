"""``mooncake.mooncake_connector_v1``: the published vLLM connector module, as vLLM's own.

The 0.3.13 wheel ships a vendored copy of an older vLLM ``MooncakeConnector`` (it imports
``vllm.attention.selector``, gone from current vLLM). Here the module re-exports the
installed vLLM's built-in connector (``vllm.distributed.kv_transfer.kv_connector.v1.
mooncake.mooncake_connector``), which imports ``mooncake.engine`` and so runs on our
compat :class:`~mooncake_core.compat.engine.TransferEngine`. A vLLM command line written
for the wheel works unchanged::

    --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",
                           "kv_connector_module_path":"mooncake.mooncake_connector_v1"}'

vLLM is imported when this module is (as published: the wheel's module needs vLLM too).
Published names the current vLLM connector lacks (the wheel's side-channel wire types and
env constants) are listed in :data:`mooncake_core.compat.inventory.NOT_PROVIDED`; the
difference in the prefill/decode request fields is in docs/compat.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BUILTIN_MODULE",
    "MooncakeConnector",
    "MooncakeConnectorMetadata",
    "MooncakeConnectorScheduler",
    "MooncakeConnectorWorker",
    "SendBlockMeta",
    "get_mooncake_side_channel_port",
    "group_concurrent_contiguous",
    "zmq_ctx",
]

#: the vLLM module re-exported here
BUILTIN_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

try:
    _builtin = importlib.import_module(BUILTIN_MODULE)
except ImportError as exc:  # vLLM absent, or too old to ship the connector
    raise ImportError(
        f"mooncake.mooncake_connector_v1 needs vLLM with its built-in MooncakeConnector "
        f"({BUILTIN_MODULE}): {exc}"
    ) from exc

# the same objects as vLLM's (vLLM's factory loads ``MooncakeConnector`` from here)
MooncakeConnector: Any = _builtin.MooncakeConnector
MooncakeConnectorMetadata: Any = _builtin.MooncakeConnectorMetadata
MooncakeConnectorScheduler: Any = _builtin.MooncakeConnectorScheduler
MooncakeConnectorWorker: Any = _builtin.MooncakeConnectorWorker
SendBlockMeta: Any = _builtin.SendBlockMeta
group_concurrent_contiguous: Any = _builtin.group_concurrent_contiguous
get_mooncake_side_channel_port: Any = _builtin.get_mooncake_side_channel_port


@contextlib.contextmanager
def zmq_ctx(socket_type: Any, addr: str) -> Iterator[Any]:
    """A ZMQ socket on ``addr`` in a context of its own, destroyed on exit (as published):
    a ``zmq.ROUTER`` binds, a ``zmq.REQ`` connects; any other type is a ValueError."""
    import zmq
    from vllm.utils.network_utils import make_zmq_socket

    if socket_type not in (zmq.ROUTER, zmq.REQ):
        raise ValueError(f"Unexpected socket type: {socket_type}")
    ctx = zmq.Context()
    try:
        yield make_zmq_socket(
            ctx=ctx, path=addr, socket_type=socket_type, bind=socket_type == zmq.ROUTER
        )
    finally:
        ctx.destroy(linger=0)
