"""What the watch last showed of a pod, as its sidecar is told it (``AggregatorMessage.pod``)."""

from __future__ import annotations

from aggregator.kube.pods import KubePod
from aggregator.registry import PodViewFacts
from servehealth_common.pod_writes.rule import WriteKind


def pod_view(pod: KubePod, label_key: str, condition_type: str) -> PodViewFacts:
    """The facts of ``pod`` for the label ``label_key`` and the condition ``condition_type`` the
    aggregator writes (whatever its mode: an agent in fallback writes what it is told to): the
    pod as :meth:`~servehealth_common.pod_writes.pod.WritablePod.through` shows it, which an
    agent turns back into the same (``node_agent.fallback.wire.facts_from_view``)."""
    seen = pod.writable.through(label_key, condition_type)
    return PodViewFacts(
        key=seen.key,
        uid=seen.uid,
        resource_version=seen.resource_version,
        node_name=seen.node_name,
        label=seen.carried(WriteKind.LABEL, label_key),
        condition=seen.carried(WriteKind.CONDITION, condition_type),
        gated=condition_type in seen.readiness_gates,
        overridden=seen.overridden,
        override=seen.override.value or "",
        kubelet_checks_serve=pod.kubelet_checks_serve,
        kubelet_ready=pod.kubelet_ready,
    )
