"""The tensor family of the compat ``MooncakeDistributedStore`` (CPU torch tensors).

Ours only: the scratch venv with the published wheel has no torch (its tensor methods
cannot run there), and our typed-value format is not the published one, so the two
stores do not read each other's tensors (docs/compat.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from mooncake_core.compat.store import MooncakeDistributedStore  # noqa: E402
from mooncake_core.store import MasterServer  # noqa: E402


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    master = MasterServer(rpc_port=0, http_port=-1).start_in_thread()
    s = MooncakeDistributedStore()
    try:
        assert (
            s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.address) == 0
        )
        yield s
    finally:
        s.close()
        master.shutdown()


@pytest.mark.timeout(90)
def test_batch_put_get_and_upsert(store: MooncakeDistributedStore) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.tensor([1, 2, 3], dtype=torch.int64)
    assert store.batch_put_tensor(["a", "b"], [a, b]) == [0, 0]
    got = store.batch_get_tensor(["a", "nope", "b"])
    assert torch.equal(got[0], a) and got[1] is None and torch.equal(got[2], b)
    assert got[0].dtype == torch.float32 and got[0].shape == (3, 4)
    assert store.batch_put_tensor(["x"], [a, b]) == [-600]
    assert store.upsert_tensor("a", b) == 0
    assert torch.equal(store.get_tensor("a"), b)
    assert store.batch_upsert_tensor(["a", "c"], [a, b]) == [0, 0]
    assert torch.equal(store.get_tensor("a"), a) and torch.equal(store.get_tensor("c"), b)
    store.put("raw", b"not a tensor")
    assert store.batch_get_tensor(["raw"]) == [None]


@pytest.mark.timeout(90)
def test_tensor_parallel_shards(store: MooncakeDistributedStore) -> None:
    w = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    assert store.put_tensor_with_tp("w", w, tp_size=2, split_dim=1) == 0
    assert store.is_exist("w_tp_0") == 1 and store.is_exist("w_tp_1") == 1
    assert torch.equal(store.get_tensor_with_tp("w", tp_rank=1, tp_size=2), w[:, 3:])
    assert torch.equal(store.get_tensor_with_tp("w", tp_rank=0, tp_size=2), w[:, :3])
    assert store.put_tensor_with_tp("whole", w) == 0  # tp_size 1: the key itself
    assert torch.equal(store.get_tensor_with_tp("whole"), w)
    assert store.batch_put_tensor_with_tp(["p", "q"], [w, w * 2], tp_size=4) == [0, 0]
    shards = store.batch_get_tensor_with_tp(["p", "q", "nope"], tp_rank=3, tp_size=4)
    assert torch.equal(shards[0], w[3:]) and torch.equal(shards[1], (w * 2)[3:])
    assert shards[2] is None
    assert store.put_tensor_with_tp("bad", w, tp_size=0) == -600


@pytest.mark.timeout(90)
def test_get_tensor_into_registered_memory_and_back(store: MooncakeDistributedStore) -> None:
    t = torch.linspace(0, 1, 1000, dtype=torch.float64).reshape(10, 100)
    assert store.put_tensor("t", t) == 0
    n = 1 << 16
    buf = (ctypes.c_char * n)()
    p = ctypes.addressof(buf)
    assert store.register_buffer(p, n) == 0
    got = store.get_tensor_into("t", p, n)
    assert torch.equal(got, t)
    got[0, 0] = 42.0  # shares the registered memory
    size = store.get_size("t")
    assert store.put_tensor_from("t2", p, size) == 0
    assert store.get_tensor("t2")[0, 0].item() == 42.0
    assert store.get_tensor_into("nope", p, n) is None
    assert store.get_tensor_into("t", p, 16) is None  # buffer too small
    half = n // 2
    assert store.batch_put_tensor_from(["u"], [p], [size]) == [0]
    res = store.batch_get_tensor_into(["t", "u", "nope"], [p, p + half, p], [half, half, half])
    assert torch.equal(res[0], t) and res[1][0, 0].item() == 42.0 and res[2] is None
    assert store.upsert_tensor_from("u", p, size) == 0
    assert store.batch_upsert_tensor_from(["u"], [p], [size]) == [0]
    assert store.unregister_buffer(p) == 0
