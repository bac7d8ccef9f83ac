"""Page keys and adapter registration (no SGLang import, no store)."""

from __future__ import annotations

import hashlib
import struct

import pytest
from mooncake_sglang.keys import KeyScheme, page_hashes


def test_page_hashes_follow_sglangs_chain() -> None:
    toks = list(range(10))
    got = page_hashes(toks, 4)
    d0 = hashlib.sha256(struct.pack("<4I", 0, 1, 2, 3)).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert got == [d0.hex(), d1.hex()]  # the partial third page gets no hash
    big = page_hashes([1 << 40, 1, 2, 3], 4)[0]
    assert big == hashlib.sha256(b"\xff" + struct.pack("<4Q", 1 << 40, 1, 2, 3)).hexdigest()
    with pytest.raises(ValueError, match="page_size"):
        page_hashes(toks, 0)


def _scheme(**kw: object) -> KeyScheme:
    base: dict[str, object] = dict(
        model="org/m",
        token_major=True,
        num_layers=4,
        heads=2,
        head_dim=8,
        dtype="bfloat16",
        page_size=16,
        mla=False,
    )
    base.update(kw)
    return KeyScheme(**base)  # type: ignore[arg-type]


def test_keys_carry_model_geometry_and_shard() -> None:
    a = _scheme()
    assert a.keys("ab") == [
        f"sgl/org/m/{a.geometry}/tp0of1/ab/k",
        f"sgl/org/m/{a.geometry}/tp0of1/ab/v",
    ]
    assert _scheme(mla=True, tp_rank=1, tp_size=2).keys("ab")[0].endswith("/mla/ab/kv")
    others = [
        _scheme(model="org/n"),
        _scheme(token_major=False),
        _scheme(tp_rank=1, tp_size=2),
        _scheme(dtype="float16"),
        _scheme(page_size=32),
        _scheme(pp_rank=1, pp_size=2),
        _scheme(namespace="tenant1"),
    ]
    seen = {a.prefix} | {o.prefix for o in others}
    assert len(seen) == len(others) + 1
    with pytest.raises(ValueError, match="empty page hash"):
        a.keys("")


def test_adapter_reports_conformance(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncake_conformance import status
    from mooncake_sglang import adapter

    monkeypatch.setenv("MOONCAKE_CONFORMANCE_DIR", str(tmp_path))
    assert adapter.mooncake_adapter_info().conformance.startswith("not run")
    checks = {c: "passed" for c in status.contract_checks()}
    status.write_status("sglang", "mooncake_sglang", checks, {})
    assert adapter.mooncake_adapter_info().conformance.startswith(
        f"passed {len(checks)} of {len(checks)}"
    )
    status.write_status(
        "sglang", "mooncake_sglang", {"test_hits_full_partial_and_miss": "failed"}, {}
    )
    assert adapter.mooncake_adapter_info().conformance.startswith("FAILED 1 of")
