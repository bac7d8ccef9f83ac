"""Cost model of the conductor: prefill time, KV transfer time and decode step time.

Contract:

- :class:`CostProfile` is a frozen set of coefficients. The shipped default
  (:data:`DEFAULT_PROFILE`) describes one 8 x A800-80GB node serving a LLaMA-70B-class
  model (80 layers, hidden 8192, grouped-query attention with 8 KV heads, bf16) at 8-way
  tensor parallelism, with 512-token KV blocks. How each number was derived is written
  next to it, so it can be checked and replaced.
- :class:`CostModel` evaluates the profile:

  * ``prefill_s(n, p)``: time to prefill a prompt of ``n`` tokens when the first ``p``
    tokens' KV is already on the instance. ``c0 + c1 * (n - p) + c2 * (n**2 - p**2)``: a
    fixed launch cost, the linear (weights) part for the new tokens and the attention
    part, in which new token ``i`` attends to ``i`` earlier tokens (summing to
    ``(n**2 - p**2) / 2``; the 1/2 is folded into ``c2``).
  * ``transfer_s(blocks)``: time to pull KV blocks from another instance or the store,
    ``latency + bytes / bandwidth``.
  * ``decode_step_s(batch, context_tokens)``: one decode iteration,
    ``a + b * batch + c * context_tokens`` (weights read once per step, per-sequence
    compute, KV read proportional to the batch's total context).

- :func:`fit_profile` fits ``c0, c1, c2`` and/or ``a, b, c`` by non-negative least squares
  from measurements (``mooncake-core conductor fit``).

Profiles are stored as flat JSON objects whose keys are the field names of
:class:`CostProfile`; unknown keys are a :class:`~mooncake_core.errors.ConfigError`.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mooncake_core.errors import ConfigError

__all__ = [
    "CostProfile",
    "CostModel",
    "DEFAULT_PROFILE",
    "FitReport",
    "fit_profile",
    "load_profile",
    "load_measurements",
]

logger = logging.getLogger(__name__)

# --- derivation of the shipped defaults --------------------------------------------------
# Model: LLaMA-70B-class, 70e9 parameters, 80 layers, d_model 8192, 8 KV heads x 128 dims.
# Node: 8 x A800-80GB, 312 TFLOP/s dense bf16 each, HBM ~2.0 TB/s each, 4 x 200 Gbps RDMA.
_PEAK_FLOPS = 8 * 312e12
_PREFILL_MFU = 0.5  # typical for long-prompt prefill at TP8
_EFFECTIVE_FLOPS = _PEAK_FLOPS * _PREFILL_MFU  # 1.25e15 FLOP/s
_LINEAR_FLOPS_PER_TOKEN = 2 * 70e9  # one multiply-add per weight per token
# Attention: QK^T and PV are 2 * d_model FLOPs each per (query, key) pair and layer;
# causal prefill has (n^2 - p^2) / 2 new pairs, so FLOPs = 4 * d * L * (n^2 - p^2) / 2.
_ATTN_FLOPS_PER_PAIR = 4 * 8192 * 80
_KV_BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 2  # layers * (K, V) * kv_heads * head_dim * bf16
_HBM_BYTES_PER_S = 8 * 2.0e12 * 0.7  # 70 % of peak HBM bandwidth in decode kernels


@dataclass(frozen=True)
class CostProfile:
    """Coefficients of the cost model (seconds, tokens, bytes).

    Attributes:
        name: Free-form label printed in reports.
        block_tokens: Tokens per KV block (the trace's hash granularity).
        prefill_c0: Fixed cost per prefill (s).
        prefill_c1: Seconds per new (uncached) prompt token.
        prefill_c2: Seconds per (n**2 - p**2) unit of attention work.
        kv_bytes_per_token: KV-cache bytes per token over all layers.
        transfer_gbps: Effective bandwidth of one KV fetch into an instance (GB/s, 1e9).
        transfer_latency_s: Fixed cost of starting one fetch (s).
        handoff_fraction: Share of the prompt's KV transfer to the decode instance that
            is not hidden behind the layer-wise prefill (0 = fully overlapped).
        decode_a: Decode step cost independent of the batch (s).
        decode_b: Decode step cost per sequence in the batch (s).
        decode_c: Decode step cost per token of context in the batch (s).
        decode_kv_tokens: KV tokens one decode instance can hold (HBM minus weights).
    """

    name: str = "a800x8-llama70b-tp8"
    block_tokens: int = 512
    prefill_c0: float = 0.03
    prefill_c1: float = _LINEAR_FLOPS_PER_TOKEN / _EFFECTIVE_FLOPS  # 1.12e-4 s/token
    prefill_c2: float = _ATTN_FLOPS_PER_PAIR / 2 / _EFFECTIVE_FLOPS  # 1.05e-9 s/token^2
    kv_bytes_per_token: int = _KV_BYTES_PER_TOKEN  # 327,680 B (160 MiB per 512-token block)
    transfer_gbps: float = 20.0  # a quarter of the 87 GB/s the Transfer Engine reaches
    transfer_latency_s: float = 0.005
    handoff_fraction: float = 0.1
    decode_a: float = 140e9 / _HBM_BYTES_PER_S + 0.012  # weight read + TP/kernel overhead
    decode_b: float = 0.0002
    decode_c: float = _KV_BYTES_PER_TOKEN / _HBM_BYTES_PER_S  # 2.9e-8 s/token
    decode_kv_tokens: int = 1_300_000  # (640 GB - 140 GB weights - activations) / 320 KiB

    def validate(self) -> None:
        """Raise ConfigError if a coefficient is out of range."""
        if self.block_tokens <= 0:
            raise ConfigError(f"cost profile block_tokens must be > 0, got {self.block_tokens}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and (not math.isfinite(v) or v < 0):
                raise ConfigError(f"cost profile {f.name} must be finite and >= 0, got {v!r}")
        if self.transfer_gbps <= 0:
            raise ConfigError("cost profile transfer_gbps must be > 0")
        if self.prefill_c1 <= 0 and self.prefill_c2 <= 0:
            raise ConfigError("cost profile needs prefill_c1 or prefill_c2 > 0")
        if self.handoff_fraction > 1:
            raise ConfigError("cost profile handoff_fraction must be within [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        """Return the profile as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: CostProfile | None = None) -> CostProfile:
        """Build a profile from ``data``; missing keys come from ``base`` (or defaults).

        Raises:
            ConfigError: on an unknown key (naming the closest valid one) or a bad value.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown cost profile key {key!r}{hint}")
        kwargs = dict(data)
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.name != "name":
                try:
                    kwargs[f.name] = (
                        int(kwargs[f.name]) if f.type == "int" else float(kwargs[f.name])
                    )
                except (TypeError, ValueError) as exc:
                    raise ConfigError(
                        f"cost profile {f.name} must be a number, got {kwargs[f.name]!r}"
                    ) from exc
        prof = dataclasses.replace(base or cls(), **kwargs)
        prof.validate()
        return prof


DEFAULT_PROFILE = CostProfile()


def load_profile(path: str | Path | None) -> CostProfile:
    """Load a JSON profile (missing keys default); ``None`` returns the shipped default.

    Raises:
        ConfigError: the file is missing, not JSON, or holds invalid keys/values.
    """
    if path is None:
        return DEFAULT_PROFILE
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"cost profile {str(p)!r} not found; write one with `mooncake-core conductor fit`"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cost profile {str(p)!r} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"cost profile {str(p)!r} must be a JSON object")
    return CostProfile.from_dict(data)


class CostModel:
    """Evaluate a :class:`CostProfile`; all methods are pure and cheap.

    Thread-safety: immutable, safe to share.
    """

    __slots__ = (
        "profile",
        "_c0",
        "_c1",
        "_c2",
        "_bt",
        "_blk_bytes",
        "_bw",
        "_lat",
        "_a",
        "_b",
        "_c",
    )

    def __init__(self, profile: CostProfile = DEFAULT_PROFILE) -> None:
        profile.validate()
        self.profile = profile
        self._c0 = profile.prefill_c0
        self._c1 = profile.prefill_c1
        self._c2 = profile.prefill_c2
        self._bt = profile.block_tokens
        self._blk_bytes = float(profile.block_tokens * profile.kv_bytes_per_token)
        self._bw = profile.transfer_gbps * 1e9
        self._lat = profile.transfer_latency_s
        self._a = profile.decode_a
        self._b = profile.decode_b
        self._c = profile.decode_c

    @property
    def block_tokens(self) -> int:
        """Tokens per KV block."""
        return self._bt

    def prefill_s(self, n: int, p: int = 0) -> float:
        """Seconds to prefill ``n`` prompt tokens of which the first ``p`` are cached.

        At least one token is always computed (the one that yields the first output).
        """
        p = min(max(p, 0), max(n - 1, 0))
        return self._c0 + self._c1 * (n - p) + self._c2 * (n * n - p * p)

    def prefill_s_array(self, n: int, p: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`prefill_s` over an array of cached lengths."""
        pc = np.minimum(np.maximum(p, 0), max(n - 1, 0)).astype(np.float64)
        out: np.ndarray = self._c0 + self._c1 * (n - pc) + self._c2 * (float(n) * n - pc * pc)
        return out

    def transfer_s(self, blocks: int) -> float:
        """Seconds to fetch ``blocks`` KV blocks from a remote holder (0 for none)."""
        if blocks <= 0:
            return 0.0
        return self._lat + blocks * self._blk_bytes / self._bw

    def handoff_s(self, tokens: int) -> float:
        """Seconds between prefill end and decode start (unhidden KV handoff)."""
        return (
            self._lat
            + self.profile.handoff_fraction * tokens * self.profile.kv_bytes_per_token / self._bw
        )

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode iteration over ``batch`` sequences."""
        return self._a + self._b * batch + self._c * context_tokens

    def decode_coeffs(self) -> tuple[float, float, float]:
        """Return ``(a, b, c)`` of the decode step model."""
        return self._a, self._b, self._c


# --- fitting ----------------------------------------------------------------------------

_PREFILL_ALIASES = {
    "input_len": ("input_len", "input_length", "prompt_len", "prompt_tokens", "n"),
    "cached_len": ("cached_len", "cached_tokens", "prefix_len", "p"),
    "prefill_s": ("prefill_s", "prefill_time_s", "ttft_s", "seconds"),
}
_DECODE_ALIASES = {
    "batch": ("batch", "batch_size"),
    "context_tokens": ("context_tokens", "context_len", "kv_tokens"),
    "step_s": ("step_s", "tbt_s", "itl_s"),
}


@dataclass(frozen=True)
class FitReport:
    """Result of :func:`fit_profile`.

    Attributes:
        profile: The fitted profile (unfitted fields come from the base profile).
        prefill_samples: Number of prefill rows used.
        decode_samples: Number of decode rows used.
        prefill_rel_err: Mean absolute relative error of the prefill fit (NaN if unfitted).
        decode_rel_err: Mean absolute relative error of the decode fit (NaN if unfitted).
    """

    profile: CostProfile
    prefill_samples: int
    decode_samples: int
    prefill_rel_err: float
    decode_rel_err: float


def _pick(row: Mapping[str, Any], names: Sequence[str]) -> float | None:
    for n in names:
        if n in row and row[n] not in (None, ""):
            return float(row[n])
    return None


def load_measurements(path: str | Path) -> list[dict[str, Any]]:
    """Read measurement rows from a JSONL, JSON-array or CSV file.

    Raises:
        ConfigError: the file is missing or a line is not valid (with its line number).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"measurements file {str(p)!r} is not readable: {exc}") from exc
    rows: list[dict[str, Any]] = []
    if p.suffix.lower() == ".csv":
        for r in csv.DictReader(text.splitlines()):
            rows.append(dict(r))
        return rows
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}: not valid JSON: {exc}") from exc
        return [dict(r) for r in data if isinstance(r, dict)]
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{p}:{lineno}: expected a JSON object")
        rows.append(obj)
    return rows


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active-set by elimination)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_profile(
    rows: Iterable[Mapping[str, Any]], base: CostProfile = DEFAULT_PROFILE
) -> FitReport:
    """Fit prefill and/or decode coefficients from measurement rows.

    Prefill rows carry ``input_len``, ``cached_len`` (optional, default 0) and
    ``prefill_s``; decode rows carry ``batch``, ``context_tokens`` and ``step_s``
    (common aliases are accepted). Coefficients are fitted by relative (weighted) least
    squares and kept non-negative; a part with fewer than 3 rows keeps ``base``'s values.

    Raises:
        ConfigError: no usable row at all.
    """
    pre: list[tuple[float, float, float]] = []
    dec: list[tuple[float, float, float]] = []
    for row in rows:
        n = _pick(row, _PREFILL_ALIASES["input_len"])
        t = _pick(row, _PREFILL_ALIASES["prefill_s"])
        if n is not None and t is not None and t > 0:
            cached = _pick(row, _PREFILL_ALIASES["cached_len"]) or 0.0
            pre.append((n, min(cached, n), t))
            continue
        b = _pick(row, _DECODE_ALIASES["batch"])
        ctx = _pick(row, _DECODE_ALIASES["context_tokens"])
        s = _pick(row, _DECODE_ALIASES["step_s"])
        if b is not None and ctx is not None and s is not None and s > 0:
            dec.append((b, ctx, s))
    if not pre and not dec:
        raise ConfigError(
            "no usable measurement rows: need prefill rows (input_len, cached_len, prefill_s) "
            "or decode rows (batch, context_tokens, step_s)"
        )
    changes: dict[str, Any] = {"name": f"{base.name}+fitted"}
    pre_err = dec_err = float("nan")
    if len(pre) >= 3:
        arr = np.array(pre)
        na, pa, ta = arr[:, 0], arr[:, 1], arr[:, 2]
        x = np.column_stack([np.ones_like(na), na - pa, na * na - pa * pa]) / ta[:, None]
        coef = _nnls(x, np.ones_like(ta))
        changes.update(
            prefill_c0=float(coef[0]), prefill_c1=float(coef[1]), prefill_c2=float(coef[2])
        )
        pred = coef[0] + coef[1] * (na - pa) + coef[2] * (na * na - pa * pa)
        pre_err = float(np.mean(np.abs(pred - ta) / ta))
    elif pre:
        logger.warning("only %d prefill rows; keeping the base prefill coefficients", len(pre))
    if len(dec) >= 3:
        arr = np.array(dec)
        ba, ca, sa = arr[:, 0], arr[:, 1], arr[:, 2]
        x = np.column_stack([np.ones_like(ba), ba, ca]) / sa[:, None]
        coef = _nnls(x, np.ones_like(sa))
        changes.update(decode_a=float(coef[0]), decode_b=float(coef[1]), decode_c=float(coef[2]))
        pred = coef[0] + coef[1] * ba + coef[2] * ca
        dec_err = float(np.mean(np.abs(pred - sa) / sa))
    elif dec:
        logger.warning("only %d decode rows; keeping the base decode coefficients", len(dec))
    prof = dataclasses.replace(base, **changes)
    prof.validate()
    return FitReport(prof, len(pre), len(dec), pre_err, dec_err)
