"""Errors of the P2P store (all :class:`~mooncake_core.errors.MooncakeError`, one line each)."""

from __future__ import annotations

from mooncake_core.errors import MooncakeError

__all__ = [
    "P2PError",
    "BadName",
    "NameExists",
    "NameNotFound",
    "VersionChanged",
    "ShardUnavailable",
]


class P2PError(MooncakeError):
    """Something about a P2P-store name or replica went wrong."""


class BadName(P2PError, ValueError):
    """A name, size or shard size was refused (the message says which and why)."""


class NameExists(P2PError):
    """``register`` of a name that is already registered (pass ``force=True`` to replace)."""


class NameNotFound(P2PError, KeyError):
    """No such name: never registered, or unregistered (possibly during a download)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "name not found"


class VersionChanged(P2PError):
    """The name was registered again (a new version) while a reader fetched the old one."""


class ShardUnavailable(P2PError):
    """No live holder could supply a shard with the right checksum."""
