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


def condition_status(label: str) -> str:
    """The readiness-gate condition status that goes with a label value."""
    return "True" if label == "true" else "False"


def write_needed(kind: WriteKind, carried: str | None, wanted: str) -> bool:
    """Whether a pod carrying ``carried`` (None: absent) must be written to say ``wanted``."""
    if carried is None and kind is WriteKind.LABEL:
        carried = LABEL_ABSENT
    return carried != wanted
