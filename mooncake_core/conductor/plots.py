"""PNG plots of simulator results (matplotlib, Agg backend; an optional dependency).

Contract: :func:`write_plots` takes one or more :class:`~.simulator.SimResult` and writes
``ttft_cdf.png`` (TTFT CDF per run), ``hit_rate.png`` (prefix-cache hit rate over time)
and ``queue_length.png`` (queued prefill requests over time) into a directory, returning
the paths. Missing matplotlib raises :class:`~mooncake_core.errors.ConfigError` with the
install hint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mooncake_core.conductor.simulator import SimResult
from mooncake_core.errors import ConfigError

__all__ = ["write_plots"]

logger = logging.getLogger(__name__)


def _label(r: SimResult) -> str:
    return f"{r.config.policy}{' +reject' if r.config.reject else ''}"


def _binned(t: np.ndarray, v: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    ok = ~np.isnan(v)
    t, v = t[ok], v[ok]
    if not len(t):
        return np.zeros(0), np.zeros(0)
    idx = ((t - t.min()) // width).astype(np.int64)
    sums = np.bincount(idx, weights=v)
    cnt = np.bincount(idx)
    keep = cnt > 0
    centers = (np.arange(len(cnt)) + 0.5) * width
    return centers[keep], sums[keep] / cnt[keep]


def write_plots(
    results: Sequence[SimResult], outdir: str | Path, bin_s: float = 60.0
) -> list[Path]:
    """Write the three PNGs for ``results`` into ``outdir`` (created if needed).

    Raises:
        ConfigError: matplotlib is not installed or ``outdir`` is not writable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib; pip install 'mooncake-core[plot]'") from exc
    out = Path(outdir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create plot directory {str(out)!r}: {exc}") from exc
    span = max((float(r.arrivals_s[-1] - r.arrivals_s[0]) for r in results), default=0.0)
    width = bin_s if span > 10 * bin_s else max(span / 20, 1e-3)
    paths: list[Path] = []

    fig: Any
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = np.sort(r.ttft_s)
        if len(t):
            ax.plot(t, np.arange(1, len(t) + 1) / r.requests, label=_label(r))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.axvline(results[0].config.slo_ttft_s, color="grey", linestyle=":", label="TTFT SLO")
    ax.set_title("TTFT CDF (rejected requests never reach 1.0)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    for name, attr, ylabel in (
        ("hit_rate.png", "hit_frac", "prefix blocks reused (mean per bin)"),
        ("queue_length.png", "queue_len", "queued prefill requests (all instances)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            x, y = _binned(r.arrivals_s, getattr(r, attr), width)
            ax.plot(x, y, label=_label(r))
        ax.set_xlabel("time (s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    logger.info("wrote %d plots to %s", len(paths), out)
    return paths
