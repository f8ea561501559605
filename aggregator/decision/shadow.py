"""Shadow mode (``--dry-run``) and drift: what a pod carries against what the aggregator would
write, as a direction of traffic (pure).

What a pod *carries* is what the aggregator writes to it, as the pod shows it now:

- label mode: its serve label (absent counts as ``"false"``, as in
  :func:`~servehealth_common.pod_writes.rule.write_needed`);
- condition mode: its readiness-gate condition, for pods that declare the gate (the aggregator
  writes nothing to other pods, so they never disagree); in service when its status is True
  (``True``, or ``NoProxyByDesign``, which is True with that reason);
- ``both``: the label and, for gated pods, the condition; in service only when both are (a
  Service selecting the label sends traffic only to a Ready pod).

A pod *disagrees* ``in`` when what it carries keeps it out of service where what the aggregator
would write puts it in, and ``out`` the other way. A difference that moves no traffic (a
condition's reason, an absent label where ``false`` is wanted) is no disagreement, though the
writer may still write it. A removal PANIC holds is not wanted, so it is no disagreement either.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind, condition_fields, write_needed

log = logging.getLogger(__name__)

#: The direction of a disagreement (``serve_health_shadow_disagreements{direction}``).
IN = "in"
OUT = "out"
#: ``serve_health_would_be_writes_total{kind}``: what shadow mode did not write.
WOULD_BE_KINDS = ("label", "condition", "event", "lease")

#: (kind, carried now (None: absent), the value the aggregator would write) for one target.
Target = tuple[WriteKind, str | None, str]


@dataclass(frozen=True, slots=True)
class Disagreements:
    would_enter: int = 0
    would_leave: int = 0


def in_service(kind: WriteKind, value: str | None) -> bool:
    """Whether ``value`` of ``kind`` lets the pod receive traffic."""
    if value is None:
        return False
    if kind is WriteKind.LABEL:
        return value == "true"
    return condition_fields(value)[0] == "True"


@functools.lru_cache(maxsize=1024)  # (a handful of distinct ones: kinds and values)
def direction(targets: tuple[Target, ...]) -> str | None:
    """:data:`IN`, :data:`OUT`, or None (agreement, or nothing written to the pod)."""
    carried = all(in_service(kind, value) for kind, value, _ in targets)
    wanted = all(in_service(kind, value) for kind, _, value in targets)
    if wanted and not carried:
        return IN
    if carried and not wanted:
        return OUT
    return None


def shown(targets: Sequence[Target]) -> str:
    """``Pod.carried``: the label value, or in condition mode the condition's status, as the
    pod carries it ("" when absent, or when nothing is written to the pod). In ``both`` mode,
    the label, except ``"false"`` for a pod labelled ``"true"`` whose condition keeps it out."""
    if not targets:
        return ""
    kind, value, _ = targets[0]
    if kind is WriteKind.CONDITION:
        return condition_fields(value)[0] if value is not None else ""
    if value == "true" and not all(in_service(k, v) for k, v, _ in targets):
        return "false"
    return value or ""


def tally(directions: Iterable[str | None]) -> Disagreements:
    counted = Counter(directions)
    return Disagreements(counted[IN], counted[OUT])


class WouldBeWrites:
    """Shadow mode's writer: remembers the value each target would be written with, and counts
    (``count(kind)``) and logs (debug) each new one instead of writing it. A target the pod
    already carries the value of needs no write, as for :class:`~aggregator.kube.writer.Writer`;
    a value wanted again while nothing changed is not counted again."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._values: dict[tuple[PodKey, WriteKind], str] = {}

    def want(self, key: PodKey, kind: WriteKind, carried: str | None, value: str) -> bool:
        """True if a write would now be pending for the target (the pod carries another value)."""
        target = (key, kind)
        if not write_needed(kind, carried, value):
            self._values.pop(target, None)
            return False
        if self._values.get(target) != value:
            self._values[target] = value
            self._count(kind.value)
            log.debug("dry run: would write %s %r on pod %s", kind.value, value, key)
        return True

    def event(self, key: PodKey, what: str) -> None:
        self._count("event")
        log.debug("dry run: would record an Event on pod %s (%s)", key, what)

    def forget(self, key: PodKey) -> None:
        for kind in WriteKind:
            self._values.pop((key, kind), None)

    @property
    def pending(self) -> int:
        """Targets that would be written (the pod carries another value)."""
        return len(self._values)


class ShadowView:
    """What inspection and metrics read of shadow mode and drift: the figures are counted when
    asked (a scrape, a GetSummary), from the core's wanted labels and the registry's targets
    (one desired state per pod: a GetSummary polled every 20 ms over 1,000 pods is a fifth of
    a core with two)."""

    def __init__(
        self,
        dry_run: bool,
        keys: Callable[[], Iterable[PodKey]],
        health: Callable[[PodKey], str | None],
        targets: Callable[[PodKey, str | None], tuple[Target, ...]],
    ) -> None:
        self.dry_run = dry_run
        self._keys = keys
        self._health = health
        self._targets = targets

    def disagreements(self) -> Disagreements:
        """Pods whose carried value differs, in traffic, from what the aggregator would write;
        a pod whose removal PANIC holds (or a look awaits) is not wanted out, so not counted
        (it has no targets, unless an override decides for it)."""
        return tally(direction(self._targets(key, self._health(key))) for key in self._keys())

    def carried(self, key: PodKey) -> str:
        """``Pod.carried``: what the pod carries now ("" when absent)."""
        return shown(self._targets(key, "false"))
