"""Replica copy/move tasks of ``mooncake.store``: ``create_copy_task``, ``create_move_task``,
``query_task`` and their types, as a mixin of ``MooncakeDistributedStore``.

The published calls (0.3.13, checked by running them; tests/integration/test_compat_parity.py):

- ``create_copy_task(key, targets)`` -> ``((hi, lo), 0)``: the object gets a replica on each
  named segment that holds none (one that already does is left as it is; the task still
  succeeds); ``((0, 0), code)`` when refused: -704 no such key, -600 no targets or an unknown
  segment.
- ``create_move_task(key, source, target)`` -> the same: afterwards the object has a replica on
  ``target`` and none on ``source``; -600 when ``source`` holds no replica of it, equals
  ``target`` or is unknown.
- ``query_task((hi, lo))`` -> ``(QueryTaskResponse, 0)``, or ``(None, -1400)`` for an
  unknown id. Task and client ids are UUIDs as two 64-bit halves. ``status`` goes from
  ``PENDING`` to ``SUCCESS`` (or ``FAILED``); tasks run in the background.

Ours asks our master (store/replica_tasks.py), which has the owner of each target segment
copy the bytes through the transfer engine.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat.store_types import INVALID_PARAMS

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = [
    "FAILED",
    "PENDING",
    "PROCESSING",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "SUCCESS",
    "TASK_NOT_FOUND",
    "QueryTaskResponse",
    "TaskMethods",
    "TaskStatus",
    "TaskType",
]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")

#: Published code of ``query_task`` for an id the master does not know.
TASK_NOT_FOUND = -1400
_NO_ID = (0, 0)


class _PubEnum(enum.Enum):
    """A pybind11-style enum, as published: not an ``int`` (``TaskStatus.SUCCESS == 3`` is
    False), but ``int()`` and ``operator.index()`` give its number."""

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"


class TaskStatus(_PubEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(_PubEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


PENDING = TaskStatus.PENDING
PROCESSING = TaskStatus.PROCESSING
FAILED = TaskStatus.FAILED
SUCCESS = TaskStatus.SUCCESS
REPLICA_COPY = TaskType.REPLICA_COPY
REPLICA_MOVE = TaskType.REPLICA_MOVE


def _halves(hex_id: str) -> tuple[int, int]:
    n = int(hex_id, 16) if hex_id else 0
    return (n >> 64) & (2**64 - 1), n & (2**64 - 1)


class QueryTaskResponse:
    """Response structure for QueryTask operation (read-only fields, as published)."""

    __slots__ = ("_f",)

    def __init__(self) -> None:
        self._f: dict[str, Any] = {
            "id": _NO_ID,
            "type": TaskType.REPLICA_COPY,
            "status": TaskStatus.PENDING,
            "created_at_ms_epoch": 0,
            "last_updated_at_ms_epoch": 0,
            "assigned_client": _NO_ID,
            "message": "",
        }

    @classmethod
    def _from(cls, answer: dict[str, Any]) -> QueryTaskResponse:
        r = cls()
        r._f.update(
            id=_halves(answer["id"]),
            type=TaskType(int(answer["type"])),
            status=TaskStatus(int(answer["status"])),
            created_at_ms_epoch=int(answer["created_ms"]),
            last_updated_at_ms_epoch=int(answer["updated_ms"]),
            assigned_client=_halves(answer["assigned_client"]),
            message=str(answer["message"]),
        )
        return r

    @property
    def id(self) -> tuple[int, int]:
        return tuple(self._f["id"])

    @property
    def type(self) -> TaskType:
        return self._f["type"]  # type: ignore[no-any-return]

    @property
    def status(self) -> TaskStatus:
        return self._f["status"]  # type: ignore[no-any-return]

    @property
    def created_at_ms_epoch(self) -> int:
        return int(self._f["created_at_ms_epoch"])

    @property
    def last_updated_at_ms_epoch(self) -> int:
        return int(self._f["last_updated_at_ms_epoch"])

    @property
    def assigned_client(self) -> tuple[int, int]:
        return tuple(self._f["assigned_client"])

    @property
    def message(self) -> str:
        return str(self._f["message"])

    def __repr__(self) -> str:
        f = self._f
        return (
            f"QueryTaskResponse(id={f['id'][0]}-{f['id'][1]}, type={int(f['type'])}, "
            f"status={int(f['status'])}, created_at={f['created_at_ms_epoch']}, "
            f"last_updated_at={f['last_updated_at_ms_epoch']}, "
            f"assigned_client={f['assigned_client'][0]}-{f['assigned_client'][1]}, "
            f'message="{f["message"]}")'
        )


def _check(what: str, ok: bool, signature: str) -> None:
    if not ok:
        raise TypeError(f"{what}(): incompatible function arguments; expected {signature}")


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


class TaskMethods:
    """``create_copy_task`` / ``create_move_task`` / ``query_task`` (see module doc)."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...

    def _create_task(
        self, what: str, kind: str, key: str, targets: list[str], source: str
    ) -> tuple[tuple[int, int], int]:
        def run(c: StoreClient) -> str:
            return str(c._call("create_replica_task", (c.client_id, kind, key, targets, source)))

        res = self._run(what, run)
        if isinstance(res, int):
            return _NO_ID, res
        return _halves(res), 0

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[tuple[int, int], int]:
        """Copy an object to target segments: ``(task id, 0)`` or ``((0, 0), code)``."""
        sig = "(key: str, targets: list[str])"
        _check("create_copy_task", isinstance(key, str) and _is_str_list(targets), sig)
        return self._create_task(f"copy of {key!r}", "copy", key, list(targets), "")

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """Move an object from source segment to target segment: ``(task id, 0)`` or
        ``((0, 0), code)``."""
        ok = all(isinstance(v, str) for v in (key, source, target))
        _check("create_move_task", ok, "(key: str, source: str, target: str)")
        if source == target:
            logger.error("move of %r: source and target are both %r", key, source)
            return _NO_ID, INVALID_PARAMS
        return self._create_task(f"move of {key!r}", "move", key, [target], source)

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        """``(QueryTaskResponse, 0)``, or ``(None, -1400)`` for an unknown task."""
        ok = (
            isinstance(task_id, tuple)
            and len(task_id) == 2
            and all(isinstance(x, int) and 0 <= x < 2**64 for x in task_id)
        )
        _check("query_task", ok, "(task_id: tuple[int, int])")
        hex_id = f"{(task_id[0] << 64) | task_id[1]:032x}"
        res = self._run(
            f"query_task {task_id[0]}-{task_id[1]}",
            lambda c: c._call("query_replica_task", (hex_id,)),
        )
        if isinstance(res, int):
            return None, res
        if res is None:
            logger.error("QueryTask failed for task_id: %d-%d", task_id[0], task_id[1])
            return None, TASK_NOT_FOUND
        return QueryTaskResponse._from(res), 0
