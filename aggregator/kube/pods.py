"""What the aggregator needs to know of a Pod object, read from its JSON once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servehealth_common.kube.pods import serve_port
from servehealth_common.pod_identity import PodInfo, PodKey


@dataclass(frozen=True, slots=True)
class KubePod:
    info: PodInfo
    resource_version: str
    labels: dict[str, str]
    readiness_gates: frozenset[str]
    conditions: dict[str, str]  # condition type -> status ("True"/"False"/"Unknown")

    @property
    def key(self) -> PodKey:
        return self.info.key


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
    )
    return KubePod(
        info=info,
        resource_version=str(metadata.get("resourceVersion", "")),
        labels=dict(metadata.get("labels") or {}),
        readiness_gates=frozenset(
            gate.get("conditionType", "") for gate in spec.get("readinessGates") or []
        ),
        conditions={c.get("type", ""): c.get("status", "") for c in status.get("conditions") or []},
    )
