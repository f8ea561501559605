"""The per-stream message budget: a token bucket of ``rate`` messages a second, burst ``rate``.

Refilled lazily: a message costs one integer decrement, and the clock is read only when the
budget is spent (once every ``rate`` messages at most), so a well-behaved stream pays almost
nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable


class StreamRateLimit:
    def __init__(self, rate: int, clock: Callable[[], float]) -> None:
        if rate < 1:
            raise ValueError(f"rate must be at least 1 message per second, got {rate}")
        self.rate = rate
        self._clock = clock
        self._budget = rate
        self._refilled = clock()

    def take(self) -> bool:
        """Spend one message; False (and nothing spent) when the stream is over its rate."""
        self._budget -= 1
        if self._budget >= 0:
            return True
        now = self._clock()
        rate = self.rate
        earned = int((now - self._refilled) * rate)
        if earned < 1:
            self._budget += 1
            return False
        if earned >= rate:  # the bucket filled up: it holds `rate` again
            self._budget, self._refilled = rate - 1, now
        else:
            self._budget, self._refilled = earned - 1, self._refilled + earned / rate
        return True
