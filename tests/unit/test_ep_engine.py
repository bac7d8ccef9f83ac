"""ElasticEP in one process (one seat, real gloo group): API shape and clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mooncake_core.ep import ElasticEP, EPConfig, ExpertBank, make_expert_weights, reference_moe
from mooncake_core.ep.testing import make_inputs, serve_store
from mooncake_core.errors import ConfigError, EPError, InvalidRouting

H, F, E, K = 64, 16, 8, 2


@pytest.fixture(params=["auto", "collective"])
def ep(request: pytest.FixtureRequest) -> Iterator[ElasticEP]:
    store, port = serve_store()
    weights = make_expert_weights(E, H, F)
    cfg = EPConfig(
        num_experts=E,
        num_seats=1,
        slots_per_rank=E,
        hidden=H,
        top_k=K,
        connect_timeout_s=10,
        transport=request.param,
    )
    layer = ElasticEP(
        cfg, 0, ExpertBank(H, F, {e: weights[e] for e in range(E)}), "127.0.0.1", port
    )
    layer.start()
    assert layer.transport == ("shm" if request.param == "auto" else "collective")
    yield layer
    layer.close()
    del store


@pytest.mark.timeout(30)
def test_dispatch_combine_and_forward_equal_reference(ep: ElasticEP) -> None:
    weights = make_expert_weights(E, H, F)
    x, idx, w, logits = make_inputs(0, 0, 0, 24, H, E, K)
    recv_x, counts, handle = ep.dispatch(x, idx, w, ep.active_ranks(), E, timeout=2.0)
    assert recv_x.shape == (24 * K, H) and int(counts.sum()) == 24 * K
    y = ep.combine(ep.bank.forward(recv_x, counts, ep.local_experts()), handle)
    ref = reference_moe(x, idx, w, weights, H, F)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ep.forward(x, idx, w, logits), ref, atol=1e-5, rtol=1e-5)
    assert ep.step == 2 and ep.epoch == 0
    with pytest.raises(EPError, match="stale dispatch handle"):
        ep.combine(recv_x, handle)
    # bf16 rows (2-byte elements), an odd batch, and an empty one
    xb = x[:7].to(torch.bfloat16)
    yb = ep.forward(xb, idx[:7], w[:7])
    assert yb.dtype == torch.bfloat16
    refb = reference_moe(xb.float(), idx[:7], w[:7], weights, H, F)
    torch.testing.assert_close(yb.float(), refb, atol=0.05, rtol=0.05)
    assert ep.forward(x[:0], idx[:0], w[:0]).shape == (0, H)


@pytest.mark.timeout(30)
def test_bad_input_raises_clear_errors_without_hanging(ep: ElasticEP) -> None:
    x, idx, w, _ = make_inputs(0, 0, 1, 8, H, E, K)
    with pytest.raises(InvalidRouting, match=f"expert id {E}"):
        ep.forward(x, idx.masked_fill(idx == idx[0, 0], E), w)
    with pytest.raises(InvalidRouting, match="topk_weights shape"):
        ep.forward(x, idx, w[:, :1])
    with pytest.raises(InvalidRouting, match="hidden size"):
        ep.forward(x[:, :3], idx, w)
    with pytest.raises(InvalidRouting, match="every rank inactive"):
        ep.forward(x, idx, w, active_ranks=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(InvalidRouting, match="num_experts"):
        ep.dispatch(x, idx, w, num_experts=E + 1)
    recv_x, counts, handle = ep.dispatch(x, idx, w)
    with pytest.raises(InvalidRouting, match="expert_out must be"):
        ep.combine(recv_x[:-1], handle)
    # The layer still works after all of that.
    assert ep.forward(x, idx, w).shape == x.shape


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="transport"):
        EPConfig(num_experts=4, num_seats=1, slots_per_rank=4, hidden=4, top_k=1, transport="tcp")
    with pytest.raises(ConfigError, match="policy"):
        EPConfig(num_experts=4, num_seats=1, slots_per_rank=4, hidden=4, top_k=1, policy="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="top_k"):
        EPConfig(num_experts=4, num_seats=1, slots_per_rank=4, hidden=4, top_k=5)
