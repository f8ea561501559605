"""A keyed work queue for asyncio, after client-go's ``workqueue`` (and kopf's per-object
queues): what both programs' pod writers run on (the aggregator's
:mod:`aggregator.kube.writer`, an agent's :mod:`node_agent.fallback.writer`).

A key is what is to be reconciled (a pod, or one of its targets); what it should become is
not in the queue, but looked up by the handler when the key comes out (level-triggered: many
changes of one key before a worker is free are one piece of work, on the latest state).

- **Deduplicated**: a key waits in the queue at most once, however often it is added.
- **One at a time**: a key handed to a worker (:meth:`get`) is handed to no other until
  :meth:`done`; added meanwhile, it is queued again then.
- **Retried**: :meth:`retry` puts the key back after its own backoff (capped exponential with
  full jitter, :func:`servehealth_common.backoff.backoff_delay`; ``Retry-After`` honoured
  within bounds, :func:`servehealth_common.backoff.retry_delay`); :meth:`forget` after a
  success starts its next failure small again. A key waiting for its retry is not brought
  forward by a new :meth:`add`: the retry takes the latest state anyway, and the API's
  ``Retry-After`` is kept.
- **Dropped**: :meth:`drop` (the pod is gone) forgets a key's place, retry and failures.
- **Workers**: :meth:`serve` runs ``workers`` tasks that take keys and call a handler; a
  handler's surprise is logged and the key retried, never ending the others.

Rate limiting of requests belongs to the handlers (a token bucket for the aggregator, the
fleet's budget for an agent): the queue limits per key, not overall. The timer is injected
(``schedule``), so tests move time by hand.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Protocol, TypeVar

from servehealth_common.backoff import backoff_delay, retry_delay

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


#: Call ``callback`` after ``delay`` seconds; the handle cancels it (``loop.call_later``).
Schedule = Callable[[float, Callable[[], None]], Cancellable]


def _call_later(delay: float, callback: Callable[[], None]) -> Cancellable:
    return asyncio.get_running_loop().call_later(delay, callback)


class KeyedQueue(Generic[K]):
    """Keys to work on: :meth:`add`, :meth:`get`, :meth:`done`, :meth:`retry`, :meth:`forget`,
    :meth:`drop`; :meth:`serve` runs the workers."""

    def __init__(
        self, *, rng: random.Random | None = None, schedule: Schedule = _call_later
    ) -> None:
        self._rng = rng or random.Random()
        self._schedule = schedule
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._active: set[K] = set()
        self._again: set[K] = set()  # added while active: queued again at done()
        self._retries: dict[K, Cancellable] = {}
        self._failures: dict[K, int] = {}

    def add(self, key: K) -> None:
        """Work on ``key`` (once, however often it is added before a worker takes it)."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued and key not in self._retries:
            self._queued.add(key)
            self._ready.put_nowait(key)

    async def get(self) -> K:
        """The next key to work on (waiting for one); it is the caller's until :meth:`done`."""
        while True:
            key = await self._ready.get()
            if self._take(key):
                return key

    def get_nowait(self) -> K | None:
        """The next key to work on, if one is ready now (None: none); the caller's until
        :meth:`done`."""
        while not self._ready.empty():
            key = self._ready.get_nowait()
            if self._take(key):
                return key
        return None

    def _take(self, key: K) -> bool:
        """Hand ``key`` out, unless it was dropped since it was added (False)."""
        if key not in self._queued:
            return False
        self._queued.discard(key)
        self._active.add(key)
        return True

    def done(self, key: K) -> None:
        """The work on ``key`` is over (queued again if it was added meanwhile and is not
        waiting for a retry)."""
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def retry(self, key: K, retry_after: float | None = None) -> float:
        """Work on ``key`` again after its backoff (or ``retry_after``, the API's, within
        bounds); returns the delay. Call it before :meth:`done`."""
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = retry_delay(retry_after, lambda: backoff_delay(failures - 1, self._rng))
        self._cancel_retry(key)
        self._retries[key] = self._schedule(delay, lambda: self._retry_due(key))
        return delay

    def failures(self, key: K) -> int:
        """Failed attempts of ``key`` since its last :meth:`forget`."""
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        """``key``'s work succeeded: its next failure backs off from the start."""
        self._failures.pop(key, None)

    def drop(self, key: K) -> None:
        """Forget ``key`` altogether (its place in the queue, its retry, its failures); a
        worker that holds it still calls :meth:`done`."""
        self._queued.discard(key)
        self._again.discard(key)
        self._cancel_retry(key)
        self._failures.pop(key, None)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is queued, being worked on, or waiting for a retry."""
        return key in self._queued or key in self._active or key in self._retries

    def __len__(self) -> int:
        """Keys queued, being worked on, or waiting for a retry."""
        return len(self._queued | self._active | set(self._retries))

    def _retry_due(self, key: K) -> None:
        self._retries.pop(key, None)
        self.add(key)

    def _cancel_retry(self, key: K) -> None:
        handle = self._retries.pop(key, None)
        if handle is not None:
            handle.cancel()

    async def serve(
        self, handle: Callable[[K], Awaitable[None]], *, workers: int, name: str
    ) -> None:
        """Run ``workers`` tasks, each taking keys and awaiting ``handle(key)``, until
        cancelled. A handler's exception (a surprise: expected failures are the handler's to
        retry) is logged and the key retried."""
        async with asyncio.TaskGroup() as group:
            for number in range(workers):
                group.create_task(self._work(handle), name=f"{name}-{number}")

    async def _work(self, handle: Callable[[K], Awaitable[None]]) -> None:
        while True:
            key = await self.get()
            try:
                await handle(key)
            except Exception:  # a surprise must not stop every other key: retry this one
                delay = self.retry(key)
                log.exception("work on %s failed; retrying in %.2fs", key, delay)
            finally:
                self.done(key)
