"""Withdrawing a live client's SSD tier (``unmount_local_disk_segment`` in the published API).

The client stops taking offload and promotion tasks, asks the master to forget its disk copies
(``drop_disk``, :meth:`~mooncake_core.store.tiering.SsdTiering.drop_disk`) and deletes the
files. Kept out of :mod:`~mooncake_core.store.client` (module size).
"""

from __future__ import annotations

import logging

from mooncake_core.store.client import StoreClient

__all__ = ["withdraw_ssd_tier"]

logger = logging.getLogger(__name__)


def withdraw_ssd_tier(client: StoreClient) -> int:
    """Stop ``client`` offloading to its SSD tier and drop its disk copies: the master
    forgets them (``drop_disk``: objects with a memory replica keep it, objects whose only
    copy was on this disk are removed) and the files go. Returns how many copies the master
    dropped; 0 without a tier. Raises the master's error (the tier is then kept)."""
    tier = client.ssd
    if tier is None:
        return 0
    client.ssd = None  # offload / promote tasks that arrive from now on are refused
    try:
        dropped = int(client._call("drop_disk", (client.client_id,)))
    except BaseException:
        client.ssd = tier
        raise
    tier.clear()
    logger.info("SSD tier %s withdrawn: %d disk copies dropped", tier.path, dropped)
    return dropped
