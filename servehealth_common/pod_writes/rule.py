"""The one rule that decides whether a write is needed, and what a pod "carries" (pure; both
programs ask it: the aggregator's writer and backends, and an agent's fallback).

A pod carries a value for each thing that may be written: the serve label (label mode) and the
readiness-gate condition (condition mode). A write is needed exactly when the value wanted
differs from the value carried, where a pod *without* the label carries ``"false"``: a Service
that selects ``"true"`` skips it either way, so writing ``"false"`` to it would change nothing.
A pod without the condition carries nothing, and any wanted status is written (the condition's
reason and message tell people why the pod is not Ready).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

#: What a pod without the serve label counts as.
LABEL_ABSENT = "false"


class WriteKind(enum.Enum):
    """What a write changes: the serve label, or the readiness-gate condition."""

    LABEL = "label"
    CONDITION = "condition"


#: The condition of a pod with no Serve proxy by design: status ``True`` with this reason (the
#: pod is healthy; it merely is not an ingress). As a condition value (what a pod carries, what
#: is wanted), this word: it differs from a plain ``"True"``, so the reason gets written.
NO_PROXY_BY_DESIGN = "NoProxyByDesign"


def condition_status(label: str, *, by_design: bool = False) -> str:
    """The readiness-gate condition value that goes with a label value: ``"True"`` or
    ``"False"``; :data:`NO_PROXY_BY_DESIGN` for a pod with no proxy by design."""
    if by_design and label == "false":
        return NO_PROXY_BY_DESIGN
    return "True" if label == "true" else "False"


def condition_fields(value: str) -> tuple[str, str]:
    """The status and reason a condition value is written with (by the aggregator; an agent
    in fallback writes its own reason, :data:`servehealth_common.fallback_marks.
    CONDITION_REASON`)."""
    if value == NO_PROXY_BY_DESIGN:
        return "True", NO_PROXY_BY_DESIGN
    return value, "ServeProxyServing" if value == "True" else "ServeProxyNotServing"


def condition_value(status: str, reason: str) -> str:
    """The value of a condition as a pod carries it (its status and reason, as read)."""
    return NO_PROXY_BY_DESIGN if status == "True" and reason == NO_PROXY_BY_DESIGN else status


def conditions_of(conditions: Iterable[Mapping[str, Any]] | None) -> dict[str, str]:
    """A pod's ``status.conditions`` as it carries them: type -> :func:`condition_value`."""
    return {
        str(c.get("type", "")): condition_value(str(c.get("status", "")), c.get("reason", ""))
        for c in conditions or []
    }


def write_needed(kind: WriteKind, carried: str | None, wanted: str) -> bool:
    """Whether a pod carrying ``carried`` (None: absent) must be written to say ``wanted``."""
    if carried is None and kind is WriteKind.LABEL:
        carried = LABEL_ABSENT
    return carried != wanted


def earlier(uid: str, version: str, known_uid: str, known_version: str) -> bool:
    """Whether a reading of a pod (``uid``, ``resourceVersion``) is an earlier version of the
    same pod than the one known.

    resourceVersions are opaque to clients in general; every API server in use (etcd's
    revisions) makes them integers that grow with each write, and only then are they compared
    here. Anything else (or another uid: a new pod of the same name) counts as newer.
    """
    if uid != known_uid:
        return False
    return version.isdigit() and known_version.isdigit() and int(version) < int(known_version)
