"""Garbage collection with thousands of open streams.

CPython's full collection walks every container object the process holds: about a hundred per
agent connection (its gRPC call, tasks, futures), a million at 10,000 agents, and that takes
one to two seconds with the event loop stopped (measured with bench/ingest.py at 10,000 agents:
full collections of 0.3 to 1.5 s while the agents connect, and every label write that fell in
one came that much late). So what has survived a full collection is long-lived:
:class:`LongLived` moves it to the permanent generation (``gc.freeze``) right after each one, and
the next one walks only what is newer. Once an hour it is all thawed (``gc.unfreeze``), so
that cycles among old objects that have become garbage since (streams that ended) are collected,
in one full pass.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

#: Everything is thawed this often, so that old garbage cycles are collected.
THAW_EVERY = 3600.0


class LongLived:
    """Freezes what survived each full collection; :meth:`thaw_forever` thaws it hourly."""

    def __init__(
        self,
        freeze: Callable[[], None] = gc.freeze,
        unfreeze: Callable[[], None] = gc.unfreeze,
    ) -> None:
        self._freeze = freeze
        self._unfreeze = unfreeze

    def collected(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: after a full collection, freeze its survivors."""
        if phase == "stop" and info.get("generation") == 2:
            self._freeze()

    def install(self) -> None:
        gc.callbacks.append(self.collected)

    def uninstall(self) -> None:
        if self.collected in gc.callbacks:
            gc.callbacks.remove(self.collected)

    async def thaw_forever(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Thaw every :data:`THAW_EVERY` until cancelled (the next full collection sees all)."""
        while True:
            await sleep(THAW_EVERY)
            self._unfreeze()
