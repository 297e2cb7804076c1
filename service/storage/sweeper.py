"""The API's background sweep: ``Storage.clean`` every ``storage.sweep_interval_s``.

Expired objects are already invisible to readers (every backend checks the expiry on
read and list); the sweep gives their bytes back, and removes orphaned temp files of
writers that died. One task per API process: sweeps of several replicas over one root
race harmlessly (each removal tolerates a file already gone). A failed sweep is logged
and retried at the next interval; it never stops the service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from service.storage.base import Storage, Swept

log = logging.getLogger(__name__)


async def sweep_forever(
    storage: Storage, interval_s: float, record: Callable[[Swept], None]
) -> None:
    """Clean ``storage`` now and then every ``interval_s``, handing each result to
    ``record`` (the metric); runs until cancelled."""
    while True:
        try:
            swept = await storage.clean()
        except Exception:  # a full disk, a vanished root: the next round may do better
            log.warning("hsx: storage sweep failed", exc_info=True)
        else:
            record(swept)
            if swept.expired or swept.orphan:
                log.info("hsx: swept %d expired objects, %d orphans", swept.expired, swept.orphan)
        await asyncio.sleep(interval_s)
