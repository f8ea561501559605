"""The writes PANIC holds: when a removal is held, what is logged, and what PANIC ends with.

The :class:`~aggregator.panic.PanicDetector` decides whether too much of the fleet failed at
once; this module holds the removals while it says so. PANIC, as operators see it (the log
line, ``serve_health_panic``, ``GetSummary.panic``), is *holding at least one write*, never a
suspicion that held nothing, and always says how many writes it holds.
"""

from __future__ import annotations

import logging

from aggregator.metrics import Metrics
from aggregator.panic import PanicDetector
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

log = logging.getLogger(__name__)

#: Failures a blind aggregator would also see; the only ones that count towards PANIC.
SUSPECT_BAD = frozenset({ServeState.UNHEALTHY, ServeState.SILENT})


class HeldWrites:
    def __init__(self, detector: PanicDetector, metrics: Metrics, min_pods: int) -> None:
        self._detector = detector
        self._metrics = metrics
        self._min_pods = min_pods
        self._held: set[PodKey] = set()

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, label: str) -> bool:
        """Whether a write of ``label`` must be held now (a removal, during PANIC)."""
        return label == "false" and self._detector.panic

    def hold(self, key: PodKey) -> None:
        """Hold the removal of ``key``; the first one held announces PANIC."""
        first = not self._held
        self._held.add(key)
        self._changed()
        if not first:
            log.info("PANIC: holding the removal of pod %s too (%d held)", key, len(self._held))
            return
        detector = self._detector
        log.warning(
            "PANIC: holding a write that would take pod %s out of service: more than %.0f%% of "
            "tracked pods turned UNHEALTHY or SILENT, most within %gs; suspecting the "
            "aggregator itself (partition, API or DNS trouble). Every such write is held until "
            "the share falls to %.0f%% or below",
            key,
            detector.threshold * 100,
            detector.window,
            detector.threshold * 100,
        )

    def drop(self, key: PodKey) -> None:
        """``key`` no longer needs its held write (it recovered, or it is gone)."""
        if key in self._held:
            self._held.discard(key)
            self._changed()

    def judge(self, counts: dict[ServeState, int], total: int) -> set[PodKey]:
        """Re-judge PANIC with the fleet's ``counts`` (``total`` pods tracked); the keys whose
        held writes must be applied now (PANIC ended), else an empty set."""
        bad = sum(counts[state] for state in SUSPECT_BAD)
        tracked = total - counts[ServeState.UNKNOWN]
        detector = self._detector
        if bad < self._min_pods and not detector.panic:
            return set()
        if not detector.update(bad, tracked):
            return set()
        if detector.panic:
            log.info(
                "%d of %d pods turned UNHEALTHY or SILENT within %gs: writes that would take a "
                "pod out of service are held from now on (PANIC once one is)",
                bad,
                tracked,
                detector.window,
            )
            return set()
        held, self._held = self._held, set()
        self._changed()
        if held:
            log.warning(
                "panic over: %d of %d pods UNHEALTHY or SILENT; applying the %d held writes",
                bad,
                tracked,
                len(held),
            )
        else:
            log.info("%d of %d pods UNHEALTHY or SILENT: no longer holding writes", bad, tracked)
        return held

    def _changed(self) -> None:
        self._metrics.panic.set(int(bool(self._held)))
        self._metrics.panic_held_writes.set(len(self._held))
