"""The bodies of an agent's fallback writes (pure): the patch of a label or a condition, with
the marks of an agent's write (:mod:`servehealth_common.fallback_marks`) and the pod's
resourceVersion as a precondition, and the Event that records it."""

from __future__ import annotations

import datetime
from typing import Any

from node_agent.fallback.rules import Write
from servehealth_common import fallback_marks as marks
from servehealth_common.pod_writes import bodies
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.pod_writes.times import micro_time

COMPONENT = "ray-serve-health-agent"
#: Values that put a pod in service (an Event of type Normal; the others are Warnings).
IN_SERVICE = frozenset({"true", "True"})


def write_body(write: Write, who: str, when: datetime.datetime) -> dict[str, Any]:
    """The patch of ``write``: a label with its annotation (its time with microseconds, as a
    Lease's renewal, which an aggregator taking over compares it with), or a condition with the
    agents' reason; with the pod's resourceVersion it was decided on as a precondition (409 if
    the pod changed)."""
    if write.kind is WriteKind.LABEL:
        mark = marks.annotation_value(micro_time(when), who)
        annotations = {marks.ANNOTATION: mark}
        return bodies.label_patch(
            write.name, write.value, annotations=annotations, version=write.version
        )
    message = f"{marks.WHY}: written by the agent {who} ({write.cause})"
    return bodies.condition_patch(
        write.name, write.value, marks.CONDITION_REASON, message, when, version=write.version
    )


def event_body(write: Write, who: str, when: datetime.datetime) -> dict[str, Any]:
    message = (
        f"{marks.WHY}: the agent {who} wrote {write.kind.value} {write.name}={write.value} "
        f"({write.cause})"
    )
    return bodies.event_body(
        write.key,
        write.uid,
        reason=marks.EVENT_REASON,
        message=message,
        kind="Normal" if write.value in IN_SERVICE else "Warning",
        component=COMPONENT,
        instance=who,
        when=when,
    )
