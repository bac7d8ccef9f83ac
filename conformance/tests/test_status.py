"""The conformance status file: merging, staleness, wording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mooncake_conformance import status


def test_status_merges_runs_and_detects_staleness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOONCAKE_CONFORMANCE_DIR", str(tmp_path))
    names = status.contract_checks()
    assert "test_layout_roundtrip_byte_for_byte" in names and len(names) >= 10
    assert status.describe("x", "mooncake_conformance").startswith("not run")
    status.write_status("x", "mooncake_conformance", {names[0]: "passed"}, {})
    assert status.describe("x", "mooncake_conformance").startswith(f"incomplete: 1 of {len(names)}")
    status.write_status("x", "mooncake_conformance", {n: "passed" for n in names[1:]}, {})
    assert status.describe("x", "mooncake_conformance").startswith(
        f"passed {len(names)} of {len(names)}"
    )
    # a skip of the same sources (the check ran in another module) keeps the pass
    status.write_status("x", "mooncake_conformance", {names[0]: "skipped"}, {names[0]: "why"})
    assert status.describe("x", "mooncake_conformance").startswith(
        f"passed {len(names)} of {len(names)}"
    )
    status.write_status("x", "mooncake_conformance", {names[0]: "failed"}, {})
    assert status.describe("x", "mooncake_conformance").startswith("FAILED 1 of")
    status.write_status("x", "mooncake_conformance", {names[0]: "passed"}, {})
    p = tmp_path / "x.json"
    data = json.loads(p.read_text())
    data["source_digest"] = "0" * 16
    p.write_text(json.dumps(data))
    assert "stale" in status.describe("x", "mooncake_conformance")
    assert status.merge_outcome("passed", "failed") == "failed"
    assert status.merge_outcome("skipped", "passed") == "passed"
    monkeypatch.setenv("MOONCAKE_CONFORMANCE_DIR", "off")
    assert status.status_dir() is None
    assert status.write_status("x", "", {}, {}) is None
