"""Backoff between attempts, and the API's ``Retry-After``, for both programs.

- :func:`backoff_delay`: the one backoff, capped exponential with full jitter (AWS
  "Exponential Backoff and Jitter"), so that thousands of agents never retry in step: every
  pod write of both programs retries with it (per key, in
  :class:`servehealth_common.work_queue.KeyedQueue`), and so does the cleanup;
- :class:`Backoff`: the same, as data that counts its own attempts (an agent's reconnections
  and reads);
- :func:`retry_delay`: ``Retry-After`` when the API gave one, within
  [:data:`RETRY_FLOOR`, :data:`RETRY_CAP`], else the backoff's delay: every writer honours it
  the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

#: ``Retry-After`` is honoured within these bounds (seconds).
RETRY_FLOOR, RETRY_CAP = 0.2, 30.0


@dataclass
class Backoff:
    """``next()`` returns a random delay in ``[0, min(cap, base * 2**attempt)]``.

    ``reset()`` after a success, so one failure after a long healthy run starts small again.
    """

    base: float = 0.2
    cap: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next(self) -> float:
        delay = backoff_delay(self.attempt, self.rng, base=self.base, cap=self.cap)
        self.attempt = min(self.attempt + 1, 32)
        return delay

    def reset(self) -> None:
        self.attempt = 0


def jittered(interval: float, rng: random.Random, spread: float = 0.1) -> float:
    """``interval`` +/- ``spread`` (a fraction), so thousands of agents do not beat in step."""
    return interval * (1 + rng.uniform(-spread, spread))


def jittered_below(interval: float, rng: random.Random, spread: float = 0.1) -> float:
    """``interval`` shortened by up to ``spread`` (a fraction), never lengthened: for a period
    that promises "at least once every ``interval``" and still does not beat in step."""
    return interval * (1 - rng.uniform(0, spread))


def backoff_delay(
    failures: int, rng: random.Random, *, base: float = RETRY_FLOOR, cap: float = RETRY_CAP
) -> float:
    """The wait after ``failures`` + 1 failures in a row (0: the first): a random delay in
    ``[0, min(cap, base * 2**failures)]`` (full jitter: thousands of agents, or one writer's
    many pods, never retry in step; the ceiling still doubles with each failure)."""
    return rng.uniform(0, min(cap, base * (2 ** min(failures, 32))))


def retry_delay(retry_after: float | None, otherwise: Callable[[], float]) -> float:
    """The wait before the next attempt: ``Retry-After`` if the API gave one (within
    reason), else ``otherwise()``, the backoff's."""
    if retry_after is not None:
        return min(max(retry_after, RETRY_FLOOR), RETRY_CAP)
    return otherwise()
