"""How often agents that report on change resync every pod (anti-entropy), as the fleet grows.

Consul's anti-entropy rule (``agent/ae``, ``scaleFactor``): up to 128 nodes the base interval;
beyond, one more base interval per doubling of the fleet (x2 at 256, x8 at 10,000, x9 at
20,000). Resyncs guard against a report lost to a bug, not to the network (a stream is
ordered and reliable, and every new stream starts with every pod), so they can be rare; their
cost stays about flat as the fleet grows. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Up to this many pods, the base interval (Consul's ``aeScaleThreshold``).
SCALE_THRESHOLD = 128
#: A pod kept alive by an open stream goes SILENT after this many resync intervals without a
#: report: one missed resync is tolerated, a third is not.
MISSED_RESYNCS = 3


def scale_factor(pods: int) -> int:
    """1 up to :data:`SCALE_THRESHOLD` pods, then one more per doubling."""
    if pods <= SCALE_THRESHOLD:
        return 1
    return math.ceil(math.log2(pods) - math.log2(SCALE_THRESHOLD)) + 1


@dataclass(frozen=True, slots=True)
class ResyncSettings:
    #: --resync-interval: the interval of a fleet of up to 128 pods.
    base: float = 30.0


class ResyncSchedule:
    """The resync interval handed to each new on-change stream. It stretches as the fleet
    grows and never shrinks while the aggregator runs: a stream keeps the interval it was given,
    and the silence allowed to its pods (:attr:`kept_ttl`) must cover the longest one."""

    def __init__(self, settings: ResyncSettings) -> None:
        self._base = settings.base
        self.interval = settings.base

    def for_fleet(self, pods: int) -> float:
        """The interval for a stream opened now, with ``pods`` pods tracked or connected."""
        self.interval = max(self.interval, self._base * scale_factor(pods))
        return self.interval

    @property
    def kept_ttl(self) -> float:
        return MISSED_RESYNCS * self.interval
