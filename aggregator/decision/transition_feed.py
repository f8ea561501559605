"""Transitions for WatchTransitions clients: a bounded queue per watcher, fed by the core."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aggregator.decision.tracker import StateChange

#: Transitions buffered per watcher before a slow watcher is cut off.
WATCH_QUEUE_SIZE = 1024


class WatcherTooSlow(Exception):
    """A WatchTransitions client fell more than WATCH_QUEUE_SIZE transitions behind."""


@dataclass(eq=False)
class _Watcher:
    namespace: str
    queue: asyncio.Queue[StateChange | None] = field(
        default_factory=lambda: asyncio.Queue(WATCH_QUEUE_SIZE)
    )
    overflowed: bool = False


class TransitionFeed:
    """Publishes each transition to every watcher of its namespace; never blocks the core."""

    def __init__(self, on_count: Callable[[int], None]) -> None:
        #: Told the number of watchers whenever it changes (a metric).
        self._on_count = on_count
        self._watchers: set[_Watcher] = set()

    def publish(self, transition: StateChange) -> None:
        for watcher in self._watchers:
            if watcher.namespace and watcher.namespace != transition.key.namespace:
                continue
            try:
                watcher.queue.put_nowait(transition)
            except asyncio.QueueFull:
                watcher.overflowed = True

    async def watch(self, namespace: str = "") -> AsyncIterator[StateChange]:
        """Every transition from now on, until :meth:`close`.

        Raises WatcherTooSlow when the consumer falls behind (it would otherwise hold memory
        without bound).
        """
        watcher = _Watcher(namespace)
        self._watchers.add(watcher)
        self._on_count(len(self._watchers))
        try:
            while True:
                if watcher.overflowed:
                    raise WatcherTooSlow(
                        f"more than {WATCH_QUEUE_SIZE} transitions behind; reconnect and re-list"
                    )
                transition = await watcher.queue.get()
                if transition is None:
                    return
                yield transition
        finally:
            self._watchers.discard(watcher)
            self._on_count(len(self._watchers))

    def close(self) -> None:
        """End every watch (shutdown)."""
        for watcher in self._watchers:
            try:
                watcher.queue.put_nowait(None)
            except asyncio.QueueFull:
                watcher.overflowed = True
