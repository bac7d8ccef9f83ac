"""Live prefill queues for the proxy's conductor: work in flight and each instance's measured speed.

The conductor predicts a request's TTFT on instance ``i`` as the wait before ``i`` can start
it plus its prefill time given the prefix ``i`` holds, both from a cost profile (seconds of
the profiled hardware). Behind a live proxy two things differ from the profile:

- the wait: the proxy knows exactly which prefills each instance is running (sent, not yet
  answered), so the wait is the profile work of those requests at the instance's speed, less
  the time it has worked on them since its last answer; an instance still busy past that
  prediction keeps at least :data:`OVERDUE_SHARE` of it (never 0 while it is busy);
- the speed: the instances are rarely the profiled hardware (the shipped profile is an
  8-GPU node; a CPU core is tens of times slower, and an instance sharing its core with
  another runs slower still). :class:`LiveQueues` measures real seconds per profile second
  from the answers: busy time (some prefill in flight) over the profile work answered, as
  decayed sums. The pooled figure of all instances starts from a prior of 1 (the profile is
  right) that the first answer outweighs; each instance's own figure starts from the pooled
  one and leaves it only after a few answers (one quick answer does not make an instance
  look faster than one that has not answered yet).

Both go into :meth:`~mooncake_core.conductor.Conductor.decide` (``wait_s``, ``speed``), so
queue and prefix gain are weighed in the same, real seconds. Without this, the profile's
queues drain tens of times faster than the instances' real ones and every decision sees idle
instances: the prefix decides alone and load never counts.

*Thread-safety*: none; the proxy calls from its event loop.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LiveQueues", "OVERDUE_SHARE"]

#: share of its predicted in-flight work an instance busy past the prediction still waits
OVERDUE_SHARE = 0.25


class LiveQueues:
    """Per prefill instance: profile work in flight and measured speed (see the module doc).

    Args:
        n: prefill instances.
        prior_speed: real seconds per profile second before any answer.
        prior_work_s: weight of that prior in the pooled figure, in profile seconds of
            answered work.
        instance_work_s: weight of the pooled figure in each instance's own (profile seconds;
            0.3 is about four 500-token prefills of the shipped profile).
        decay: weight of the past per answer (0..1; 0.9 remembers about ten answers).
    """

    def __init__(
        self,
        n: int,
        prior_speed: float = 1.0,
        prior_work_s: float = 0.02,
        instance_work_s: float = 0.3,
        decay: float = 0.9,
    ) -> None:
        if (
            n <= 0
            or prior_speed <= 0
            or prior_work_s <= 0
            or instance_work_s <= 0
            or not 0 <= decay < 1
        ):
            raise ValueError(
                "LiveQueues needs n > 0, prior_speed > 0, prior_work_s > 0, "
                "instance_work_s > 0 and 0 <= decay < 1"
            )
        self.n = n
        self.prior_speed = prior_speed
        self.prior_work_s = prior_work_s
        self.instance_work_s = instance_work_s
        self.decay = decay
        self._work: list[dict[int, float]] = [{} for _ in range(n)]
        self._mark = np.zeros(n)  # since when the instance works on what is in flight
        self._busy = np.zeros(n)  # decayed real seconds busy
        self._done = np.zeros(n)  # decayed profile seconds answered

    def speed(self) -> np.ndarray:
        """Real seconds per profile second, per instance."""
        w0, wi = self.prior_work_s, self.instance_work_s
        pooled = (float(self._busy.sum()) + self.prior_speed * w0) / (float(self._done.sum()) + w0)
        out: np.ndarray = (self._busy + pooled * wi) / (self._done + wi)
        return out

    def in_flight_s(self) -> np.ndarray:
        """Profile seconds of work in flight, per instance."""
        return np.array([sum(w.values()) for w in self._work])

    def wait_s(self, now: float) -> np.ndarray:
        """Predicted real seconds until each instance has finished what is in flight."""
        work = self.speed() * self.in_flight_s()
        out: np.ndarray = np.maximum(work - (now - self._mark), OVERDUE_SHARE * work)
        return out

    def started(self, instance: int, rid: int, work_s: float, now: float) -> None:
        """Request ``rid`` (``work_s`` profile seconds of prefill) was sent to ``instance``."""
        if not self._work[instance]:
            self._mark[instance] = now
        self._work[instance][rid] = max(float(work_s), 0.0)

    def answered(self, instance: int, rid: int, now: float) -> None:
        """``instance`` answered ``rid``'s prefill: its time since the last mark was busy."""
        w = self._work[instance].pop(rid, None)
        if w is None:
            return
        d = self.decay
        self._busy[instance] = d * self._busy[instance] + max(now - self._mark[instance], 0.0)
        self._done[instance] = d * self._done[instance] + w
        self._mark[instance] = now

    def dropped(self, instance: int, rid: int) -> None:
        """``rid`` left ``instance`` without an answer (an error): forget it, measure nothing."""
        self._work[instance].pop(rid, None)
