"""What the aggregator needs to know of a Pod object, read from its JSON once."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from aggregator.decision.override import ANNOTATION, NONE, Override
from aggregator.kube.kubelet_probe import checks_serve, ready_condition
from servehealth_common import fallback_marks
from servehealth_common.kube.pods import SERVE_GRPC_PORT_NAME, named_port, serve_port
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.rule import conditions_of, earlier
from servehealth_common.pod_writes.times import parse_time

#: KubeRay's labels: a pod's Ray cluster, and its node type (``head`` or ``worker``).
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
#: KubeRay names the Ray dashboard's container port (on the head) "dashboard".
DASHBOARD_PORT_NAME = "dashboard"


@dataclass(frozen=True, slots=True)
class KubePod:
    info: PodInfo
    resource_version: str
    labels: dict[str, str]
    readiness_gates: frozenset[str]
    #: condition type -> value: its status ("True"/"False"/"Unknown"), or
    #: :data:`~servehealth_common.pod_writes.rule.NO_PROXY_BY_DESIGN` (True with that reason)
    conditions: dict[str, str]
    dashboard_port: int = 0  # the container port named "dashboard" (0: none)
    #: Its ray-serve-health/override annotation, as read.
    override: Override = NONE
    #: When an agent in fallback last wrote it (servehealth_common.fallback_marks), or None.
    fallback_mark: datetime.datetime | None = None
    #: Whether it carries the annotation of an agent's label write (removed with the label's
    #: next write by the aggregator).
    fallback_annotated: bool = False
    #: Whether a container's readiness probe checks the Serve proxy too
    #: (:mod:`aggregator.kube.kubelet_probe`), and its Ready condition ("" unknown).
    kubelet_checks_serve: bool = False
    kubelet_ready: str = ""

    @property
    def key(self) -> PodKey:
        return self.info.key

    @property
    def cluster(self) -> str:
        """The pod's Ray cluster (KubeRay's ``ray.io/cluster`` label; empty: none)."""
        return self.labels.get(CLUSTER_LABEL, "")

    @property
    def head(self) -> bool:
        return self.labels.get(NODE_TYPE_LABEL) == "head"


def older(pod: KubePod, known: KubePod) -> bool:
    """Whether ``pod`` is an earlier version of the same pod than ``known`` (as an agent's
    fallback judges it: :func:`servehealth_common.pod_writes.rule.earlier`)."""
    return earlier(pod.info.uid, pod.resource_version, known.info.uid, known.resource_version)


def parse_pod(pod: dict[str, Any], default_port: int) -> KubePod:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    info = PodInfo(
        PodKey(metadata.get("namespace", ""), metadata.get("name", "")),
        uid=metadata.get("uid", ""),
        node_name=spec.get("nodeName", "") or "",
        pod_ip=status.get("podIP", "") or "",
        serve_port=serve_port(pod, default_port),
        grpc_port=named_port(pod, SERVE_GRPC_PORT_NAME, 0),
    )
    return KubePod(
        info=info,
        resource_version=str(metadata.get("resourceVersion", "")),
        labels=dict(metadata.get("labels") or {}),
        readiness_gates=frozenset(
            gate.get("conditionType", "") for gate in spec.get("readinessGates") or []
        ),
        conditions=conditions_of(status.get("conditions")),
        dashboard_port=named_port(pod, DASHBOARD_PORT_NAME, 0),
        override=Override.parse((metadata.get("annotations") or {}).get(ANNOTATION)),
        fallback_mark=fallback_mark(pod),
        fallback_annotated=fallback_marks.ANNOTATION in (metadata.get("annotations") or {}),
        kubelet_checks_serve=checks_serve(pod, info.serve_port, info.grpc_port),
        kubelet_ready=ready_condition(pod),
    )


def fallback_mark(pod: dict[str, Any]) -> datetime.datetime | None:
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
