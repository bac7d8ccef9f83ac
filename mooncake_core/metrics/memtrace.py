"""Opt-in memory-growth tracing of a long-running process (debugging leaks).

``MOONCAKE_MEMTRACE=/path/prefix`` turns it on in any process that calls :func:`start_from_env`
(the store master does). ``tracemalloc`` then records allocations (``MOONCAKE_MEMTRACE_FRAMES``
frames each, default 8); after ``MOONCAKE_MEMTRACE_DELAY`` seconds (default 60: warm-up) a
baseline snapshot is taken, and every ``MOONCAKE_MEMTRACE_EVERY`` seconds (default 60)
``<prefix>.<pid>.txt`` is rewritten with:

- a ``total`` line: traced Python memory now and at the baseline, and the process RSS (so
  growth of RSS with a flat traced total shows allocator fragmentation, not live objects);
- the top allocation growth since the baseline, grouped by traceback;
- the object types whose live instance counts grew most (``gc.get_objects``).

tracemalloc slows allocation-heavy code two to three times: never on by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import linecache
import logging
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from mooncake_core.config import env_flag, env_str

logger = logging.getLogger(__name__)


def _status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _rss() -> int:
    return _status().get("VmRSS", 0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def malloc_stats() -> dict[str, int]:
    """glibc's view of the C heap (all arenas): bytes in use, free but held, mmapped. Python
    objects live mostly in pymalloc's own arenas, outside these figures; C libraries (gRPC,
    libuv, msgspec buffers) allocate here."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"in_use": int(m.uordblks), "free": int(m.fordblks), "mmap": int(m.hblkhd)}


def malloc_trim() -> bool:
    """Give the C heap's free pages back to the system (glibc); False where unavailable."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if fn is None:
        return False
    fn(0)
    return True


def _pymalloc_arenas() -> int:
    """Bytes in pymalloc arenas now held (256 KiB each), from ``sys._debugmallocstats``."""
    import re
    import sys
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    m = re.search(r"# arenas allocated current\s*=\s*(\d+)", text)
    return int(m.group(1)) * (1 << 18) if m else 0


_SELF = [
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, linecache.__file__),  # the report's own source lines
    tracemalloc.Filter(False, __file__),
]


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(_SELF)


def _types() -> Counter[str]:
    return Counter(type(o).__name__ for o in gc.get_objects())


class MemTrace:
    """Periodic tracemalloc snapshots diffed against a post-warm-up baseline."""

    def __init__(
        self,
        prefix: str,
        delay_s: float,
        every_s: float,
        frames: int,
        top: int = 25,
        trim: bool = False,
    ) -> None:
        self.path = Path(f"{prefix}.{os.getpid()}.txt")
        self.delay_s, self.every_s, self.frames, self.top = delay_s, every_s, frames, top
        self.trim = trim  # malloc_trim after each report; its effect is the "trimmed" column
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mc-memtrace", daemon=True)

    def start(self) -> MemTrace:
        if self.frames > 0:
            tracemalloc.start(self.frames)
        self._thread.start()
        logger.warning(
            "memtrace: %s, reports in %s",
            f"tracemalloc on ({self.frames} frames)" if self.frames > 0 else "allocator stats",
            self.path,
        )
        return self

    def stop(self) -> None:
        """Stop reporting (and tracing, if this started it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.frames > 0:
            tracemalloc.stop()

    def figures(self) -> dict[str, int]:
        """Memory figures now, in bytes (the series file's columns)."""
        st = _status()
        out = {
            "rss": st.get("VmRSS", 0),
            "anon": st.get("RssAnon", 0),
            "file": st.get("RssFile", 0),
            **{f"malloc_{k}": v for k, v in malloc_stats().items()},
        }
        if not tracemalloc.is_tracing():  # tracemalloc's hooks hide pymalloc's statistics
            out["pymalloc"] = _pymalloc_arenas()
        else:
            out["traced"] = tracemalloc.get_traced_memory()[0]
            out["tracemalloc_own"] = tracemalloc.get_tracemalloc_memory()
        return out

    def _run(self) -> None:
        t0 = time.monotonic()
        series = self.path.with_suffix(".series")
        if self._stop.wait(self.delay_s):
            return
        base = _snapshot() if tracemalloc.is_tracing() else None
        base_fig, base_types = self.figures(), _types()
        series.write_text("t_s " + " ".join(base_fig) + (" trimmed" if self.trim else "") + "\n")
        while True:
            try:
                fig = self.figures()
                if self.trim:  # how much of the anonymous RSS was free C heap held by malloc
                    malloc_trim()
                    fig["trimmed"] = fig["anon"] - _status().get("RssAnon", 0)
                with series.open("a") as f:
                    f.write(f"{time.monotonic() - t0:.0f} " + " ".join(map(str, fig.values())))
                    f.write("\n")
                self._report(t0, base, base_fig, fig, base_types)
            except Exception:  # noqa: BLE001 - a debugging aid never takes the process down
                logger.exception("memtrace: report failed")
            if self._stop.wait(self.every_s):
                return

    def _report(
        self,
        t0: float,
        base: tracemalloc.Snapshot | None,
        base_fig: dict[str, int],
        fig: dict[str, int],
        base_types: Counter[str],
    ) -> None:
        mib = 2**20
        lines = [f"t={time.monotonic() - t0:.0f}s, MiB now (change since the baseline):"]
        lines += [
            f"  {k:<16}{v / mib:9.2f} ({(v - base_fig.get(k, 0)) / mib:+.2f})"
            for k, v in fig.items()
        ]
        grown = _types()  # before the diff below adds objects of its own
        grown.subtract(base_types)
        if base is not None:
            lines += ["", "top growth by traceback since the baseline:"]
            snap = _snapshot()
            stats = sorted(snap.compare_to(base, "traceback"), key=lambda d: -d.size_diff)
            for st in stats[: self.top]:
                if st.size_diff <= 0:
                    break
                lines.append(f"{st.size_diff / 1024:+.1f} KiB, {st.count_diff:+d} blocks")
                lines += [f"    {ln}" for ln in st.traceback.format()[-self.frames * 2 :]]
            del stats, snap
        lines += ["", "object types with the largest count growth:"]
        for name, n in grown.most_common(self.top):
            if n <= 0:
                break
            lines.append(f"  {n:+d} {name}")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)


def start_from_env() -> MemTrace | None:
    """Start a :class:`MemTrace` when ``MOONCAKE_MEMTRACE`` is set; None otherwise."""
    prefix = env_str("MOONCAKE_MEMTRACE")
    if not prefix:
        return None
    return MemTrace(
        prefix,
        float(env_str("MOONCAKE_MEMTRACE_DELAY", "60")),
        float(env_str("MOONCAKE_MEMTRACE_EVERY", "60")),
        int(env_str("MOONCAKE_MEMTRACE_FRAMES", "8")),
        trim=env_flag("MOONCAKE_MEMTRACE_TRIM"),
    ).start()


def start_heap_trimmer(every_s: float | None = None) -> threading.Thread | None:
    """Return the C heap's free pages to the system every ``every_s`` seconds (glibc).

    A long-running master's C heap (several malloc arenas: the event loop, the executor's etcd
    calls, the etcd client's thread) keeps freed chunks and their pages: in the soak its
    anonymous RSS rose about 0.2 MiB a minute while live memory (malloc's bytes in use and
    pymalloc's arenas) stayed flat. ``malloc_trim(0)`` hands those pages back. Default every
    30 s; ``MOONCAKE_MALLOC_TRIM_S=0`` turns it off. None when off or not glibc.
    """
    if every_s is None:
        every_s = float(env_str("MOONCAKE_MALLOC_TRIM_S", "30"))
    libc = _libc()
    if every_s <= 0 or libc is None or getattr(libc, "malloc_trim", None) is None:
        return None
    period = every_s

    def loop() -> None:
        while True:
            time.sleep(period)
            malloc_trim()

    t = threading.Thread(target=loop, name="mc-malloc-trim", daemon=True)
    t.start()
    return t
