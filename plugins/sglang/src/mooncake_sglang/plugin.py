"""SGLang general plugin (entry-point group ``sglang.srt.plugins``).

SGLang runs every plugin of that group in each of its processes (engine, scheduler,
detokenizer, DP controller) before it builds anything. :func:`install_compat` makes
``import mooncake`` / ``mooncake.store`` / ``mooncake.engine`` resolve to
``mooncake_core.compat`` there, so SGLang's built-in ``--hicache-storage-backend
mooncake`` and ``--disaggregation-transfer-backend mooncake`` run on mooncake-core.
It does nothing when the published ``mooncake`` package is installed (unless
``MOONCAKE_SGLANG_FORCE_COMPAT=1``) and is idempotent. ``SGLANG_PLUGINS`` (SGLang's
allow-list) can exclude it by its name, ``mooncake_core_compat``.
"""

from __future__ import annotations

import logging

from mooncake_core.config import env_flag
from mooncake_core.errors import ConfigError

__all__ = ["install_compat"]

logger = logging.getLogger(__name__)


def install_compat() -> bool:
    """Install mooncake_core.compat as ``mooncake``; True if ours is now in place."""
    import mooncake_core.compat as compat

    try:
        force = env_flag("MOONCAKE_SGLANG_FORCE_COMPAT")
    except ConfigError as exc:  # never stop SGLang over a typo: warn, do not force
        logger.warning("%s; not forcing mooncake_core.compat", exc)
        force = False
    done = compat.install(force=force)
    if done:
        logger.info("mooncake_sglang: SGLang's mooncake backends now run on mooncake_core.compat")
    return done
