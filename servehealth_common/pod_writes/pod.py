"""A pod as both programs read it to decide a write (pure): one view of what it carries, parsed
once from its JSON.

:class:`WritablePod` is what the aggregator's Kubernetes backend holds of each pod
(``aggregator.kube.pods.KubePod`` keeps it beside what only the aggregator needs: the pod's
address and ports, its dashboard, the kubelet's probes) and what an agent's fallback holds of
its own pods (``node_agent.fallback.rules.PodFacts`` is this class): who the pod is, which
version of it was read, what it carries (:meth:`WritablePod.carried`, as the write rule reads
it: :mod:`.rule`), its readiness gates, the manual override and the marks an agent's fallback
write leaves. A sidecar that is told its pod by the aggregator (``AggregatorMessage.pod``)
gets the same pod narrowed to the aggregator's label and condition
(:meth:`WritablePod.through`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from servehealth_common import fallback_marks
from servehealth_common.override import NONE, Override
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind, conditions_of, earlier
from servehealth_common.pod_writes.times import parse_time


@dataclass(frozen=True, slots=True)
class WritablePod:
    """One pod as read from the API: who it is, and what it carries now."""

    key: PodKey
    uid: str
    node_name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Condition type -> ``"True"``, ``"False"``, ``"Unknown"`` (or ``NoProxyByDesign``:
    #: ``True`` with that reason, :func:`~servehealth_common.pod_writes.rule.condition_value`).
    conditions: Mapping[str, str] = field(default_factory=dict)
    readiness_gates: frozenset[str] = frozenset()
    #: Whether the pod is under a manual override that is honoured (``in-service``,
    #: ``out-of-service``; another value is ignored by both programs). Read from
    #: :attr:`override`; a pod told by an aggregator of an earlier release knows only this.
    overridden: bool = False
    resource_version: str = ""
    #: Its ``ray-serve-health/override`` annotation, as read (a view keeps the honoured one).
    override: Override = NONE
    #: When an agent in fallback last wrote it (:func:`fallback_mark`), or None.
    fallback_mark: datetime.datetime | None = None
    #: Whether it carries the annotation of an agent's label write
    #: (:data:`servehealth_common.fallback_marks.ANNOTATION`).
    fallback_annotated: bool = False

    def __post_init__(self) -> None:
        if self.override.value is not None and not self.overridden:
            raise ValueError(f"pod {self.key}: override {self.override.value} is honoured")

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> WritablePod:
        """The pod of a Pod object's JSON (as the API, a watch or a write's answer gives it)."""
        metadata = pod.get("metadata") or {}
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        annotations = metadata.get("annotations") or {}
        override = Override.of(annotations)
        return cls(
            key=PodKey(metadata.get("namespace", ""), metadata.get("name", "")),
            uid=str(metadata.get("uid", "")),
            node_name=str(spec.get("nodeName", "") or ""),
            labels=dict(metadata.get("labels") or {}),
            conditions=conditions_of(status.get("conditions")),
            readiness_gates=frozenset(
                str(gate.get("conditionType", "")) for gate in spec.get("readinessGates") or []
            ),
            overridden=override.value is not None,
            resource_version=str(metadata.get("resourceVersion", "")),
            override=override,
            fallback_mark=fallback_mark(pod),
            fallback_annotated=fallback_marks.ANNOTATION in annotations,
        )

    def carried(self, kind: WriteKind, name: str) -> str | None:
        """What the pod carries for ``kind`` (the label ``name``, or the condition of type
        ``name``; None: absent; the write rule counts a missing label as ``"false"``)."""
        if kind is WriteKind.LABEL:
            return self.labels.get(name)
        return self.conditions.get(name)

    def carrying(self, kind: WriteKind, name: str, value: str) -> WritablePod:
        """This pod once a write of ``value`` succeeded, when the API's answer did not show it
        (the same version: a later one is read, or watched, as any)."""
        if kind is WriteKind.LABEL:
            return replace(self, labels={**self.labels, name: value})
        return replace(self, conditions={**self.conditions, name: value})

    def earlier_than(self, known: WritablePod) -> bool:
        """Whether this reading is an earlier version of the same pod than ``known``
        (:func:`~servehealth_common.pod_writes.rule.earlier`: resourceVersions compared only
        when both are integers of the same pod; anything else counts as newer)."""
        return earlier(self.uid, self.resource_version, known.uid, known.resource_version)

    def through(self, label_key: str, condition_type: str) -> WritablePod:
        """This pod as a view through one label key and one condition type shows it (what the
        aggregator tells a sidecar of its pod, ``PodView``): that label, that condition and
        that readiness gate only, the override if one is honoured, no marks."""
        return WritablePod(
            key=self.key,
            uid=self.uid,
            node_name=self.node_name,
            labels=_only(self.labels, label_key),
            conditions=_only(self.conditions, condition_type),
            readiness_gates=self.readiness_gates & {condition_type} - {""},
            overridden=self.overridden,
            resource_version=self.resource_version,
            override=self.override if self.override.value is not None else NONE,
        )


def _only(values: Mapping[str, str], name: str) -> dict[str, str]:
    return {name: values[name]} if name and name in values else {}


def fallback_mark(pod: Mapping[str, Any]) -> datetime.datetime | None:
    """The latest time an agent in fallback wrote this pod: its annotation beside the label,
    or a condition with the agents' reason (its lastTransitionTime). None: no mark (or none
    that parses)."""
    annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        fallback_marks.ANNOTATION, ""
    )
    times = [fallback_marks.annotation_time(str(annotation))]
    times += [
        str(c.get("lastTransitionTime") or "")
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("reason") == fallback_marks.CONDITION_REASON
    ]
    parsed = [when for text in times if text and (when := parse_time(text)) is not None]
    return max(parsed, default=None)
