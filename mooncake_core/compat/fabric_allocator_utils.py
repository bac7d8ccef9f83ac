"""``mooncake.fabric_allocator_utils`` drop-in: find a file of the package, probe a library.

The published module holds two generic helpers its fabric allocators use; both work here
with the same signatures, results and errors:

- :func:`get_mooncake_so_path` finds ``so_name`` in the directory of the package that
  ``import mooncake`` gives (after :func:`mooncake_core.compat.install`, ours: it ships
  no shared objects, so asking for the wheel's ``engine.so`` raises the ``ImportError``
  with your message, as the published helper does where the file is missing).
- :func:`probe_allocator_backend` loads a shared library with :mod:`ctypes`, calls
  ``probe_symbol(0)`` (one ``int`` argument, result type ``restype``) and returns its
  result; a missing symbol, a library that does not load or a call that raises logs one
  warning and returns ``unsupported_value``.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from importlib import resources
from typing import Any, TypeVar

__all__ = ["get_mooncake_so_path", "probe_allocator_backend"]

logger = logging.getLogger(__name__)

ProbeValue = TypeVar("ProbeValue")

_LOOKUP_ERRORS = (ImportError, FileNotFoundError, TypeError)


def _in_resources(so_name: str) -> str | None:
    try:
        with resources.as_file(resources.files("mooncake") / so_name) as found:
            return str(found) if found.exists() else None
    except _LOOKUP_ERRORS:
        return None


def _in_package_dir(so_name: str) -> str | None:
    try:
        package = importlib.import_module("mooncake")
        where = os.path.join(os.path.dirname(os.path.abspath(str(package.__file__))), so_name)
    except _LOOKUP_ERRORS:
        return None
    return where if os.path.exists(where) else None


def get_mooncake_so_path(so_name: str, import_error_message: str) -> str:
    """The path of ``so_name`` in the ``mooncake`` package's directory.

    Raises:
        ImportError: with ``import_error_message``, when no such file is there.
    """
    found = _in_resources(so_name) or _in_package_dir(so_name)
    if found is None:
        raise ImportError(import_error_message)
    return found


def probe_allocator_backend(
    so_path: str,
    probe_symbol: str,
    restype: Any,
    unsupported_value: ProbeValue,
) -> ProbeValue:
    """``probe_symbol(0)`` from the library at ``so_path``, or ``unsupported_value`` (one
    warning) when the symbol is missing or the library cannot be loaded or called."""
    name = os.path.basename(so_path)
    try:
        library = ctypes.CDLL(so_path)
        probe = getattr(library, probe_symbol)
    except AttributeError:
        logger.warning(
            "%s has no symbol %r; allocator probing is taken as unsupported", name, probe_symbol
        )
        return unsupported_value
    except Exception as exc:  # noqa: BLE001 - as published: any failure means unsupported
        logger.warning("cannot probe the allocator backend in %s: %s", name, exc)
        return unsupported_value
    try:
        probe.argtypes = [ctypes.c_int]
        probe.restype = restype
        result: ProbeValue = probe(0)
    except Exception as exc:  # noqa: BLE001
        logger.warning("cannot probe the allocator backend in %s: %s", name, exc)
        return unsupported_value
    return result
