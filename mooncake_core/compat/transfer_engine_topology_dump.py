"""``mooncake.transfer_engine_topology_dump`` drop-in: print this host's NIC topology.

Same command line and output as the published tool (``transfer_engine_topology_dump``):
``Local topology [BACKEND/MODE]: `` followed by the JSON priority matrix
``{"cpu:<node>": [[preferred NICs], [other NICs]]}`` of
:meth:`mooncake_core.compat.engine.TransferEngine.get_local_topology` (our NIC names from
``/sys/class/net``, where the published engine lists RDMA devices). ``--device-name a,b``
keeps only those NICs. ``--custom-topo-json FILE`` (or ``--use-custom-topo`` with
``MC_CUSTOM_TOPO_JSON``) prints the matrix in FILE instead, keeping only NICs this host has
(as published); a file that cannot be read falls back to discovery, and JSON that is not
an object of CPU nodes is an error, as published. There is no TENT runtime here:
``--backend tent`` (or ``MC_USE_TENT``) prints the classic matrix under the ``tent`` label,
as the published tool does when its ``tent`` module is absent.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mooncake_core.config import env_str

__all__ = [
    "apply_backend",
    "dump_te_topology",
    "dump_tent_topology",
    "main",
    "parse_args",
    "resolve_backend",
    "sanitize_tent_conf_for_discover",
]

logger = logging.getLogger(__name__)


def parse_args() -> argparse.Namespace:
    """The published options, from :data:`sys.argv`."""
    parser = argparse.ArgumentParser(
        prog="transfer_engine_topology_dump",
        description="Print the transfer engine's view of this host's NICs per CPU node"
        " (mooncake-core). Discovery by default; --custom-topo-json prints a given matrix.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--device-name", type=str, default="", help="keep only these NICs (comma-separated)"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "te", "tent"),
        default="auto",
        help="te, tent (the same engine here) or auto (tent when MC_USE_TENT/MC_USE_TEV1 is set)",
    )
    parser.add_argument(
        "--use-custom-topo",
        action="store_true",
        help="print the matrix in the file MC_CUSTOM_TOPO_JSON names",
    )
    parser.add_argument(
        "--custom-topo-json", type=str, default=None, help="print the matrix in this JSON file"
    )
    return parser.parse_args()


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``tent`` when ``MC_USE_TENT`` or ``MC_USE_TEV1`` is set, else ``te``."""
    if backend != "auto":
        return backend
    return "tent" if env_str("MC_USE_TENT") or env_str("MC_USE_TEV1") else "te"


def apply_backend(backend: str) -> None:
    """Nothing to switch: one engine serves both labels here."""
    logger.debug("topology backend %s: one engine here", backend)


def sanitize_tent_conf_for_discover() -> str | None:
    """The published tool strips custom topology from ``MC_TENT_CONF``; we read no TENT
    configuration, so there is no temporary file to make (None)."""
    return None


def dump_te_topology(device_name: str) -> str:
    """The discovered matrix as JSON (``device_name``: a comma list of NICs to keep)."""
    from mooncake_core.compat.engine import TransferEngine

    return TransferEngine().get_local_topology(device_name=device_name or None)


def dump_tent_topology(device_name: str) -> str:
    """As :func:`dump_te_topology` (the published tool's fallback without TENT)."""
    return dump_te_topology(device_name)


def _custom(path: str, device_name: str) -> str | None:
    """The matrix in ``path`` with only NICs this host has (and ``device_name`` lists, if
    given); None when the file cannot be read (discover instead, as published).

    Raises:
        ValueError: the file holds JSON that is not an object of CPU nodes.
    """
    from mooncake_core.transfer.topology import discover_nics

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        logger.warning("custom topology %s unusable (%s); discovering instead", path, exc)
        return None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise ValueError(f'{path}: expected {{"cpu:N": [[NICs], [NICs]]}}')
    have = {n.name for n in discover_nics()}
    keep = {d.strip() for d in device_name.split(",") if d.strip()} or have
    matrix = {
        node: [[n for n in tier if n in have and n in keep] for tier in tiers]
        for node, tiers in data.items()
    }
    return json.dumps(matrix, indent=1)


def main() -> int:
    """Print the topology line; 0, or 1 with one ``error:`` line on stderr."""
    args = parse_args()
    backend = resolve_backend(args.backend)
    apply_backend(backend)
    path: str | None = None
    if args.custom_topo_json is not None:
        path = args.custom_topo_json
        mode = f"custom ({path})"
    elif args.use_custom_topo:
        path = env_str("MC_CUSTOM_TOPO_JSON")
        if not path:
            print(
                "error: --use-custom-topo requires MC_CUSTOM_TOPO_JSON (a topology JSON file)",
                file=sys.stderr,
            )
            return 1
        mode = f"custom ({path})"
    else:
        mode = "discover"
    try:
        topo = _custom(path, args.device_name) if path else None
        if topo is None:
            dump = dump_tent_topology if backend == "tent" else dump_te_topology
            topo = dump(args.device_name)
    except Exception as exc:  # noqa: BLE001 - one line, as the published tool
        print(f"error: failed to dump topology: {exc}", file=sys.stderr)
        return 1
    print(f"Local topology [{backend}/{mode}]: ", end="")
    print(topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
