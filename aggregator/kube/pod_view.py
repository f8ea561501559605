"""What the watch last showed of a pod, as its sidecar is told it (``AggregatorMessage.pod``)."""

from __future__ import annotations

from aggregator.kube.pods import KubePod
from aggregator.registry import PodViewFacts


def pod_view(pod: KubePod, label_key: str, condition_type: str) -> PodViewFacts:
    """The facts of ``pod`` for the label ``label_key`` and the condition ``condition_type`` the
    aggregator writes (whatever its mode: an agent in fallback writes what it is told to)."""
    return PodViewFacts(
        key=pod.key,
        uid=pod.info.uid,
        resource_version=pod.resource_version,
        node_name=pod.info.node_name,
        label=pod.labels.get(label_key),
        condition=pod.conditions.get(condition_type),
        gated=condition_type in pod.readiness_gates,
        overridden=pod.override.value is not None,
        kubelet_checks_serve=pod.kubelet_checks_serve,
        kubelet_ready=pod.kubelet_ready,
    )
