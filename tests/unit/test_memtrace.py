"""The opt-in memory tracer (``MOONCAKE_MEMTRACE``) and the master's heap trimmer: what the
soak's leak hunt relied on reports real growth, and the trimmer runs."""

from __future__ import annotations

import time
from pathlib import Path

from mooncake_core.metrics import memtrace


def _wait(path: Path, lines: int, timeout: float = 20.0) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and len(got := path.read_text().splitlines()) >= lines:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{path} has fewer than {lines} lines after {timeout}s")


def test_report_names_the_allocation_that_grew(tmp_path: Path) -> None:
    mt = memtrace.MemTrace(str(tmp_path / "mt"), delay_s=0.0, every_s=0.2, frames=2, top=5)
    kept: list[bytes] = []
    mt.start()
    try:
        _wait(mt.path.with_suffix(".series"), 2)  # the baseline is taken
        kept.extend(bytes(1000) + bytes([i % 256]) for i in range(2000))  # about 2 MiB
        end, first = time.monotonic() + 30, 0.0
        while time.monotonic() < end and first < 1500:
            time.sleep(0.05)
            report = mt.path.read_text() if mt.path.exists() else ""
            head, _, rest = report.partition("top growth by traceback since the baseline:\n")
            if rest:
                first = float(rest.split()[0])  # KiB of the largest growth
        series = _wait(mt.path.with_suffix(".series"), 3)
    finally:
        mt.stop()
    assert first > 1500, report[:2000]  # our 2000 kept blocks
    assert "test_memtrace.py" in rest.split("object types")[0]
    assert series[0].split()[:4] == ["t_s", "rss", "anon", "file"]
    assert "traced" in series[0].split() and "malloc_in_use" in series[0].split()
    assert len(kept) == 2000


def test_allocator_mode_and_trim_columns(tmp_path: Path) -> None:
    mt = memtrace.MemTrace(str(tmp_path / "mt"), delay_s=0.0, every_s=0.1, frames=0, trim=True)
    mt.start()
    try:
        series = _wait(mt.path.with_suffix(".series"), 3)
    finally:
        mt.stop()
    head = series[0].split()
    assert "pymalloc" in head and head[-1] == "trimmed" and "traced" not in head
    row = [int(x) for x in series[-1].split()]
    assert len(row) == len(head)
    assert row[head.index("anon")] > 0 and row[head.index("malloc_in_use")] > 0


def test_heap_trimmer() -> None:
    assert memtrace.start_heap_trimmer(0) is None
    t = memtrace.start_heap_trimmer(0.05)
    assert t is not None and t.is_alive() and t.daemon
    assert memtrace.malloc_trim() is True
