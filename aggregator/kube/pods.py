"""What the aggregator needs to know of a Pod object, read from its JSON once: what it decides
a write from, as the agents' fallback does
(:class:`~servehealth_common.pod_writes.pod.WritablePod`), and what only the aggregator uses
(address and ports, the dashboard, the kubelet's probes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aggregator.kube.kubelet_probe import checks_serve, ready_condition
from servehealth_common.kube.pods import SERVE_GRPC_PORT_NAME, named_port, serve_port
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.pod import WritablePod

#: KubeRay's labels: a pod's Ray cluster, and its node type (``head`` or ``worker``).
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
#: KubeRay names the Ray dashboard's container port (on the head) "dashboard".
DASHBOARD_PORT_NAME = "dashboard"


@dataclass(frozen=True, slots=True)
class KubePod:
    info: PodInfo
    #: What both programs decide a write from: what the pod carries, its readiness gates,
    #: resourceVersion, override and fallback marks (shared with the agents' fallback).
    writable: WritablePod
    dashboard_port: int = 0  # the container port named "dashboard" (0: none)
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
        return self.writable.labels.get(CLUSTER_LABEL, "")

    @property
    def head(self) -> bool:
        return self.writable.labels.get(NODE_TYPE_LABEL) == "head"


def parse_pod(pod: dict[str, Any], default_port: int) -> KubePod:
    writable = WritablePod.from_pod(pod)
    info = PodInfo(
        writable.key,
        uid=writable.uid,
        node_name=writable.node_name,
        pod_ip=(pod.get("status") or {}).get("podIP", "") or "",
        serve_port=serve_port(pod, default_port),
        grpc_port=named_port(pod, SERVE_GRPC_PORT_NAME, 0),
    )
    return KubePod(
        info=info,
        writable=writable,
        dashboard_port=named_port(pod, DASHBOARD_PORT_NAME, 0),
        kubelet_checks_serve=checks_serve(pod, info.serve_port, info.grpc_port),
        kubelet_ready=ready_condition(pod),
    )
