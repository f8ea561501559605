"""The bodies of pod writes and their Events, as both programs send them (pure): the
aggregator's writer and an agent's fallback differ only in what they pass (who they are, the
condition's reason, the marks, an agent's resourceVersion precondition)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.times import api_time

#: The longest condition message written (both programs' reasons can be long).
CONDITION_MESSAGE_MAX = 512
#: The longest Event message written.
EVENT_MESSAGE_MAX = 1024


def _precondition(version: str) -> dict[str, str]:
    """The pod's resourceVersion the write was decided on ("": none; else 409 if it changed)."""
    return {"resourceVersion": version} if version else {}


def label_patch(
    label_key: str,
    value: str,
    *,
    annotations: Mapping[str, str | None] | None = None,
    version: str = "",
) -> dict[str, Any]:
    """The JSON merge patch of the serve label (on the pod), with ``annotations`` beside it
    (None values remove one) and ``version`` as a precondition."""
    metadata: dict[str, Any] = {**_precondition(version), "labels": {label_key: value}}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"metadata": metadata}


def condition_patch(
    condition_type: str,
    status: str,
    reason: str,
    message: str,
    when: datetime.datetime,
    *,
    version: str = "",
) -> dict[str, Any]:
    """The strategic merge patch of the readiness-gate condition (on ``pods/status``)."""
    condition = {
        "type": condition_type,
        "status": status,
        "reason": reason,
        "message": message[:CONDITION_MESSAGE_MAX],
        "lastTransitionTime": api_time(when),
    }
    body: dict[str, Any] = {"status": {"conditions": [condition]}}
    if version:
        body["metadata"] = _precondition(version)
    return body


def event_body(
    key: PodKey,
    uid: str,
    *,
    reason: str,
    message: str,
    kind: str,
    component: str,
    instance: str,
    when: datetime.datetime,
) -> dict[str, Any]:
    """An Event on the pod (``kind``: ``Normal`` or ``Warning``), from ``component``."""
    return {
        "metadata": {"generateName": f"{key.name}.", "namespace": key.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": key.namespace,
            "name": key.name,
            "uid": uid,
        },
        "reason": reason,
        "message": message[:EVENT_MESSAGE_MAX],
        "type": kind,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance[:128],
        "firstTimestamp": api_time(when),
        "lastTimestamp": api_time(when),
        "count": 1,
    }
