"""Test-only fault injection: a write-corrupting transport, and plugins for child processes.

Nothing in ``mooncake_core`` or in an adapter imports this module or knows of it: a test
installs it, in its own process or in the child processes it starts, through the plugin
mechanisms the runtime already has.

- :class:`CorruptWrites` is a pluggy plugin (project ``mooncake``) whose
  ``mooncake_transports`` hook *wraps* the other plugins' answer: the ``tcp`` and ``shm``
  transports it builds deliver zeros instead of the caller's bytes for every write, while
  :attr:`CorruptWrites.enabled` is true. Planning, slicing, the wire protocol, failover and
  completion are the real engine's; only the bytes that reach the peer change. A test that
  compares what the peer received with what was sent must therefore see the damage.

  - In a process the test controls: :func:`install_corrupt_writes` before the transfer
    engine starts (an engine picks its transports in ``TransferEngine.start()``), then
    ``with plugin.switched_on(): ...`` around the writes to damage.
  - In a child process (an engine server): start it with :func:`corrupt_writes_env` in
    its environment (:func:`entry_point_dir` with :data:`CORRUPT_WRITES_ENTRY_POINT`, on
    the child's ``PYTHONPATH``); every write of that child is corrupted.

- :func:`entry_point_dir` writes a minimal ``*.dist-info`` that declares entry points. On a
  child's ``PYTHONPATH`` it is found by ``importlib.metadata`` like any installed
  distribution, so the child loads the test plugin through the same entry-point groups real
  plugins use (``mooncake_core.transports``, ``vllm.general_plugins``, ...), and only that
  child does: nothing is installed into the environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

from mooncake_core.config import env_str
from mooncake_core.plugins import TransportInfo, get_plugin_manager, hookimpl
from mooncake_core.transfer.transports.base import WRITE

__all__ = [
    "CORRUPT_ALL_WRITES",
    "CORRUPT_WRITES_ENTRY_POINT",
    "CORRUPT_WRITES_PLUGIN",
    "CorruptWrites",
    "corrupt_writes_env",
    "entry_point_dir",
    "install_corrupt_writes",
    "pythonpath",
]

logger = logging.getLogger(__name__)

#: Name the plugin is registered under (pluggy plugin name and entry-point name).
CORRUPT_WRITES_PLUGIN = "test-corrupt-writes"


class CorruptWrites:
    """Wraps the ``tcp`` and ``shm`` transports so that writes deliver zeros while enabled.

    Attributes:
        enabled: corrupt writes now (read by the transports' worker threads on each batch).
        transports: names of the transports to wrap.
        corrupted: number of write items sent as zeros so far (to check the fault fired).
    """

    def __init__(self, enabled: bool = False, transports: tuple[str, ...] = ("tcp", "shm")) -> None:
        self.enabled = enabled
        self.transports = transports
        self.corrupted = 0

    @hookimpl(wrapper=True)
    def mooncake_transports(
        self,
    ) -> Generator[None, list[list[TransportInfo]], list[list[TransportInfo]]]:
        """Replace the factories of the wrapped transports in every plugin's answer."""
        answers = yield
        return [
            [self._wrap(info) if info.name in self.transports else info for info in infos]
            for infos in answers
        ]

    @contextlib.contextmanager
    def switched_on(self) -> Iterator[CorruptWrites]:
        """Corrupt the writes made inside the ``with`` block."""
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False

    def _wrap(self, info: TransportInfo) -> TransportInfo:
        real_factory = info.factory

        def factory(host: Any) -> Any:
            transport = real_factory(host)
            real_execute: Callable[[Any, list[Any], float], None] = transport.execute

            def execute(peer: Any, items: list[Any], deadline: float) -> None:
                if self.enabled:
                    self._zero_writes(items)
                real_execute(peer, items, deadline)

            setattr(transport, "execute", execute)  # noqa: B010 - shadow the bound method
            return transport

        return dataclasses.replace(
            info, factory=factory, description=f"{info.description} [test: writes corrupted]"
        )

    def _zero_writes(self, items: list[Any]) -> None:
        """Point every pending write item at a zero-filled buffer of its length."""
        writes = [it for it in items if it.op == WRITE and not it.done]
        if not writes:
            return
        zeros = bytearray(max(1, max(it.length for it in writes)))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(zeros))
        view = memoryview(zeros)
        for it in writes:
            it.local_addr = addr  # shared memory copies from the address,
            it.local_view = view[: it.length]  # TCP sends the view
            it.extra["test_corrupt_zeros"] = zeros  # keep the buffer alive with the item
        self.corrupted += len(writes)
        logger.info("test fault: %d write item(s) sent as zeros", len(writes))


#: The instance an entry point loads in a child: every write of that process is corrupted.
CORRUPT_ALL_WRITES = CorruptWrites(enabled=True)

#: ``{group: {name: target}}`` for :func:`entry_point_dir`: corrupt every write of a child.
CORRUPT_WRITES_ENTRY_POINT: Mapping[str, Mapping[str, str]] = {
    "mooncake_core.transports": {CORRUPT_WRITES_PLUGIN: f"{__name__}:CORRUPT_ALL_WRITES"},
}


def install_corrupt_writes(enabled: bool = False) -> CorruptWrites:
    """Register a :class:`CorruptWrites` in this process's plugin manager and return it.

    Call it before the transfer engine that should be affected starts.
    """
    plugin = CorruptWrites(enabled=enabled)
    get_plugin_manager().register(plugin, name=CORRUPT_WRITES_PLUGIN)
    return plugin


def entry_point_dir(
    directory: str | os.PathLike[str],
    entry_points: Mapping[str, Mapping[str, str]],
    dist: str = "mooncake-test-faults",
) -> Path:
    """Write ``<directory>/<dist>-0.0.0.dist-info`` declaring ``entry_points`` and return
    ``directory``.

    Args:
        directory: a directory for this child only (a test's temporary directory).
        entry_points: ``{group: {name: "module:attr"}}``.
        dist: the distribution name the entry points belong to.
    """
    root = Path(directory)
    info = root / f"{re.sub(r'[^A-Za-z0-9.]+', '_', dist)}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n")
    lines: list[str] = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return root


def pythonpath(*directories: str | os.PathLike[str]) -> str:
    """A ``PYTHONPATH`` value: ``directories`` first, then this process's ``PYTHONPATH``."""
    parts = [str(d) for d in directories]
    inherited = env_str("PYTHONPATH")
    return os.pathsep.join(parts + ([inherited] if inherited else []))


def corrupt_writes_env(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Environment entries for a child process whose every write delivers zeros.

    ``directory`` receives the generated ``dist-info``; use one the test owns.
    """
    return {"PYTHONPATH": pythonpath(entry_point_dir(directory, CORRUPT_WRITES_ENTRY_POINT))}
