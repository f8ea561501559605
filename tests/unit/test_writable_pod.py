"""One pod view for both programs (issue 25): the aggregator and an agent's fallback read a pod
into the same :class:`~servehealth_common.pod_writes.pod.WritablePod`, and what the aggregator
tells a sidecar of its pod (``AggregatorMessage.pod``) comes back, on the agent's side, as
that pod narrowed to the aggregator's label and condition: an agent told its pod decides the
same writes as one that read it."""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import pytest

from aggregator.ingest.wire import pod_view_message
from aggregator.kube.pod_view import pod_view
from aggregator.kube.pods import parse_pod
from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback.wire import facts_from_view
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common import fallback_marks
from servehealth_common.override import Override
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.pod import WritablePod
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind
from servehealth_common.states import ServeState

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
LABEL = "ray.io/serve"
GATE = "ray.io/serve-proxy-healthy"
AFTER = 10.0


def raw_pod(
    *,
    label: str | None = None,
    condition: tuple[str, str] | None = None,
    gated: bool = True,
    override: str | None = None,
    marked: bool = False,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True", "reason": ""}]
    if condition is not None:
        conditions.append(
            {
                "type": GATE,
                "status": condition[0],
                "reason": condition[1],
                "lastTransitionTime": "2026-12-02T07:30:01Z",
            }
        )
    annotations = {} if override is None else {"ray-serve-health/override": override}
    if marked:
        annotations[fallback_marks.ANNOTATION] = "2026-12-02T07:31:00.500000Z node-1"
    return {
        "metadata": {
            "namespace": KEY.namespace,
            "name": KEY.name,
            "uid": UID,
            "resourceVersion": "42",
            "labels": {"ray.io/node-type": "worker"} | ({LABEL: label} if label else {}),
            "annotations": annotations,
        },
        "spec": {
            "nodeName": "node-1",
            "readinessGates": [{"conditionType": "other/gate"}]
            + ([{"conditionType": GATE}] if gated else []),
        },
        "status": {"podIP": "10.0.0.7", "conditions": conditions},
    }


def test_both_programs_read_a_pod_into_the_same_view() -> None:
    raw = raw_pod(
        label="true",
        condition=("False", fallback_marks.CONDITION_REASON),
        override=" in-service ",
        marked=True,
    )
    pod = WritablePod.from_pod(raw)
    assert parse_pod(raw, 8000).writable == pod == PodFacts.from_pod(raw)
    assert pod == WritablePod(
        key=KEY,
        uid=UID,
        node_name="node-1",
        labels={"ray.io/node-type": "worker", LABEL: "true"},
        conditions={"Ready": "True", GATE: "False"},
        readiness_gates=frozenset({"other/gate", GATE}),
        overridden=True,
        resource_version="42",
        override=Override(value="in-service"),
        fallback_mark=datetime.datetime(2026, 12, 2, 7, 31, 0, 500000, tzinfo=datetime.UTC),
        fallback_annotated=True,
    )
    assert pod.carried(WriteKind.LABEL, LABEL) == "true"
    assert pod.carried(WriteKind.CONDITION, GATE) == "False"
    assert pod.carried(WriteKind.LABEL, "absent") is None


def test_an_ignored_override_is_no_override() -> None:
    pod = WritablePod.from_pod(raw_pod(override="maintenance"))
    assert not pod.overridden
    assert pod.override == Override(ignored="maintenance")


def test_an_honoured_override_cannot_be_said_not_to_be() -> None:
    with pytest.raises(ValueError, match="honoured"):
        WritablePod(KEY, UID, override=Override(value="out-of-service"))
    # A pod told through a view knows that an override is honoured, not which:
    assert WritablePod(KEY, UID, overridden=True).override == Override()


def test_a_write_carried() -> None:
    pod = WritablePod.from_pod(raw_pod(label="false", condition=("False", "x")))
    label = pod.carrying(WriteKind.LABEL, LABEL, "true")
    condition = pod.carrying(WriteKind.CONDITION, GATE, "True")
    assert label.carried(WriteKind.LABEL, LABEL) == "true"
    assert label.conditions == pod.conditions
    assert condition.carried(WriteKind.CONDITION, GATE) == "True"
    assert condition.labels == pod.labels
    assert pod.carried(WriteKind.LABEL, LABEL) == "false"  # frozen: a new pod


PODS = [
    pytest.param(
        dict(label=label, condition=condition, gated=gated, override=override),
        id=f"label={label}-condition={condition and condition[1]}-gated={gated}-{override}",
    )
    for label, condition, gated, override in itertools.product(
        (None, "true", "false"),
        (None, ("True", "ServeProxyServing"), ("False", "x"), ("True", NO_PROXY_BY_DESIGN)),
        (True, False),
        (None, "out-of-service", "maintenance"),
    )
]
#: The names an aggregator writes with, as its WriteSettings tell them (an aggregator in label
#: mode still names its condition type; one may name none).
NAMES = [(LABEL, GATE), (LABEL, ""), ("", GATE), ("other", "other/gate")]


def told(raw: dict[str, Any], label_key: str, condition_type: str) -> WritablePod | None:
    """The pod as an agent is told it: the aggregator's view, over the wire, read back."""
    message = pod_view_message(pod_view(parse_pod(raw, 8000), label_key, condition_type))
    writes = pb.WriteSettings(label_key=label_key, condition_type=condition_type)
    return facts_from_view(pb.PodView.FromString(message.SerializeToString()), writes)


@pytest.mark.parametrize("names", NAMES)
@pytest.mark.parametrize("fields", PODS)
def test_a_pod_told_is_the_pod_through_the_aggregators_names(
    fields: dict[str, Any], names: tuple[str, str]
) -> None:
    raw = raw_pod(**fields, marked=True)
    pod = WritablePod.from_pod(raw)
    seen = pod.through(*names)
    assert told(raw, *names) == seen
    for kind, name in zip(WriteKind, names, strict=True):
        assert seen.carried(kind, name) == (pod.carried(kind, name) if name else None)
    assert seen.overridden is pod.overridden
    assert (names[1] in seen.readiness_gates) is (
        bool(names[1]) and names[1] in pod.readiness_gates
    )


def decided(pod: WritablePod, state: ServeState) -> list[tuple[WriteKind, str, str, str]]:
    clock = Clock()
    rules = WriteRules(LABEL, GATE, failure_threshold=1, success_threshold=1)
    core = Fallback(after=AFTER, own=WhosePods(pod=KEY, uid=UID), flag_rules=rules, clock=clock)
    core.pod_seen(pod)
    core.observe(KEY, state, "reason")
    clock.now += AFTER
    core.tick()
    return [(w.kind, w.name, w.value, w.version) for w in core.decide()]


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("state", [ServeState.SERVING, ServeState.NOT_READY, ServeState.NO_PROXY])
@pytest.mark.parametrize("fields", PODS)
def test_an_agent_told_its_pod_decides_as_one_that_read_it(
    fields: dict[str, Any], state: ServeState
) -> None:
    raw = raw_pod(**fields)
    pod = told(raw, LABEL, GATE)
    assert pod is not None
    assert decided(pod, state) == decided(WritablePod.from_pod(raw), state)
