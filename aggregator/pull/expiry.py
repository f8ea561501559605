"""The expiry loop: every ``interval``, pods past their TTL become SILENT (while leading)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from servehealth_common.runtime import cancel_and_wait

log = logging.getLogger(__name__)


class ExpiryLoop:
    def __init__(self, expire: Callable[[], None], interval: float) -> None:
        #: One expiry pass (:meth:`aggregator.decision.core.Core.expire`).
        self._expire = expire
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="expiry")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        """Expire every ``interval`` until stopped; a pass that fails is logged, not fatal."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                self._expire()
            except Exception:  # keep expiring whatever one pass met
                log.exception("expiry pass failed")
