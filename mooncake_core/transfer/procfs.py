"""What ``/proc`` says about a process: alive, zombie, stopped, when it started.

The shared-memory transport uses :func:`start_time` to find peers that exited (or whose pid
was reused); tests that freeze a process with ``SIGSTOP`` use :func:`all_threads_stopped`
(``kill`` returns before every thread has stopped).
"""

from __future__ import annotations

import os

__all__ = ["all_threads_stopped", "start_time", "thread_states"]


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``stat`` file after ``pid (comm)`` (comm may hold spaces and
    parentheses), or None when it is gone."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].decode("ascii", "replace").split()


def start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), or None when it is gone or a zombie
    (its memory is freed; a mapping of its memfd would keep those pages alive)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # starttime: field 22 of proc(5)


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (empty when it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields:  # a thread that ended while we looked is left out
            out.append(fields[0])
    return out


def all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is stopped (state T or t)."""
    states = thread_states(pid)
    return bool(states) and all(s in ("T", "t") for s in states)
