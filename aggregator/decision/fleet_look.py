"""Deciding by looking: is a suspect failure a lone one, or part of a mass one?

When a pod turns UNHEALTHY or SILENT, the aggregator cannot tell from that pod alone whether
the pod failed or the aggregator itself is in trouble (a partition, an overloaded node, DNS):
both look like timeouts. Instead of waiting to see whether more pods fail, it looks: it probes
a bounded sample of the pods still in service, at once, with the pull timeout. Healthy proxies
answer in milliseconds, so a lone failure is told apart almost at once; a mass failure shows
itself within one pull timeout, when the hung sample's probes time out.

:class:`LookTally` is the pure half: the answers so far and the verdict they allow. The
probing is the puller's (:class:`Looker`); acting on the verdict is
:class:`aggregator.decision.self_protection.SelfProtection`'s.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

#: Failures a blind aggregator would also see; the only ones that count towards PANIC.
SUSPECT_BAD = frozenset({ServeState.UNHEALTHY, ServeState.SILENT})

#: Called with each looked-at pod and the state its proxy answered with.
OnLooked = Callable[[PodKey, ServeState], None]


class Looker(Protocol):
    """What looking needs of the pull fallback (:class:`aggregator.pull.puller.Puller`)."""

    def can_pull(self, key: PodKey) -> bool: ...

    def look(self, keys: Sequence[PodKey], on_looked: OnLooked) -> Callable[[], None]:
        """Probe each of ``keys`` at once; ``on_looked`` gets each answer as it comes. Returns
        a function that cancels the probes still in flight."""
        ...


class LookVerdict(enum.Enum):
    LONE = "lone"  # the failing pods are few: they may leave service
    MASS = "mass"  # too many pods fail at once: hold (PANIC)
    UNDECIDED = "undecided"  # wait for more answers


@dataclass(frozen=True, slots=True)
class Threshold:
    """When failures are too many: ``share`` of the tracked pods, and at least ``min_pods``
    (``--panic-threshold``, ``--panic-min-pods``); a share of 1 turns PANIC off."""

    share: float
    min_pods: int

    def reached(self, bad: float, tracked: int) -> bool:
        """Whether ``bad`` of ``tracked`` pods is too many (never, with a share of 1)."""
        return self.share < 1 and bad >= self.min_pods and bad >= self.share * tracked


@dataclass
class LookTally:
    """The answers of one look at ``sampled`` pods, drawn from ``pool_size`` pods in service.

    Each sampled pod stands for ``pool_size / len(sampled)`` pods of the pool. The verdict
    counts the pods the tracker already knows to be UNHEALTHY or SILENT, plus the pool's pods
    estimated from the sample: MASS as soon as the answers seen reach the threshold, LONE as
    soon as they cannot reach it even if every unanswered probe fails; undecided in between.
    Once every probe has answered (or timed out), the verdict is never undecided.
    """

    sampled: Sequence[PodKey]
    pool_size: int
    bad: set[PodKey] = field(default_factory=set)
    answered: set[PodKey] = field(default_factory=set)

    def record(self, key: PodKey, state: ServeState) -> None:
        self.answered.add(key)
        if state in SUSPECT_BAD:
            self.bad.add(key)

    def verdict(
        self,
        known_bad: int,
        tracked: int,
        threshold: Threshold,
        tracker_bad: Callable[[PodKey], bool],
    ) -> LookVerdict:
        """``known_bad`` of ``tracked`` pods are UNHEALTHY or SILENT in the tracker;
        ``tracker_bad`` says whether a sampled pod is one of them (it is not counted twice)."""
        scale = self.pool_size / len(self.sampled) if self.sampled else 0.0
        outside = known_bad  # bad in the tracker and not sampled
        seen_bad = pending = 0
        for key in self.sampled:
            if tracker_bad(key):
                outside -= 1
                seen_bad += 1
            elif key in self.bad:
                seen_bad += 1
            elif key not in self.answered:
                pending += 1
        low = outside + scale * seen_bad
        high = outside + scale * (seen_bad + pending)
        if threshold.reached(low, tracked):
            return LookVerdict.MASS
        if not threshold.reached(high, tracked):
            return LookVerdict.LONE
        return LookVerdict.UNDECIDED
