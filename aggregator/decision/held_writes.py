"""The writes PANIC holds, and what operators see of them.

:class:`~aggregator.decision.self_protection.SelfProtection` decides when a removal must be held;
this module keeps the held pods and says so. PANIC, as operators see it (the log line,
``serve_health_panic``, ``GetSummary.panic``), is *holding at least one write*, never a
suspicion that held nothing, and always says how many writes it holds.
"""

from __future__ import annotations

import logging

from aggregator.metrics import Metrics
from servehealth_common.pod_identity import PodKey

log = logging.getLogger(__name__)


class HeldWrites:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._held: set[PodKey] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def hold(self, key: PodKey, why: str) -> None:
        """Hold the removal of ``key`` (``why``: the cause, for the log); the first one held
        announces PANIC."""
        if key in self._held:
            return
        first = not self._held
        self._held.add(key)
        self._changed()
        if first:
            log.warning(
                "PANIC: holding a write that would take pod %s out of service: %s; suspecting "
                "the aggregator itself (partition, API or DNS trouble). Such writes are held "
                "until fewer pods fail",
                key,
                why,
            )
        else:
            log.info("PANIC: holding the removal of pod %s too (%d held)", key, len(self._held))

    def drop(self, key: PodKey) -> None:
        """``key`` no longer needs its held write (it recovered, or it is gone)."""
        if key in self._held:
            self._held.discard(key)
            self._changed()

    def release_all(self) -> set[PodKey]:
        """PANIC is over: every held key, to be judged again; none is held any longer."""
        held, self._held = self._held, set()
        self._changed()
        return held

    def _changed(self) -> None:
        self._metrics.panic.set(int(bool(self._held)))
        self._metrics.panic_held_writes.set(len(self._held))
