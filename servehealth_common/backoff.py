"""Backoff between attempts, and the API's ``Retry-After``, for both programs.

- :class:`Backoff`: capped exponential backoff with full jitter, as data (AWS "Exponential
  Backoff and Jitter"): what thousands of agents use, so that they never retry in step;
- :func:`stepped_delay`: the aggregator's writes (and the cleanup's): a fixed schedule with
  +/-20 % jitter, so that each retry of the one writer waits longer than the one before;
- :func:`retry_delay`: ``Retry-After`` when the API gave one, within
  [:data:`RETRY_FLOOR`, :data:`RETRY_CAP`], else the backoff's delay: every writer honours it
  the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

#: Seconds to wait before attempt 1, 2, 3, ... of :func:`stepped_delay`; the last repeats.
STEPS = (0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 30.0)
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
        ceiling = min(self.cap, self.base * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 32)
        return self.rng.uniform(0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


def jittered(interval: float, rng: random.Random, spread: float = 0.1) -> float:
    """``interval`` +/- ``spread`` (a fraction), so thousands of agents do not beat in step."""
    return interval * (1 + rng.uniform(-spread, spread))


def jittered_below(interval: float, rng: random.Random, spread: float = 0.1) -> float:
    """``interval`` shortened by up to ``spread`` (a fraction), never lengthened: for a period
    that promises "at least once every ``interval``" and still does not beat in step."""
    return interval * (1 - rng.uniform(0, spread))


def stepped_delay(attempt: int, rng: random.Random) -> float:
    """The wait before retry ``attempt`` (1, 2, ...): :data:`STEPS`, +/-20 % jitter."""
    base = STEPS[min(attempt, len(STEPS)) - 1]
    return base * rng.uniform(0.8, 1.2)


def retry_delay(retry_after: float | None, otherwise: Callable[[], float]) -> float:
    """The wait before the next attempt: ``Retry-After`` if the API gave one (within
    reason), else ``otherwise()``, the backoff's."""
    if retry_after is not None:
        return min(max(retry_after, RETRY_FLOOR), RETRY_CAP)
    return otherwise()
