"""Garbage collection with thousands of open streams.

CPython's full collection walks every container object the process holds: about a hundred per
agent connection (its gRPC call, tasks, futures), a million at 10,000 agents, and that takes
one to two seconds with the event loop stopped (bench/ingest.py at 10,000 agents: every label
write that fell in such a pause came 1.2 s late). So what has lived through a minute is
long-lived: :func:`freeze_long_lived` moves it to the permanent generation (``gc.freeze``),
and collections walk only what is newer. Once an hour it is all thawed (``gc.unfreeze``), so
that cycles among old objects that have become garbage since (streams that ended) are
collected, in one full pass.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable

#: Objects older than this are frozen (the collector no longer walks them).
FREEZE_EVERY = 60.0
#: Everything is thawed this often, so that old garbage cycles are collected.
THAW_EVERY = 3600.0


async def freeze_long_lived(
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    freeze: Callable[[], None] = gc.freeze,
    unfreeze: Callable[[], None] = gc.unfreeze,
) -> None:
    """Freeze every :data:`FREEZE_EVERY`, thaw every :data:`THAW_EVERY`; runs until cancelled."""
    thawed_at = clock()
    while True:
        await sleep(FREEZE_EVERY)
        if clock() - thawed_at >= THAW_EVERY:
            unfreeze()
            thawed_at = clock()
        else:
            freeze()
