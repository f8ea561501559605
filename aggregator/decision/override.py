"""The manual override: a pod annotation that overrules the pod's health (pure).

``ray-serve-health/override: out-of-service`` takes the pod out of service whatever its health
(maintenance, debugging); PANIC does not hold it. ``in-service`` keeps the pod in service
whatever its health (a false negative, in an emergency). Any other value is ignored (one
warning Event and a log line per value seen); taking the annotation off returns the pod to what
its health says.

The override changes only what is written (the label, the condition: what the pod should carry
is :func:`servehealth_common.pod_writes.desired.desired`'s, the override's rule first) and what
inspection calls the wanted value; the probed state goes on being tracked, and shown, as if
there were none.
Kubernetes pods carry it (:mod:`aggregator.kube.registry`); the memory backend has no
annotations.
"""

from __future__ import annotations

from dataclasses import dataclass

# The annotation as read is shared with the agents, which ignore what the aggregator ignores.
from servehealth_common.override import ANNOTATION, IN_SERVICE, OUT_OF_SERVICE, Override


@dataclass(frozen=True, slots=True)
class OverrideChange:
    """What changed between two readings of a pod's annotation, for its Event and log line:
    ``kind`` is ``applied``, ``removed`` or ``ignored``."""

    kind: str
    message: str

    @property
    def warning(self) -> bool:
        return self.kind == "ignored"


def change(before: Override, after: Override) -> OverrideChange | None:
    """The change from ``before`` to ``after`` worth an Event, or None (the same override, the
    same ignored value)."""
    if after.value is not None and after.value != before.value:
        return OverrideChange(
            "applied",
            f"{ANNOTATION}={after.value}: the pod is kept {_where(after.value)} whatever its "
            "health",
        )
    if after.value is None and before.value is not None:
        why = f" (its new value {after.ignored!r} is not one)" if after.ignored is not None else ""
        return OverrideChange(
            "removed",
            f"{ANNOTATION}={before.value} removed{why}: the pod's health decides again",
        )
    if after.ignored is not None and after.ignored != before.ignored:
        return OverrideChange(
            "ignored",
            f"{ANNOTATION}={after.ignored[:100]!r} ignored: the value must be "
            f"{OUT_OF_SERVICE!r} or {IN_SERVICE!r}",
        )
    return None


def reason(override: Override, probed: str) -> str:
    """The reason inspection shows for an overridden pod: the override, then the probe's."""
    return f"override {override.value} ({ANNOTATION}); probed: {probed}"


def _where(value: str) -> str:
    return "out of service" if value == OUT_OF_SERVICE else "in service"
