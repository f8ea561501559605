"""The reconnection loop's log: quiet, the way client-go's klog logs retries."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _count(number: int, what: str = "attempt") -> str:
    return f"{number} {what}{'' if number == 1 else 's'}"


_NEW_CONDITION = (
    "aggregator %s: %s%s; %s (logged again when this changes or ends; each attempt at debug level)"
)
_SAME_CONDITION = "aggregator %s: %s (attempt %d, for %s)"


@dataclass
class _Trouble:
    """One address's failures since its last stream connected."""

    condition: str  # the latest, since ``since`` (``attempts`` of them)
    since: float
    started: float  # the first failure (``total`` of them since)
    attempts: int = 1
    total: int = 1


class AttemptLog:
    """The reconnection loop's log, client-go's klog style: per aggregator address, a failure
    condition is logged when it starts, when it changes (at its own level) and when it ends
    (:meth:`connected`: how many attempts, how long); each attempt only at debug level. Each
    address has its own condition: rounds over a dead address and a standby are no changes."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._clock = logger, clock
        self._troubles: dict[str, _Trouble] = {}

    def failed(
        self,
        address: str,
        condition: str,
        *,
        level: int = logging.WARNING,
        then: str = "retrying with backoff",
        exc_info: bool = False,
    ) -> None:
        """One failed attempt on ``address`` (``condition`` says what happened)."""
        now, old = self._clock(), self._troubles.get(address)
        if old is not None and old.condition == condition:
            old.attempts += 1
            old.total += 1
            since = _seconds(now - old.since)
            self._log.debug(_SAME_CONDITION, address, condition, old.attempts, since)
            return
        new = self._troubles[address] = _Trouble(condition, now, old.started if old else now)
        was = ""
        if old is not None:
            new.total += old.total
            was = f" (was: {old.condition}, {_count(old.attempts)} in {_seconds(now - old.since)})"
        self._log.log(level, _NEW_CONDITION, address, condition, was, then, exc_info=exc_info)

    def connected(self, address: str) -> str:
        """A stream to ``address`` connected: the phrase that ends its condition, if any."""
        if (old := self._troubles.pop(address, None)) is None:
            return ""
        elapsed = _seconds(self._clock() - old.started)
        return f" after {_count(old.total, 'failed attempt')} in {elapsed} (last: {old.condition})"
