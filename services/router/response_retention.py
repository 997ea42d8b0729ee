"""Stored Responses expire: a router purges those past the retention, as OpenAI drops its own
after 30 days.

Every router sharing a store runs the purge; the deletes are idempotent, so two routers
purging at once only split the work. A purge goes a batch at a time (each its own
transaction), so a backlog of expired responses never holds a long lock on the table that
live requests write.
"""

from __future__ import annotations

import asyncio
import contextlib

from cachet.logs import get_logger
from cachet.router.queue_store import QueueStore

log = get_logger(__name__)

PURGE_BATCH = 500
_SECONDS_PER_DAY = 86_400


class ResponseRetention:
    """Purges ``store``'s responses older than ``retention_days``, now and every ``interval_seconds``."""

    def __init__(self, store: QueueStore, retention_days: float, interval_seconds: float) -> None:
        self._store = store
        self._max_age_seconds = int(retention_days * _SECONDS_PER_DAY)
        self._interval_seconds = interval_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def purge(self) -> int:
        """Delete every expired response (a batch at a time); how many went."""
        purged = 0
        while True:
            batch = await self._store.purge_responses(self._max_age_seconds, PURGE_BATCH)
            purged += batch
            if batch < PURGE_BATCH:
                break
        if purged:
            log.info("expired stored responses purged", responses=purged)
        return purged

    async def _loop(self) -> None:
        while True:
            try:
                await self.purge()
            except Exception:  # noqa: BLE001 - a store hiccup must not end the purges for good
                log.exception("stored response purge failed")
            await asyncio.sleep(self._interval_seconds)
