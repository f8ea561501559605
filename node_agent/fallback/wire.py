"""What an aggregator's messages say for the agent's fallback (pure): the write rules of its
``WriteSettings``, and a sidecar's pod as its ``PodView`` shows it."""

from __future__ import annotations

from node_agent.fallback.rules import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_SUCCESS_THRESHOLD,
    PodFacts,
    WriteRules,
)
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.override import NONE, Override
from servehealth_common.pod_identity import PodKey


def facts_from_view(view: pb.PodView, writes: pb.WriteSettings) -> PodFacts | None:
    """A sidecar's pod as the aggregator told it (``AggregatorMessage.pod``), in the names of
    that aggregator's ``writes``; None if it names no pod. The aggregator's pod narrowed to
    those names (:meth:`~servehealth_common.pod_writes.pod.WritablePod.through`) again."""
    ref = view.pod
    if not ref.namespace or not ref.name:
        return None
    label_key, condition_type = writes.label_key, writes.condition_type
    # The override honoured (an aggregator of an earlier release says only that one is).
    override = Override.parse(view.override) if view.override else NONE
    if override.ignored is not None:
        override = NONE
    return PodFacts(
        key=PodKey(ref.namespace, ref.name),
        uid=ref.uid,
        node_name=view.node_name,
        labels={label_key: view.label} if view.HasField("label") and label_key else {},
        conditions=(
            {condition_type: view.condition}
            if view.HasField("condition") and condition_type
            else {}
        ),
        readiness_gates=frozenset({condition_type} if view.gated and condition_type else ()),
        overridden=view.overridden or override.value is not None,
        resource_version=view.resource_version,
        override=override,
    )


def rules_from(writes: pb.WriteSettings) -> WriteRules | None:
    """The rules of an aggregator's ``WriteSettings``; None if it allows no fallback."""
    if not writes.fallback:
        return None
    return WriteRules(
        label_key=writes.label_key if writes.label else "",
        condition_type=writes.condition_type if writes.condition else "",
        failure_threshold=writes.failure_threshold or DEFAULT_FAILURE_THRESHOLD,
        success_threshold=writes.success_threshold or DEFAULT_SUCCESS_THRESHOLD,
    )
