"""Policies and the conductor's decisions on small hand-made situations."""

from __future__ import annotations

import pytest

from mooncake_core.conductor.cache import BlockIndex
from mooncake_core.conductor.costmodel import CostModel
from mooncake_core.conductor.policy import make_policy
from mooncake_core.conductor.scheduler import Conductor, ConductorConfig
from mooncake_core.conductor.trace import Request
from mooncake_core.errors import ConfigError


def req(
    rid: int, blocks: list[int], t: float = 0.0, out: int = 50, tokens: int | None = None
) -> Request:
    return Request(rid, t, tokens if tokens is not None else 512 * len(blocks), out, tuple(blocks))


def conductor(policy: str, n: int = 2, m: int = 1, **kw: object) -> Conductor:
    return Conductor(ConductorConfig(n, m, policy, **kw))  # type: ignore[arg-type]


# --- block index -------------------------------------------------------------------------


def test_index_prefix_match_per_holder() -> None:
    ix = BlockIndex(3, capacity_blocks=None, store_blocks=None)
    ix.insert(0, [1, 2, 3])
    ix.insert(1, [1, 2])
    ix.insert(3, [1, 2, 3, 4])  # the store
    ix.insert(2, [9, 2, 3])  # a different prefix: no match for chain 1, 2, ...
    lengths, union = ix.match([1, 2, 3, 4, 5])
    assert lengths.tolist() == [3, 2, 0, 4] and union == 4
    assert ix.match([7])[0].tolist() == [0, 0, 0, 0] and ix.match([7])[1] == 0
    ix.remove(0, [2])
    assert ix.match([1, 2, 3])[0].tolist()[0] == 1


def test_index_lru_evicts_chain_tails_and_demotes_to_store() -> None:
    ix = BlockIndex(1, capacity_blocks=4, store_blocks=10)
    ix.insert(0, [1, 2, 3])
    ix.insert(0, [10, 11, 12])  # over capacity: oldest = tail of the first chain
    lengths, union = ix.match([1, 2, 3])
    assert lengths.tolist() == [1, 0] and union == 3  # instance kept the prefix, store the rest
    assert ix.holds(1, 2) and ix.holds(1, 3)
    assert ix.evictions == 2 and ix.demotions == 2


# --- each policy on a situation whose best answer is known ------------------------------


def test_local_cache_goes_where_the_prefix_is() -> None:
    c = conductor("local-cache", n=3)
    c.kv_stored(2, list(range(20)))
    d = c.decide(req(0, list(range(24))))
    assert d.prefill == 2 and d.cached_blocks == 20 and d.fetch_blocks == 0


def test_least_load_ignores_the_cache() -> None:
    c = conductor("least-load", n=2)
    c.kv_stored(0, list(range(20)))
    big = c.decide(req(0, [100 + i for i in range(40)]))  # occupies instance 0
    assert big.prefill == 0
    d = c.decide(req(1, list(range(24))))
    assert d.prefill == 1 and d.cached_blocks == 0


def test_local_cache_avoids_a_long_queue_when_recompute_is_cheaper() -> None:
    c = conductor("local-cache", n=2)
    c.kv_stored(0, [1, 2])
    c.decide(req(0, [100 + i for i in range(120)]))  # instance 0 busy for many seconds
    d = c.decide(req(1, [1, 2, 3]))
    assert d.prefill == 1 and d.cached_blocks == 0


def test_global_cache_fetches_from_a_busy_holder() -> None:
    c = conductor("global-cache", n=2)
    c.kv_stored(0, list(range(60)))
    c.decide(req(0, list(range(60)) + [500 + i for i in range(80)]))  # instance 0 busy
    d = c.decide(req(1, list(range(64))))
    assert d.prefill == 1 and d.fetch_source == 0
    assert d.fetch_blocks == 60 and d.cached_blocks == 60
    cost = CostModel()
    assert d.ttft_s == pytest.approx(cost.transfer_s(60) + cost.prefill_s(64 * 512, 60 * 512))
    # local-cache in the same situation must recompute or wait: strictly worse.
    lc = conductor("local-cache", n=2)
    lc.kv_stored(0, list(range(60)))
    lc.decide(req(0, list(range(60)) + [500 + i for i in range(80)]))
    assert lc.decide(req(1, list(range(64)))).ttft_s > d.ttft_s


def test_global_cache_fetches_from_the_store() -> None:
    c = conductor("global-cache", n=2, store_blocks=None)
    c.store_put(list(range(30)))
    d = c.decide(req(0, list(range(32))))
    assert d.fetch_source == 2 and d.fetch_blocks == 30


def test_fetch_sources_store_ignores_other_instances_caches() -> None:
    # instance 0 holds 60 blocks and is busy; with fetch_sources="store" instance 1 cannot
    # read them, only what the store holds (20 blocks)
    c = conductor("global-cache", n=2, store_blocks=None, fetch_sources="store")
    c.kv_stored(0, list(range(60)))
    c.store_put(list(range(20)))
    c.decide(req(0, list(range(60)) + [500 + i for i in range(80)]))  # instance 0 busy
    d = c.decide(req(1, list(range(64))), commit=False)
    assert d.prefill == 1 and d.fetch_source == 2 and d.fetch_blocks == 20 and d.cached_blocks == 20
    c.store_removed(list(range(20)))
    d = c.decide(req(2, list(range(64))), commit=False)
    assert d.fetch_blocks == 0 and d.fetch_source == -1
    with pytest.raises(ConfigError, match="fetch_sources"):
        Conductor(ConductorConfig(1, 1, fetch_sources="peers"))


def test_global_cache_recomputes_below_the_balancing_threshold() -> None:
    c = conductor("global-cache", n=2, balance_threshold_blocks=2)
    c.kv_stored(0, [1, 2])
    c.decide(req(0, [100 + i for i in range(120)]))  # instance 0 busy
    d = c.decide(req(1, [1, 2, 3, 4]))
    assert d.prefill == 1 and d.fetch_blocks == 0 and d.cached_blocks == 0
    c.kv_stored(0, [1, 2, 3])  # now 3 blocks more than instance 1: fetch
    assert c.decide(req(2, [1, 2, 3, 4]), commit=False).fetch_blocks == 3


def test_random_is_deterministic_with_a_seed() -> None:
    def picks(seed: int) -> list[int]:
        c = conductor("random", n=8, seed=seed)
        return [c.decide(req(i, [i], t=float(i))).prefill for i in range(40)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    assert len(set(picks(7))) > 4


def test_decode_goes_to_the_least_loaded_instance() -> None:
    c = conductor("least-load", n=4, m=3)
    seen = [c.decide(req(i, [i], out=500)).decode for i in range(3)]
    assert sorted(seen) == [0, 1, 2]
    d = c.decide(req(9, [9], out=500))
    assert d.tbt_s > c.decide(req(10, [10], out=2, t=1e6), commit=False).tbt_s


def test_unknown_policy_and_bad_config() -> None:
    with pytest.raises(ConfigError, match="least-load"):
        make_policy("fastest")
    with pytest.raises(ConfigError, match="prefill"):
        ConductorConfig(0, 1).validate()
    with pytest.raises(ConfigError, match="decode"):
        Conductor(ConductorConfig(1, 0))
    with pytest.raises(ConfigError, match="slo_ttft_s"):
        Conductor(ConductorConfig(1, 1, slo_ttft_s=-1.0))
    with pytest.raises(ConfigError, match="slo_tbt_s"):
        Conductor(ConductorConfig(1, 1, slo_tbt_s=0.0))


# --- early rejection triggers exactly when the prediction exceeds the SLO ----------------


@pytest.mark.parametrize("policy", ["random", "least-load", "local-cache", "global-cache"])
def test_reject_exactly_at_the_ttft_slo(policy: str) -> None:
    def setup(slo: float) -> Conductor:
        c = conductor(policy, n=1, reject=True, slo_ttft_s=slo)
        c.decide(req(0, [100 + i for i in range(10)]))  # queue ahead of the probe
        return c

    probe = req(1, list(range(16)), t=0.5)
    predicted = setup(1e9).decide(probe, commit=False).ttft_s
    above = setup(predicted * (1 + 1e-9)).decide(probe)
    assert not above.rejected and above.ttft_s == pytest.approx(predicted)
    c = setup(predicted * (1 - 1e-9))
    below = c.decide(probe)
    assert below.rejected and "TTFT" in below.reason
    assert c.queued.tolist() == [1]  # nothing committed for the rejected request
    assert c.rejections == 1


def test_reject_exactly_at_the_tbt_slo() -> None:
    def setup(slo: float) -> Conductor:
        c = conductor("least-load", n=4, m=1, reject=True, slo_tbt_s=slo)
        for i in range(20):
            c.decide(req(i, [1000 + i] * 1, out=2000, tokens=20_000))
        return c

    probe = req(99, [5], out=300)
    predicted = setup(1e9).decide(probe, commit=False).tbt_s
    assert not setup(predicted * (1 + 1e-9)).decide(probe).rejected
    d = setup(predicted * (1 - 1e-9)).decide(probe)
    assert d.rejected and "TBT" in d.reason


def test_reject_off_never_rejects() -> None:
    c = conductor("global-cache", n=1, reject=False, slo_ttft_s=1e-6)
    assert not c.decide(req(0, list(range(10)))).rejected


def test_tbt_prediction_looks_at_decode_load_when_the_request_arrives_there() -> None:
    c = conductor("least-load", n=1, m=1)
    c.decide(req(0, [1], out=100, tokens=100_000))  # decodes for ~3 s after a long prefill
    cost = CostModel()
    # A request whose prefill ends after that decode finished sees an empty instance.
    late = c.decide(req(1, [2], out=10, tokens=512), now=1000.0, commit=False)
    a, b, cc = cost.decode_coeffs()
    assert late.tbt_s == pytest.approx(a + b + cc * (512 + 5))


def test_global_cache_holder_margin_keeps_the_longest_prefix_within_the_margin() -> None:
    """Instance 0 holds 12 of 13 blocks, instance 1 10 of them; speeds as a live proxy measures
    them. Within the margin the holder keeps the request; beyond it the minimum wins."""

    def pick(margin: float, speed: list[float], hold1: int = 10) -> int:
        c = conductor("global-cache", n=2, holder_margin=margin)
        c.kv_stored(0, list(range(1, 13)))
        c.kv_stored(1, list(range(1, 1 + hold1)))
        d = c.decide(req(0, list(range(1, 14))), speed=speed, wait_s=[0.0, 0.0], commit=False)
        assert d.fetch_blocks == 0
        return d.prefill

    # holder 3x slower: 1.3x the other's predicted TTFT
    assert pick(0.0, [3.0, 1.0]) == 1  # plain minimum
    assert pick(0.5, [3.0, 1.0]) == 0  # within the margin: the holder keeps it
    assert pick(0.5, [4.0, 1.0]) == 1  # 1.73x: beyond the margin
    assert pick(0.5, [1.0, 1.0]) == 0  # the minimum is the holder anyway
    assert pick(0.5, [3.0, 1.0], hold1=12) == 1  # equal prefixes: no holder, plain minimum
    with pytest.raises(ConfigError, match="holder_margin"):
        conductor("global-cache", holder_margin=-0.1)


def test_global_cache_holder_margin_does_not_keep_what_the_store_holds() -> None:
    """Instance 0 holds 12 of 13 blocks and is busy; instance 1 is idle and could fetch from
    the store. When the store holds the whole 12-block prefix (fetch option 0.20 s), a holder
    queued 0.15 s (0.24 s, within 1.5x) loses nothing by being left: the request goes to
    instance 1 with a 12-block fetch. When the store holds only 10 blocks (fetch option
    0.31 s), a holder queued 0.3 s (0.39 s, within 1.5x) keeps it by the margin."""

    def pick(store_n: int, wait0: float) -> tuple[int, int, int]:
        c = conductor(
            "global-cache", n=2, holder_margin=0.5, store_blocks=None, fetch_sources="store"
        )
        c.kv_stored(0, list(range(1, 13)))
        c.store_put(list(range(1, 1 + store_n)))
        d = c.decide(req(0, list(range(1, 14))), wait_s=[wait0, 0.0], commit=False)
        kept = getattr(c.policy, "kept_by_margin", -1)
        return d.prefill, d.fetch_blocks, kept

    assert pick(12, 0.15) == (1, 12, 0)  # the store holds it all: plain minimum
    assert pick(10, 0.3) == (0, 0, 1)  # 2 blocks would be lost: the margin keeps it
    assert pick(12, 0.0)[0] == 0  # an idle holder is the minimum anyway
