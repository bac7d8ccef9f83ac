"""EP expert weights through the real store: experts saved as objects by one process are
loaded by a rank that holds none of them (the rejoin path's store source)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from store_support import Agent, Master  # noqa: E402

from mooncake_core.ep.weights import StoreWeightSource  # noqa: E402
from mooncake_core.errors import EPError  # noqa: E402
from mooncake_core.store.client import StoreClient  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Master, Agent]]:
    tmp: Path = tmp_path_factory.mktemp("ep-store")
    m = Master(tmp)
    holder = Agent(m.address, segment_size=64 << 20, log=tmp / "holder.log")
    try:
        yield m, holder
    finally:
        holder.stop()
        m.stop()


def test_experts_round_trip_through_the_store(cluster: tuple[Master, Agent]) -> None:
    master, _holder = cluster
    g = torch.Generator().manual_seed(0)
    experts = {e: torch.randn(2 * 256 * 512, generator=g) for e in range(8)}
    # the process that loaded the model publishes every expert; it contributes no memory,
    # so the objects live in the holder process's segment
    with StoreClient(master=master.address, segment_size=0) as writer:
        src = StoreWeightSource(writer, key_prefix="tiny-moe/layer0/experts")
        for e, w in experts.items():
            src.publish(e, w)
    # a fresh client (a rank coming back with no weights) reads them back
    with StoreClient(master=master.address, segment_size=0) as reader:
        src = StoreWeightSource(reader, key_prefix="tiny-moe/layer0/experts")
        for e, w in experts.items():
            assert torch.equal(src.load(e), w)
        with pytest.raises(
            EPError, match="expert 99 is not in the store under 'tiny-moe/layer0/experts/99'"
        ):
            src.load(99)
