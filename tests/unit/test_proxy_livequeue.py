"""The proxy's conductor weighs live queues against prefixes in real seconds (no engines)."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_core.proxy import Instance, Job, make_policy
from mooncake_core.proxy.livequeue import OVERDUE_SHARE, LiveQueues
from mooncake_core.proxy.policy import GlobalCachePolicy, prefix_blocks


def test_speed_is_measured_from_answers_and_waits_drain() -> None:
    q = LiveQueues(2, prior_speed=1.0, prior_work_s=0.02, instance_work_s=0.3)
    assert np.allclose(q.speed(), [1.0, 1.0]) and np.allclose(q.wait_s(0.0), [0.0, 0.0])
    # instance 0 answers 0.1 profile seconds of work after 2 real seconds: about 20x slower
    q.started(0, 1, 0.1, now=0.0)
    q.answered(0, 1, now=2.0)
    k = q.speed()
    assert 15 < k[0] < 20  # the prior (1.0, weight 0.02) is outweighed
    assert 15 < k[1] < k[0]  # no answers yet: the pooled figure, a bit below the measured one
    # two requests in flight: the wait is their work at the measured speed, less time worked
    q.started(0, 2, 0.1, now=10.0)
    q.started(0, 3, 0.1, now=10.5)
    assert q.wait_s(10.0)[0] == pytest.approx(0.2 * k[0])
    assert q.wait_s(11.0)[0] == pytest.approx(0.2 * k[0] - 1.0)
    # busy past the prediction: still a share of it (the instance has not answered)
    assert q.wait_s(100.0)[0] == pytest.approx(OVERDUE_SHARE * 0.2 * k[0])
    assert q.wait_s(11.0)[1] == 0.0
    q.dropped(0, 2)  # a failed request leaves the queue and measures nothing
    assert q.in_flight_s()[0] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        LiveQueues(0)


def _policy(live: bool = True, n: int = 2) -> tuple[GlobalCachePolicy, list[float]]:
    p = [Instance(f"http://p{i}", "prefill", i) for i in range(n)]
    d = [Instance("http://d0", "decode", 0)]
    pol = make_policy("global-cache", p, d, live_queues=live)
    assert isinstance(pol, GlobalCachePolicy)
    clock = [0.0]
    pol._now = lambda: clock[0]  # type: ignore[method-assign]
    return pol, clock


def _serve(
    pol: GlobalCachePolicy, rid: int, prompt: list[int], clock: list[float], s: float
) -> int:
    """Route one request and answer its prefill ``s`` real seconds later; its instance."""
    job = Job(rid, len(prompt), prompt, 2)
    place = pol.choose(job)
    clock[0] += s
    pol.prefill_done(job, place)
    pol.finished(job, place, True)
    return place.prefill.index


def test_a_busy_holder_loses_to_an_idle_instance_once_the_wait_outweighs_the_prefix() -> None:
    pol, clock = _policy()
    conv = list(range(3, 3 + 15 * 32))  # 15 blocks
    # calibrate: instance 0 computes the conversation in 1.5 real s (CPU-slow vs the profile)
    holder = _serve(pol, 1, conv + [7] * 10, clock, 1.5)
    assert pol.live.speed()[holder] > 10
    # the follow-up turn goes to the holder while it is idle
    clock[0] += 1.0
    assert _serve(pol, 2, conv + [8] * 10, clock, 0.1) == holder
    # the holder now has three long cold prompts in flight (seconds of work at its speed)
    jobs = []
    for rid in (3, 4, 5):
        cold = [100 + rid] * 480
        job = Job(rid, len(cold), cold, 2)
        place = pol.choose(job)
        jobs.append((job, place))
    on_holder = [pl for _, pl in jobs if pl.prefill.index == holder]
    assert on_holder, "expected some of the cold prompts on the holder"
    for job, place in jobs:
        if place.prefill.index != holder:
            pol.prefill_done(job, place)
            pol.finished(job, place, True)
    wait = pol.live.wait_s(clock[0])
    assert wait[holder] > 0.5 and wait[1 - holder] == 0.0
    # the next turn: recomputing 15 blocks elsewhere beats waiting seconds behind the queue
    job = Job(6, len(conv) + 10, conv + [9] * 10, 2)
    place = pol.choose(job)
    assert place.prefill.index == 1 - holder
    assert job.log["local"][holder] == 15 and job.log["local"][1 - holder] == 0
    assert job.log["wait_s"][holder] > 0.5


def test_profile_queues_ignore_the_real_wait() -> None:
    """The old mode (the conductor's own queue, in profile seconds) sticks to a busy holder:
    that is the bug the live queues fix, and the decision log shows it (wait 0 everywhere)."""
    pol, clock = _policy(live=False)
    conv = list(range(3, 3 + 15 * 32))
    holder = _serve(pol, 1, conv + [7] * 10, clock, 1.5)
    for rid in (3, 4, 5):  # three cold prompts in flight on the holder, seconds of real work
        pol.live.started(holder, rid, 0.1, clock[0])
    clock[0] += 0.5
    job = Job(6, len(conv) + 10, conv + [9] * 10, 2)
    assert pol.choose(job).prefill.index == holder
    assert job.log["wait_s"] == [0.0, 0.0]


def _measure(pol: GlobalCachePolicy, slow: float, answers: int = 8) -> None:
    """Both instances answer ``answers`` prefills of 0.1 profile seconds: instance 1 in 2 real
    seconds each, instance 0 in ``2 * slow``."""
    t = 0.0
    for k in range(answers):
        for i, s in ((0, 2.0 * slow), (1, 2.0)):
            pol.live.started(i, 1000 * i + k, 0.1, t)
            pol.live.answered(i, 1000 * i + k, t + s)
        t += 10.0


def _holder_case(slow: float, margin: float | None = None) -> tuple[GlobalCachePolicy, int]:
    """The CI failure of test_kv_events_reveal_prefixes_the_proxy_did_not_route: KV events say
    instance 0 holds 12 leading blocks of a 13-block prompt and instance 1 holds 10 of them
    (a shared prefix); both idle; instance 0 measured ``slow`` times slower. Returns the
    policy and the instance chosen."""
    p = [Instance(f"http://p{i}", "prefill", i) for i in range(2)]
    d = [Instance("http://d0", "decode", 0)]
    opts = {} if margin is None else {"holder_margin": margin}
    pol = make_policy("global-cache", p, d, **opts)
    assert isinstance(pol, GlobalCachePolicy)
    pol._now = lambda: 100.0  # type: ignore[method-assign]
    _measure(pol, slow)
    prompt = list(range(5, 5 + 13 * 32))
    blocks = list(prefix_blocks(prompt, 32))
    pol._kv_stored(0, blocks[:12])
    pol._kv_stored(1, blocks[:10])
    job = Job(1, len(prompt), prompt, 2)
    place = pol.choose(job)
    assert job.log["local"] == [12, 10] and job.log["wait_s"] == [0.0, 0.0]
    return pol, place.prefill.index


def test_an_idle_holder_keeps_its_prefix_against_speed_noise() -> None:
    """A holder measured a little slower (noise between like instances) keeps the request;
    the plain minimum (margin 0, the rule before) sent it to the other instance."""
    pol, chosen = _holder_case(slow=1.4)
    k = pol.live.speed()
    assert 1.15 < k[0] / k[1] < 1.5  # measured slower by more than 2 blocks of 13 save
    assert chosen == 0 and pol.stats()["kept_by_margin"] == 1
    assert _holder_case(slow=1.4, margin=0.0)[1] == 1  # the old rule: away from the holder


def test_a_holder_clearly_slower_than_the_margin_still_loses() -> None:
    pol, chosen = _holder_case(slow=5.0)
    k = pol.live.speed()
    assert k[0] / k[1] > 2.0
    assert chosen == 1 and pol.stats()["kept_by_margin"] == 0
