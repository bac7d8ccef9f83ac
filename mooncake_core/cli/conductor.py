"""``mooncake-core conductor``: cost-model tools.

- ``conductor fit --input FILE [--base PROFILE] [--output PROFILE]``: fit the prefill
  (``input_len, cached_len, prefill_s``) and/or decode (``batch, context_tokens, step_s``)
  coefficients from measurement rows (JSONL, JSON array or CSV) and print or save the
  resulting profile.
- ``conductor profile [--profile PROFILE]``: print a profile (default: the shipped one).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mooncake_core.conductor.costmodel import fit_profile, load_measurements, load_profile
from mooncake_core.errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="conductor_cmd", metavar="ACTION", required=True)
    fit = sub.add_parser(
        "fit",
        help="fit the cost model from measurements",
        description="fit the cost model from measurements",
    )
    fit.add_argument("--input", required=True, help="measurements: JSONL, JSON array or CSV")
    fit.add_argument(
        "--base", default=None, help="profile to start from (default: shipped profile)"
    )
    fit.add_argument("--output", default=None, help="write the fitted profile JSON here")
    fit.add_argument("--json", action="store_true", help="print the fit report as JSON")
    show = sub.add_parser(
        "profile", help="print a cost-model profile", description="print a cost-model profile"
    )
    show.add_argument("--profile", default=None, help="profile JSON (default: shipped profile)")


def run(args: argparse.Namespace) -> int:
    if args.conductor_cmd == "profile":
        print(json.dumps(load_profile(args.profile).to_dict(), indent=2))
        return 0
    report = fit_profile(load_measurements(args.input), load_profile(args.base))
    data = report.profile.to_dict()
    if args.output:
        try:
            Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise ConfigError(f"cannot write profile {args.output!r}: {exc}") from exc

    def err(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 6)

    if args.json:
        print(
            json.dumps(
                {
                    "prefill_samples": report.prefill_samples,
                    "decode_samples": report.decode_samples,
                    "prefill_rel_err": err(report.prefill_rel_err),
                    "decode_rel_err": err(report.decode_rel_err),
                    "profile": data,
                }
            )
        )
        return 0
    p = report.profile
    print(
        f"prefill: {report.prefill_samples} rows, mean |rel err| {report.prefill_rel_err:.3%}: "
        f"c0={p.prefill_c0:.4g} s, c1={p.prefill_c1:.4g} s/token, c2={p.prefill_c2:.4g} s/token^2"
    )
    print(
        f"decode:  {report.decode_samples} rows, mean |rel err| {report.decode_rel_err:.3%}: "
        f"a={p.decode_a:.4g} s, b={p.decode_b:.4g} s/seq, c={p.decode_c:.4g} s/token"
    )
    if args.output:
        print(f"wrote {args.output}")
    return 0
