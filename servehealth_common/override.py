"""The manual override annotation as read (pure), shared by the aggregator and the agents.

``ray-serve-health/override: out-of-service`` takes a pod out of service whatever its health,
``in-service`` keeps it in service; any other value is ignored (surrounding blanks aside), by
the aggregator (:mod:`aggregator.decision.override`: one warning Event per value seen) and by
the agents in fallback alike: a pod annotated ``maintenance`` is judged by its health.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ANNOTATION = "ray-serve-health/override"
OUT_OF_SERVICE = "out-of-service"
IN_SERVICE = "in-service"
#: The label value each override wants.
LABELS = {OUT_OF_SERVICE: "false", IN_SERVICE: "true"}
VALUES = tuple(LABELS)


@dataclass(frozen=True, slots=True)
class Override:
    """A pod's annotation as read: ``value`` when honoured, ``ignored`` the raw text of an
    annotation that is not one of :data:`VALUES` (None: none, or honoured)."""

    value: str | None = None
    ignored: str | None = None

    @classmethod
    def parse(cls, raw: str | None) -> Override:
        if raw is None:
            return NONE
        if raw.strip() in LABELS:
            return cls(value=raw.strip())
        return cls(ignored=raw)

    @classmethod
    def of(cls, annotations: Mapping[str, str] | None) -> Override:
        """The override of a pod with these ``metadata.annotations``."""
        raw = (annotations or {}).get(ANNOTATION)
        return cls.parse(None if raw is None else str(raw))

    @property
    def label(self) -> str | None:
        """The label this override wants (None: none, the pod's health decides)."""
        return LABELS[self.value] if self.value is not None else None


NONE = Override()
