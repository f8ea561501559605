"""Capped exponential backoff with full jitter, as data (AWS "Exponential Backoff and Jitter")."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


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
