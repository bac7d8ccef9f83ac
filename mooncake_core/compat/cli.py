"""``mooncake.cli`` drop-in: ``main()`` runs our store master with the published
``mooncake_master`` command line (see :func:`mooncake_core.compat.cli_tools.master_main`)."""

from __future__ import annotations

from mooncake_core.compat.cli_tools import master_main

__all__ = ["main"]


def main() -> None:
    """Replace this process with our master, given the published flags in :data:`sys.argv`."""
    master_main()


if __name__ == "__main__":
    main()
