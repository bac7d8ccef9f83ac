"""mooncake-core: an open implementation of the Mooncake architecture.

Transfer engine (:mod:`mooncake_core.transfer`), metadata backends
(:mod:`mooncake_core.metadata`), the KV-cache store, the conductor, the EP router and
drop-in compatibility with the published ``mooncake`` Python API
(:mod:`mooncake_core.compat`).
"""

from __future__ import annotations

from mooncake_core.config import MooncakeConfig, load_config
from mooncake_core.errors import MooncakeError

__all__ = ["MooncakeConfig", "MooncakeError", "load_config", "__version__"]

__version__ = "0.1.0"
