"""The bodies of an agent's fallback writes (pure): the patch of a label or a condition, with
the marks of an agent's write (:mod:`servehealth_common.fallback_marks`) and the pod's
resourceVersion as a precondition, and the Event that records it."""

from __future__ import annotations

import datetime
from typing import Any

from node_agent.fallback.rules import Kind, Write
from servehealth_common import fallback_marks as marks

COMPONENT = "ray-serve-health-agent"
#: Values that put a pod in service (an Event of type Normal; the others are Warnings).
IN_SERVICE = frozenset({"true", "True"})


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def rfc3339(when: datetime.datetime) -> str:
    """Whole seconds, as the API keeps a condition's and an Event's times."""
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def write_body(write: Write, who: str, when: datetime.datetime) -> dict[str, Any]:
    """The patch of ``write``: a label with its annotation (its time with microseconds, as a
    Lease's renewal, which an aggregator taking over compares it with), or a condition; with
    the pod's resourceVersion it was decided on as a precondition (409 if the pod changed)."""
    precondition = {"resourceVersion": write.version} if write.version else {}
    if write.kind is Kind.LABEL:
        mark = marks.annotation_value(marks.micro_time(when), who)
        return {
            "metadata": {
                **precondition,
                "labels": {write.name: write.value},
                "annotations": {marks.ANNOTATION: mark},
            }
        }
    condition = {
        "type": write.name,
        "status": write.value,
        "reason": marks.CONDITION_REASON,
        "message": f"{marks.WHY}: written by the agent {who} ({write.state.name}: {write.reason})"[
            :512
        ],
        "lastTransitionTime": rfc3339(when),
    }
    body: dict[str, Any] = {"status": {"conditions": [condition]}}
    if precondition:
        body["metadata"] = precondition
    return body


def event_body(write: Write, who: str, when: datetime.datetime) -> dict[str, Any]:
    key = write.key
    message = (
        f"{marks.WHY}: the agent {who} wrote {write.kind.value} {write.name}={write.value} "
        f"({write.state.name}: {write.reason})"
    )
    return {
        "metadata": {"generateName": f"{key.name}.", "namespace": key.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": key.namespace,
            "name": key.name,
            "uid": write.uid,
        },
        "reason": marks.EVENT_REASON,
        "message": message[:1024],
        "type": "Normal" if write.value in IN_SERVICE else "Warning",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": who[:128],
        "firstTimestamp": rfc3339(when),
        "lastTimestamp": rfc3339(when),
        "count": 1,
    }
