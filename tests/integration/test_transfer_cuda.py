"""CUDA tensors in the transfer engine (staged through host memory). Needs a GPU."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_cuda_tensor_register_write_read(spawn_peer: Any) -> None:
    from mooncake_core.transfer import TransferEngine

    peer = spawn_peer()
    raddr = peer.call("alloc", size=1 << 20)["addr"]
    with TransferEngine() as eng:
        src = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
        eng.write(peer.name, src, raddr)
        dst = torch.zeros_like(src)
        eng.read(peer.name, dst, raddr)
        assert torch.equal(src, dst)
        reg = torch.zeros(1 << 18, dtype=torch.int32, device="cuda")
        eng.register(reg, name="gpu")
        with TransferEngine() as other:
            other.write(eng.name, src.cpu().numpy(), segment="gpu")
        assert torch.equal(reg, src)
