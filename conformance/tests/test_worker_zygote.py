"""Worker processes forked from a zygote (``mooncake_conformance.worker``): the same protocol as
fresh ones, the preload done once, a fresh start when asked or when forking is unsafe."""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from mooncake_conformance import KVLayout
from mooncake_conformance import worker as worker_mod
from mooncake_conformance.harness import HarnessSpec
from mooncake_conformance.worker import Worker

# A dict-backed harness: enough of the contract to drive through a worker process.
FACTORY = textwrap.dedent(
    """
    import os, threading
    from mooncake_conformance.harness import EngineHarness

    MARK = {}

    def preload():
        MARK["preloaded_in"] = os.getpid()
        if os.environ.get("ZYGOTE_TEST_THREAD"):  # a Python thread makes forking unsafe
            threading.Thread(target=threading.Event().wait, daemon=True).start()

    class Dict(EngineHarness):
        def __init__(self, spec):
            super().__init__(spec)
            self.slots = {}
        def fill(self, slot, seed): self.slots[slot] = bytes([seed % 256]) * 16
        def read(self, slot): return self.slots.get(slot, b"")
        def page_keys(self, tokens):
            return [[f"{MARK.get('preloaded_in', 0)}/{os.getpid()}/{os.getppid()}"]]
        def save(self, tokens, slots): return 0
        def lookup(self, tokens): return 0
        def load(self, tokens, slots): return 0

    def make_harness(spec):
        return Dict(spec)
    """
)


@pytest.fixture()
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"zygote_factory_{os.getpid()}_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))
    yield f"{name}:make_harness"
    worker_mod._close_zygotes()
    sys.modules.pop(name, None)


def _spec(factory: str) -> HarnessSpec:
    return HarnessSpec(factory=factory, layout=KVLayout("dict"), master="127.0.0.1:1")


def _who(w: Worker) -> tuple[int, int, int]:
    preloaded, pid, ppid = (int(x) for x in w.call("keys", tokens=[1])[0][0].split("/"))
    return preloaded, pid, ppid


def test_workers_fork_from_one_zygote_that_preloaded_once(factory: str) -> None:
    a, b = Worker(_spec(factory)), Worker(_spec(factory))
    try:
        (pa, ida, ppa), (pb, idb, ppb) = _who(a), _who(b)
        assert ida != idb and ppa == ppb == pa == pb  # preloaded once, in their parent
        assert ppa != os.getpid()
        # the protocol works as usual: a digest of the empty slot
        assert a.call("read_digests", slots=[0]) == [hashlib.sha256(b"").hexdigest()]
        a.kill()  # a forked worker is watched through /proc: kill and wait return
        assert a.proc.poll() is not None
        assert _who(b)[1] == idb  # the other one is untouched
    finally:
        a.close()
        b.close()
    assert b.proc.wait(10) is not None


@pytest.mark.parametrize("env", [{"MOONCAKE_CONFORMANCE_ZYGOTE": "0"}, {"ZYGOTE_TEST_THREAD": "1"}])
def test_workers_start_fresh_when_asked_or_when_forking_is_unsafe(
    factory: str, env: dict[str, str]
) -> None:
    for k, v in env.items():
        os.environ[k] = v
    try:
        w = Worker(_spec(factory), env=env)
        try:
            preloaded, pid, ppid = _who(w)
            assert ppid == os.getpid() and preloaded == 0  # our own child, no preload
        finally:
            w.close()
    finally:
        for k in env:
            del os.environ[k]
