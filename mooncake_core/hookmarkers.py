"""Pluggy hook markers of the project: ``hookspec``, ``hookimpl`` and the ``PROJECT`` name.

A leaf module (it imports nothing from ``mooncake_core``), so every layer -- transports,
metadata backends, engine adapters -- can mark its hook implementations without
importing the plugin manager. :mod:`mooncake_core.plugins` re-exports all three;
adapters keep writing ``from mooncake_core.plugins import hookimpl``.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookspec", "hookimpl"]

PROJECT = "mooncake"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
