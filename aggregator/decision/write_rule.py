"""The one rule that decides whether a write is needed, and what a pod "carries".

A pod carries a value for each thing the aggregator may write: the serve label (label mode)
and the readiness-gate condition (condition mode). A write is needed exactly when the value
wanted differs from the value carried, where a pod *without* the label carries ``"false"``: a
Service that selects ``"true"`` skips it either way, so writing ``"false"`` to it would change
nothing. A pod without the condition carries nothing, and any wanted status is written (the
condition's reason and message tell people why the pod is not Ready).

Every backend and the writer ask :func:`write_needed`; nothing else compares the two values.
"""

from __future__ import annotations

import enum

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
    """The status and reason a condition value is written with."""
    if value == NO_PROXY_BY_DESIGN:
        return "True", NO_PROXY_BY_DESIGN
    return value, "ServeProxyServing" if value == "True" else "ServeProxyNotServing"


def condition_value(status: str, reason: str) -> str:
    """The value of a condition as a pod carries it (its status and reason, as read)."""
    return NO_PROXY_BY_DESIGN if status == "True" and reason == NO_PROXY_BY_DESIGN else status


def write_needed(kind: WriteKind, carried: str | None, wanted: str) -> bool:
    """Whether a pod carrying ``carried`` (None: absent) must be written to say ``wanted``."""
    if carried is None and kind is WriteKind.LABEL:
        carried = LABEL_ABSENT
    return carried != wanted
