"""Bookkeeping the gRPC servicers share: the calls in flight (for a drain to wait on), and what
was already logged (so a client refused at every reconnection is one warning, not a flood)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Hashable

import grpc

#: Keys (client address, kind of refusal) remembered as logged.
LOGGED_REFUSALS = 1024


class LoggedOnce:
    """Keys already logged, the least recently seen forgotten first: :meth:`first` is True the
    first time (log it as a warning), then False (debug level) while the key is remembered.
    An agent refused at every reconnection must not fill the log (``aggregator.guard`` does
    the same for token refusals)."""

    def __init__(self, size: int = LOGGED_REFUSALS) -> None:
        self._size = size
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    def first(self, key: Hashable) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True


class CallsInFlight:
    """The calls a servicer is handling, for a drain to wait on (:meth:`idle`)."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def started(self, context: grpc.aio.ServicerContext) -> None:
        """Count the call of ``context`` until gRPC is done with it: its handler returned and
        its status was sent (``add_done_callback`` runs when gRPC's task for the call ends)."""
        self._count += 1
        self._idle.clear()
        context.add_done_callback(self._ended)

    def _ended(self, _: object) -> None:
        self._count -= 1
        if not self._count:
            self._idle.set()

    async def idle(self) -> None:
        """Until no call is in flight."""
        await self._idle.wait()
