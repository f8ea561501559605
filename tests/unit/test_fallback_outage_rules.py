"""The fallback decider during an outage (issue 26), pure, on a fake clock:

- bug 2: the agent reads a manual override as the aggregator does (one parser, in
  servehealth_common.override): ``in-service`` and ``out-of-service`` decide instead of the
  probes, as they do for the aggregator (issue 25: the two programs write the same), any other
  value is ignored; an override that arrives while a write is on its way stops it; a sidecar
  that stopped watching its pod writes nothing until it has seen the pod afresh.
"""

from __future__ import annotations

from typing import Any

import pytest

from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from servehealth_common.override import ANNOTATION, Override
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
GATE = "ray.io/serve-proxy-healthy"
AFTER = 10.0
VALUES = [
    "in-service",
    "out-of-service",
    " in-service\n",
    "maintenance",
    "In-Service",
    "out of service",
    "",
    "true",
]


def raw_pod(override: str | None = None, version: int = 10) -> dict[str, Any]:
    annotations = {} if override is None else {ANNOTATION: override}
    return {
        "metadata": {
            "namespace": KEY.namespace,
            "name": KEY.name,
            "uid": UID,
            "resourceVersion": str(version),
            "annotations": annotations,
        },
        "spec": {"readinessGates": [{"conditionType": GATE}]},
        "status": {"conditions": [{"type": GATE, "status": "True"}]},
    }


def pod(override: str | None = None, version: int = 10) -> PodFacts:
    return PodFacts.from_pod(raw_pod(override, version))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fallen_back(facts: PodFacts | None = None) -> Fallback:
    clock = Clock()
    core = Fallback(
        after=AFTER,
        own=WhosePods(pod=KEY, uid=UID),
        flag_rules=WriteRules(condition_type=GATE),
        clock=clock,
    )
    if facts is not None:
        core.pod_seen(facts)
    clock.now += AFTER
    assert core.tick() is not None
    return core


@pytest.mark.parametrize("value", VALUES)
def test_the_agent_honours_exactly_the_overrides_the_aggregator_honours(value: str) -> None:
    honoured = Override.parse(value).value is not None
    assert pod(value).overridden is honoured
    assert Override.of(raw_pod(value)["metadata"]["annotations"]) == Override.parse(value)


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (None, ["False"]),
        ("in-service", []),  # the override wants what the pod carries: nothing to write
        ("out-of-service", ["False"]),
        ("maintenance", ["False"]),  # ignored, as by the aggregator: the pod leaves service
        ("", ["False"]),
    ],
)
def test_a_failing_pod_leaves_service_unless_an_honoured_override_says(
    value: str | None, written: list[str]
) -> None:
    core = fallen_back(pod(value))
    core.observe(KEY, ServeState.NOT_READY)
    assert [write.value for write in core.decide()] == written


def test_an_override_decides_before_any_probe_result_and_against_them() -> None:
    """As for the aggregator, the override's label is written whatever the probes say: with
    none yet, and against a SERVING run; its message says the override decided."""
    core = fallen_back(pod("out-of-service"))
    [write] = core.decide()
    assert write.value == "False"
    assert "override out-of-service" in write.cause
    core.observe(KEY, ServeState.SERVING)
    assert core.still_wanted(write)


def test_an_override_that_arrives_while_a_write_is_on_its_way_stops_it() -> None:
    core = fallen_back(pod())
    core.observe(KEY, ServeState.NOT_READY)
    [write] = core.decide()
    assert core.still_wanted(write)
    core.pod_seen(pod("in-service", version=11))  # the watch: the operator annotated it
    assert not core.still_wanted(write)
    core.finished(write)  # dropped
    core.observe(KEY, ServeState.NOT_READY)
    assert core.decide() == []
    core.pod_seen(pod(None, version=12))  # taken off: its health decides again
    [again] = core.decide()
    assert (again.kind, again.value) == (write.kind, "False")


def test_a_pod_no_longer_watched_is_not_written_until_seen_again() -> None:
    core = fallen_back(pod())
    core.observe(KEY, ServeState.NOT_READY)
    core.unseen(KEY)
    assert core.facts(KEY) is None
    assert core.decide() == []
    core.pod_seen(pod(version=11))
    [write] = core.decide()  # the probe result seen before still counts
    assert write.value == "False"
