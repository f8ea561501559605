"""The panic detector: when too much of the fleet looks bad at once, suspect the aggregator.

Pure state with an injected clock. The rule (anchors: Envoy's ``healthy_panic_threshold``,
50 % by default, and Kubernetes' node lifecycle controller, which stops evicting in a zone in
"full disruption"):

- A pod is *suspect-bad* when it is UNHEALTHY (timeouts, broken answers) or SILENT: failures
  that a partitioned or overloaded aggregator would also see. A 503 (NOT_READY, DRAINING) or a
  refused connection (NO_PROXY) is a pod answering for itself and never counts.
- PANIC begins when more than ``threshold`` of the tracked pods (UNKNOWN excluded) are
  suspect-bad *and* most of them turned so within one ``window`` (the heartbeat TTL): a sudden
  mass failure, not a slow decline.
- PANIC ends when the share falls back to ``threshold`` or below.

While in PANIC, the core holds every write that would take a pod out of service ("fail
static"); writes that put pods back go on. When PANIC ends, the held writes are applied from
what the probes show then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class PanicDetector:
    """Whether the aggregator is in PANIC; fed by the core, read by the core (no I/O)."""

    def __init__(self, threshold: float, window: float, clock: Callable[[], float]) -> None:
        self.threshold = threshold
        self.window = window
        self._clock = clock
        self._entries: deque[float] = deque()  # when pods turned suspect-bad, oldest first
        self.panic = False

    def turned_bad(self) -> None:
        """A pod just became suspect-bad."""
        self._entries.append(self._clock())

    def recent(self) -> int:
        """How many pods turned suspect-bad within the window."""
        horizon = self._clock() - self.window
        entries = self._entries
        while entries and entries[0] < horizon:
            entries.popleft()
        return len(entries)

    def update(self, bad: int, tracked: int) -> bool:
        """Re-evaluate with ``bad`` suspect-bad pods out of ``tracked``; True if PANIC changed."""
        share = bad / tracked if tracked else 0.0
        if not self.panic:
            if share > self.threshold and self.recent() * 2 > bad:
                self.panic = True
                return True
        elif share <= self.threshold:
            self.panic = False
            return True
        return False
