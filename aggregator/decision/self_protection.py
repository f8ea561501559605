"""Self-protection: a failure that looks like the aggregator's own fault never empties the
Service.

A pod that turns UNHEALTHY or SILENT (a *suspect* failure: timeouts and silence are what a
partitioned or overloaded aggregator would also see) does not leave service on its own word.
The aggregator looks at a sample of the pods still in service
(:mod:`aggregator.decision.fleet_look`):

- **lone** (the failing pods stay below ``threshold`` of the tracked pods even if every probe
  still unanswered fails): the pod leaves service at once;
- **mass** (the failing pods reach ``threshold``, at least ``min_pods``): PANIC. Every removal
  of a suspect pod is held ("fail static"), and pods a suspect failure took out within
  ``restore_window`` before (one pull interval: the first signs of the same mass failure, seen
  before the rest) are put back in service.

Whatever the verdicts, pods out of service for a suspect failure never reach ``threshold`` of
the tracked pods (a cap, like Envoy outlier detection's ``max_ejection_percent``): a removal
that would reach it begins PANIC instead. PANIC ends when the failing pods fall below the
threshold and a look at the pods in service agrees; the held removals are then judged again.
Failures a proxy reports itself (503, refused, draining) are never held.

Pure logic with an injected clock (the tracker's); the probes are the puller's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from aggregator.decision.fleet_look import SUSPECT_BAD, Looker, LookTally, LookVerdict, Threshold
from aggregator.decision.held_writes import HeldWrites
from aggregator.decision.tracker import StateChange, Tracker
from aggregator.metrics import Metrics
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

log = logging.getLogger(__name__)

#: Make ``key`` carry ``label``: :meth:`aggregator.registry.PodRegistry.desire`.
Write = Callable[[PodKey, str, StateChange | None], None]


@dataclass(frozen=True, slots=True)
class ProtectionSettings:
    threshold: float = 0.5
    min_pods: int = 3
    #: Pods in service probed by one look at most (a random sample of them beyond this).
    look_sample: int = 100
    #: When PANIC begins, pods a suspect failure took out this recently are put back.
    restore_window: float = 5.0


class SelfProtection:
    def __init__(
        self,
        fleet: Tracker,
        looker: Looker,
        write: Write,
        metrics: Metrics,
        settings: ProtectionSettings,
    ) -> None:
        self._fleet = fleet
        self._looker = looker
        self._write = write
        self._metrics = metrics
        self._settings = settings
        self._threshold = Threshold(settings.threshold, settings.min_pods)
        self._rng = random.Random()
        self._held = HeldWrites(metrics)
        self._suspecting = False  # PANIC's rule holds; visible once a write is held
        self._why = ""  # what began it, for the log line of the first write held
        self._pending: dict[PodKey, StateChange] = {}  # suspect removals awaiting a verdict
        self._removed_at: dict[PodKey, float] = {}  # suspect removals applied, and when
        # Removals held until PANIC ended, and when it did: each waits for a fresh failure.
        self._stale: dict[PodKey, float] = {}
        #: Pods put back into service when PANIC began, held there until it ends.
        self._restored: set[PodKey] = set()
        self._tally: LookTally | None = None
        self._cancel_look: Callable[[], None] | None = None

    # -- what the core asks -------------------------------------------------------------

    @property
    def held(self) -> int:
        """Removals held by PANIC now (PANIC, as operators see it, when not 0)."""
        return len(self._held)

    def wanted(self, key: PodKey) -> str | None:
        """The label the pod should carry (what the writer writes, level-triggered): ``"true"``
        for a pod put back into service when PANIC began, until PANIC ends; None while its
        removal is held or awaits a verdict (the pod keeps what it carries)."""
        if key in self._restored:
            return "true"
        if key in self._held or key in self._pending or key in self._stale:
            return None
        record = self._fleet.get(key)
        return record.desired_label if record is not None else None

    def remove(self, key: PodKey, transition: StateChange) -> None:
        """A suspect failure asks to take ``key`` out of service."""
        if self._suspecting:
            self._held.hold(key, self._why)
        elif len(self._fleet) < self._threshold.min_pods:
            self._release(key, transition)  # too few pods to ever panic
        else:
            self._pending[key] = transition
            if self._tally is None:
                self._start_look()
            self._decide()

    def desire(self, key: PodKey, label: str, transition: StateChange | None = None) -> None:
        """Any other write: a recovery, or a failure the proxy reports itself."""
        record = self._fleet.get(key)
        if (
            label == "false"
            and self._suspecting
            and record is not None
            and record.state in SUSPECT_BAD
        ):
            self._held.hold(key, self._why)
            return
        self._pending.pop(key, None)
        self._stale.pop(key, None)
        self._held.drop(key)
        self._restored.discard(key)
        if label != "false":
            self._removed_at.pop(key, None)
        self._write(key, label, transition)

    def counts_changed(self) -> None:
        """Pods turned UNHEALTHY or SILENT, or stopped being so: judge PANIC again."""
        bad, tracked = self._bad_and_tracked()
        if not self._suspecting:
            if self._threshold.reached(bad, tracked):
                self._begin_panic(f"{bad} of {tracked} pods are UNHEALTHY or SILENT")
            else:
                self._decide()  # a look may be decidable now
        elif not self._threshold.reached(bad, tracked):
            if self._tally is None:
                self._start_look()  # before PANIC ends, look whether the fleet agrees
            self._decide()

    def forget(self, key: PodKey) -> None:
        """The pod is gone (or no longer tracked)."""
        self._pending.pop(key, None)
        self._stale.pop(key, None)
        self._held.drop(key)
        self._restored.discard(key)
        self._removed_at.pop(key, None)
        self.counts_changed()

    def tick(self) -> None:
        """Removals held until PANIC ended go through once a fresh observation (after the
        end) still shows the failure; a pod healing (a success since) waits for its
        transition."""
        for key, since in list(self._stale.items()):
            record = self._fleet.get(key)
            if record is None or record.state not in SUSPECT_BAD:
                del self._stale[key]
            elif (
                record.observed_at is not None
                and record.observed_at > since
                and record.streak == 0  # the fresh observation failed too
            ):
                del self._stale[key]
                self._release(key, None)

    # -- looking ------------------------------------------------------------------------

    def _start_look(self) -> None:
        looker = self._looker
        pool = [
            record.key
            for record in self._fleet.records()
            if record.state is ServeState.SERVING
            and record.key not in self._pending
            and looker.can_pull(record.key)
        ]
        limit = self._settings.look_sample
        sample = pool if len(pool) <= limit else self._rng.sample(pool, limit)
        tally = self._tally = LookTally(sample, len(pool))
        if sample:
            self._cancel_look = looker.look(
                sample, lambda key, state: self._looked(tally, key, state)
            )

    def _looked(self, tally: LookTally, key: PodKey, state: ServeState) -> None:
        if tally is self._tally:
            tally.record(key, state)
            self._decide()

    def _decide(self) -> None:
        tally = self._tally
        if tally is None:
            return
        bad, tracked = self._bad_and_tracked()
        verdict = tally.verdict(bad, tracked, self._threshold, self._tracker_bad)
        if verdict is LookVerdict.UNDECIDED:
            return
        self._tally = None
        cancel, self._cancel_look = self._cancel_look, None
        if cancel is not None:
            cancel()  # the unanswered probes cannot change the verdict
        self._metrics.panic_looks.labels(verdict.value).inc()
        if verdict is LookVerdict.MASS:
            self._begin_panic(
                f"{bad} of {tracked} pods are UNHEALTHY or SILENT, and {len(tally.bad)} of "
                f"{len(tally.sampled)} pods in service looked at failed too"
            )
            return
        if self._suspecting:
            self._end_panic(bad, tracked)
        pending, self._pending = self._pending, {}
        for key, transition in pending.items():
            self._release(key, transition)

    def _tracker_bad(self, key: PodKey) -> bool:
        record = self._fleet.get(key)
        return record is not None and record.state in SUSPECT_BAD

    def _bad_and_tracked(self) -> tuple[int, int]:
        counts = self._fleet.counts()
        bad = sum(counts[state] for state in SUSPECT_BAD)
        return bad, len(self._fleet) - counts[ServeState.UNKNOWN]

    # -- writes -------------------------------------------------------------------------

    def _release(self, key: PodKey, transition: StateChange | None) -> None:
        """Take ``key`` out of service for a suspect failure, unless that reaches the cap."""
        if self._suspecting:
            self._held.hold(key, self._why)
            return
        bad, tracked = self._bad_and_tracked()
        # Suspect pods still in service: held, awaiting a verdict, or a fresh failure.
        waiting = len(self._held) + len(self._pending) + len(self._stale)
        out = bad - waiting  # ``key`` included
        if self._threshold.reached(out, tracked):
            self._begin_panic(f"taking pod {key} out would leave {out} of {tracked} pods out")
            self._held.hold(key, self._why)
            return
        self._removed_at[key] = self._fleet.now()
        self._write(key, "false", transition)

    def _begin_panic(self, why: str) -> None:
        if self._suspecting:
            return
        self._suspecting = True
        self._why = why
        log.info("%s: writes that would take a pod out of service are held from now on", why)
        pending, self._pending = self._pending, {}
        for key in pending:
            self._held.hold(key, self._why)
        now, window = self._fleet.now(), self._settings.restore_window
        recent = [key for key, at in self._removed_at.items() if now - at <= window]
        self._removed_at.clear()
        for key in recent:
            if self._tracker_bad(key):
                log.warning(
                    "PANIC: pod %s, taken out of service within the last %gs for a suspect "
                    "failure, is put back (the first sign of the same mass failure)",
                    key,
                    window,
                )
                self._metrics.panic_restored.inc()
                self._restored.add(key)
                self._write(key, "true", None)
                self._held.hold(key, self._why)

    def _end_panic(self, bad: int, tracked: int) -> None:
        self._suspecting = False
        self._restored.clear()
        held = self._held.release_all()
        if held:
            log.warning(
                "panic over: %d of %d pods UNHEALTHY or SILENT; judging the %d held writes",
                bad,
                tracked,
                len(held),
            )
        else:
            log.info("%d of %d pods UNHEALTHY or SILENT: no longer holding writes", bad, tracked)
        # What was held is as old as PANIC: each held removal waits for a fresh look.
        now = self._fleet.now()
        recheck = []
        for key in held:
            record = self._fleet.get(key)
            if record is None:
                continue
            if record.state in SUSPECT_BAD:
                self._stale[key] = now
                if self._looker.can_pull(key):
                    recheck.append(key)
            else:
                self._write(key, record.desired_label, None)
        if recheck:
            self._looker.look(recheck, self._rechecked)

    def _rechecked(self, key: PodKey, state: ServeState) -> None:
        """A pod held until PANIC ended, looked at again: still failing, it leaves service."""
        if key in self._stale and state in SUSPECT_BAD and self._tracker_bad(key):
            del self._stale[key]
            self._release(key, None)
