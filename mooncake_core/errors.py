"""The one exception tree of mooncake-core.

Messages name the thing that was wrong and, where there is one, the next step.
Socket and driver errors are mapped at the transport boundary (``raise ... from exc``);
:mod:`mooncake_core.compat` turns these into the published API's integer codes.
"""

from __future__ import annotations

__all__ = [
    "MooncakeError",
    "ConfigError",
    "TraceError",
    "PluginError",
    "TransportError",
    "TransferTimeout",
    "PeerUnreachable",
    "AuthError",
    "InvalidRequest",
    "SegmentError",
    "MetadataError",
    "StoreError",
    "ObjectNotFound",
    "ObjectExists",
    "NoSpace",
    "LeaseExpired",
    "MasterUnavailable",
    "ProxyError",
    "EPError",
    "InvalidRouting",
    "RankFailure",
    "Evicted",
]


class MooncakeError(Exception):
    """Base of every error raised by mooncake-core."""


class ConfigError(MooncakeError, ValueError):
    """A configuration value is missing or invalid; the message names the key."""


class TraceError(ConfigError):
    """A request trace is unusable (malformed line, empty file, ...); the message names
    the file and line."""


class PluginError(MooncakeError):
    """A plugin could not be loaded or answered a hook wrongly."""


class TransportError(MooncakeError):
    """Moving bytes failed."""


class TransferTimeout(TransportError, TimeoutError):
    """A transfer did not complete within its timeout."""


class PeerUnreachable(TransportError, ConnectionError):
    """The peer could not be reached or went away."""


class AuthError(TransportError, PermissionError):
    """The peer rejected our credentials or we rejected the peer's."""


class InvalidRequest(TransportError, ValueError):
    """A request was malformed: bad length, address outside registered memory, ..."""


class SegmentError(MooncakeError, ValueError):
    """Registering or unregistering memory failed."""


class MetadataError(MooncakeError):
    """The metadata backend failed or does not know the requested name."""


class StoreError(MooncakeError):
    """A store operation failed."""


class ObjectNotFound(StoreError, KeyError):
    """No complete replica of the key exists."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else "object not found"


class ObjectExists(StoreError):
    """The key already exists."""


class NoSpace(StoreError):
    """No segment can hold the object."""


class LeaseExpired(StoreError):
    """A lease ended before the read completed."""


class MasterUnavailable(StoreError, ConnectionError):
    """No master (leader) could be reached."""


class ProxyError(MooncakeError):
    """The OpenAI-compatible proxy (:mod:`mooncake_core.proxy`) could not serve a request."""


class EPError(MooncakeError):
    """Elastic expert parallelism (:mod:`mooncake_core.ep`) failed."""


class InvalidRouting(EPError, ValueError):
    """Router output or layer input is malformed: expert ids out of range, shape or
    dtype mismatch, no active rank, or ``active_ranks`` differing between ranks."""


class RankFailure(EPError):
    """A step could not complete because EP membership changed.

    The new membership epoch is already installed when this is raised; redo the step.
    """


class Evicted(EPError):
    """This rank was left out of the membership epoch the survivors agreed on; rejoin."""


class SegmentOverlap(SegmentError):
    """The memory to register overlaps a range that is already registered."""


__all__ += ["SegmentOverlap"]


class MissingDependency(ConfigError, ImportError):
    """An optional package is not installed; the message names it and the extra to install.

    Args:
        module: the top-level module that could not be imported (``zmq``, ``torch``, ...).
        needed_for: what needs it (``proxy --kv-events``, ``bench ep``), for the message.
    """

    # importable module -> (package on PyPI, extra of mooncake-core that brings it)
    EXTRAS: dict[str, tuple[str, str]] = {
        "zmq": ("pyzmq", "proxy"),
        "torch": ("torch", "ep"),
        "aetcd": ("aetcd", "etcd"),
        "matplotlib": ("matplotlib", "plot"),
        "uvloop": ("uvloop", "uvloop"),
    }

    def __init__(self, module: str, needed_for: str = "") -> None:
        top = module.split(".", 1)[0]
        package, extra = self.EXTRAS.get(top, (top, ""))
        self.module = top
        self.package = package
        self.extra = extra
        what = f"{needed_for} needs" if needed_for else "missing"
        fix = f"pip install 'mooncake-core[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{what} the optional package {package}, which is not installed: {fix}")


__all__ += ["MissingDependency"]
