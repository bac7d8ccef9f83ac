"""RSS analysis and the plot of ``mooncake-core bench soak``.

A *series* is one process incarnation: a label (``worker0``, ``store-victim#2``, ``master-a``),
when it started and its samples ``(t, rss, anon, shmem)`` (seconds since the load began,
bytes). Growth is judged only after warm-up: from ``max(warm_end, start + warm/2)`` on, the
median RSS of the first 15 % of the samples (the baseline) against that of the last 15 %.
The RSS judged is the process's own memory, ``VmRSS - RssShmem``: the segments are shared
memory (the own one pre-faulted, so constant; a peer's is mapped on first use and unmapped when
the peer dies, a step of the victim's segment size each time it dies or comes back). Mappings of
dead peers that were never dropped are caught separately: shared RSS may not end more than one
victim segment above where it began.
A series is judged when that window spans at least ``min_span`` seconds (a store node
restarted every few minutes, or a master killed early, is shown but not judged).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Series:
    label: str
    role: str  # worker | store | master | etcd
    start: float
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    ended: float | None = None


def growth(s: Series, warm_end: float, warm: float, min_span: float) -> dict[str, Any] | None:
    """The series' growth after warm-up, or None when its window is too short to judge."""
    begin = max(warm_end, s.start + warm / 2)
    pts = [p for p in s.samples if p[0] >= begin]
    if len(pts) < 6 or pts[-1][0] - pts[0][0] < min_span:
        return None
    k = max(3, len(pts) * 15 // 100)

    def med(part: list[tuple[float, int, int, int]], f: Any) -> float:
        return float(statistics.median(f(p) for p in part))

    base, last = med(pts[:k], _private), med(pts[-k:], _private)
    shm_base, shm_last = med(pts[:k], lambda p: p[3]), med(pts[-k:], lambda p: p[3])
    return {
        "label": s.label,
        "from_s": round(pts[0][0], 1),
        "to_s": round(pts[-1][0], 1),
        "rss_mib_start": round(base / 2**20, 1),
        "rss_mib_end": round(last / 2**20, 1),
        "growth_pct": round((last - base) / base * 100, 2) if base else 0.0,
        "shm_mib_start": round(shm_base / 2**20, 1),
        "shm_mib_end": round(shm_last / 2**20, 1),
    }


def _private(p: tuple[float, int, int, int]) -> int:
    """RSS less the shared-memory pages (segments: the own one is constant, pre-faulted; those
    mapped from peers come and go with the victim node): what a leak in the process grows."""
    return p[1] - p[3]


def plot(
    series: list[Series],
    events: list[tuple[float, str]],
    warm_end: float,
    path: str,
    title: str,
) -> str | None:
    """Write the RSS-over-time PNG; returns its path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    roles = ["worker", "store", "master"]
    fig, axes = plt.subplots(len(roles), 1, figsize=(9, 8), sharex=True)
    for ax, role in zip(axes, roles, strict=True):
        for s in series:
            if s.role != role or not s.samples:
                continue
            xs = [p[0] / 60 for p in s.samples]
            ys = [_private(p) / 2**20 for p in s.samples]
            ax.plot(xs, ys, linewidth=1, label=s.label)
        ax.axvline(warm_end / 60, color="grey", linestyle=":", linewidth=1)
        for t, what in events:
            ax.axvline(t / 60, color="red" if "master" in what else "orange", alpha=0.3, lw=0.8)
        ax.set_ylabel(f"{role}: own RSS, MiB")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles and len(handles) <= 8:
            ax.legend(fontsize=7, loc="lower right", ncol=2)
    axes[-1].set_xlabel("minutes (dotted: end of warm-up; orange: store node killed; red: leader)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path
