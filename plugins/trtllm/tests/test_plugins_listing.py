"""``mooncake-core plugins`` shows a clear conformance verdict per adapter."""

from __future__ import annotations

import argparse
import json

import pytest

from mooncake_core.cli.plugins_cmd import VERDICTS, conformance_verdict, run


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("passed 13 of 13 checks (suite 0.1.0, 2026-12-01)", "PASS"),
        ("passed 11 of 13 checks, 2 skipped (suite 0.1.0, 2026-12-01)", "PASS"),
        ("passed 13 of 13 checks (suite 0.1.0, 2026-12-01); stale: adapter changed since", "STALE"),
        ("passed 13 of 13 checks (suite 0.0.9, 2026-11-01); suite changed since", "STALE"),
        ("FAILED 2 of 13 checks (test_a, test_b) (suite 0.1.0, 2026-12-01)", "FAIL"),
        ("incomplete: 9 of 13 checks passed, 4 not run (suite 0.1.0, 2026-12-01)", "INCOMPLETE"),
        ("not run (run the adapter's tests with mooncake-conformance installed)", "NOT RUN"),
        ("unknown (mooncake-conformance is not installed)", "NOT RUN"),
        ("not yet run", "NOT RUN"),
    ],
)
def test_verdict_of_each_conformance_text(text: str, verdict: str) -> None:
    assert conformance_verdict(text) == verdict
    assert verdict in VERDICTS


def test_listing_leads_with_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argparse.Namespace(json=True)) == 0
    ads = {a["name"]: a for a in json.loads(capsys.readouterr().out.splitlines()[-1])["adapters"]}
    assert "trtllm" in ads
    for a in ads.values():
        assert a["conformance_verdict"] == conformance_verdict(a["conformance"])
        assert a["passes_conformance"] == (a["conformance_verdict"] == "PASS")
    assert "skeleton" not in ads["trtllm"]["status"]
    assert run(argparse.Namespace(json=False)) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.split()[:1] == ["trtllm"])
    assert row.split()[1] == ads["trtllm"]["conformance_verdict"].split()[0]
    assert "conformance suite:" in text and "adapters pass" in text
