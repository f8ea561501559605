"""Whether ``serve-health-cleanup`` sees agents writing in fallback
(``aggregator/cleanup/agents.py``, pure): the marks their writes leave on the pods (the
annotation beside a label, a condition with reason ``NoAggregator``), made here by the agent's
own code (``node_agent.fallback.bodies``), newer than the aggregator's departure (its Lease's
renewal or release; without a Lease, a window before the cleanup's start), at each mark's
resolution; who wrote them; and what the refusal says to do."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from aggregator.cleanup.agents import (
    NAMED,
    agent_writes,
    evidence,
    refusal,
    since,
    written_back,
)
from node_agent.fallback.bodies import write_body
from node_agent.fallback.rules import Write
from servehealth_common import fallback_marks as marks
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.states import ServeState

GATE = "ray.io/serve-proxy-healthy"
LABEL = "ray.io/serve"
#: The aggregator's Lease, released at this time (its renewTime, microseconds).
RELEASED = datetime.datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=datetime.UTC)
SIDECAR = "ray/w-0 (sidecar)"
DAEMONSET = "node node-1 (DaemonSet)"


def at(seconds: float) -> datetime.datetime:
    return RELEASED + datetime.timedelta(seconds=seconds)


def pod(name: str, *writes: tuple[WriteKind, str, str, datetime.datetime]) -> dict[str, Any]:
    """A pod in ``ray`` carrying what an agent wrote: (kind, value, who, when) each, as the
    agent's patch bodies set them."""
    metadata: dict[str, Any] = {"namespace": "ray", "name": name, "annotations": {}}
    conditions: list[dict[str, Any]] = [{"type": "Ready", "status": "True"}]
    for kind, value, who, when in writes:
        name_of = LABEL if kind is WriteKind.LABEL else GATE
        write = Write(PodKey("ray", name), "uid", kind, name_of, value, ServeState.NOT_READY,
                      "HTTP 503 (Service Unavailable)")  # fmt: skip
        body = write_body(write, who, when)
        metadata["annotations"].update(body.get("metadata", {}).get("annotations", {}))
        conditions += body.get("status", {}).get("conditions", [])
    return {"metadata": metadata, "status": {"conditions": conditions}}


def found(pods: list[dict[str, Any]], after: datetime.datetime = RELEASED) -> list[str]:
    return [write.describe() for write in agent_writes(pods, after)]


def test_marks_after_the_aggregator_went_away_are_agents_in_fallback() -> None:
    pods = [
        pod("w-0", (WriteKind.LABEL, "false", SIDECAR, at(5.25))),
        pod("w-1", (WriteKind.CONDITION, "False", DAEMONSET, at(12))),
        pod("w-2", (WriteKind.CONDITION, "True", DAEMONSET, at(-60))),  # an earlier outage
        pod("w-3"),
    ]
    assert found(pods) == [
        f"ray/w-0 (annotation {marks.ANNOTATION} (a label), by the agent {SIDECAR}, "
        "at 2026-03-01T12:00:05Z)",
        f"ray/w-1 (condition {GATE}=False, reason NoAggregator, by the agent {DAEMONSET}, "
        "at 2026-03-01T12:00:12Z)",
    ]


@pytest.mark.parametrize(
    ("kind", "offset", "counted"),
    [
        pytest.param(WriteKind.LABEL, 0.000001, True, id="annotation a microsecond after"),
        pytest.param(WriteKind.LABEL, -0.000001, False, id="annotation a microsecond before"),
        # A condition's time has whole seconds: one in the release's second may be after it.
        pytest.param(WriteKind.CONDITION, -0.4, True, id="condition in the release's second"),
        pytest.param(WriteKind.CONDITION, -0.6, False, id="condition the second before"),
    ],
)
def test_each_mark_is_compared_at_its_own_resolution(
    kind: WriteKind, offset: float, counted: bool
) -> None:
    pods = [pod("w", (kind, "False", DAEMONSET, at(offset)))]
    assert bool(found(pods)) is counted


def test_one_line_per_pod_its_latest_mark_and_pods_in_order() -> None:
    both = pod(
        "b",
        (WriteKind.LABEL, "false", DAEMONSET, at(3)),
        (WriteKind.CONDITION, "False", DAEMONSET, at(9)),
    )
    writes = agent_writes([both, pod("a", (WriteKind.LABEL, "true", SIDECAR, at(1)))], RELEASED)
    assert [(w.key.name, w.when) for w in writes] == [
        ("a", at(1)),
        ("b", at(9).replace(microsecond=0)),
    ]


def test_a_condition_of_another_reason_or_without_a_time_is_no_mark() -> None:
    aggregators = {
        "type": GATE,
        "status": "False",
        "reason": "ServeProxyNotServing",
        "lastTransitionTime": "2026-03-01T12:00:30Z",
    }
    timeless = {"type": GATE, "status": "False", "reason": marks.CONDITION_REASON}
    garbled = {marks.ANNOTATION: "yesterday someone"}
    pods = [
        {"metadata": {"namespace": "ray", "name": "x"}, "status": {"conditions": [aggregators]}},
        {"metadata": {"namespace": "ray", "name": "y"}, "status": {"conditions": [timeless]}},
        {"metadata": {"namespace": "ray", "name": "z", "annotations": garbled}},
    ]
    assert found(pods, at(-3600)) == []


def test_a_condition_whose_message_names_no_writer_is_still_a_mark() -> None:
    condition = {
        "type": GATE,
        "status": "False",
        "reason": marks.CONDITION_REASON,
        "message": "edited by hand",
        "lastTransitionTime": "2026-03-01T12:00:30Z",
    }
    pods = [{"metadata": {"namespace": "ray", "name": "x"}, "status": {"conditions": [condition]}}]
    assert found(pods) == [
        f"ray/x (condition {GATE}=False, reason NoAggregator, at 2026-03-01T12:00:30Z)"
    ]


@pytest.mark.parametrize(
    ("renew_time", "expected"),
    [
        pytest.param("2026-03-01T12:00:00.500000Z", RELEASED, id="the Lease's renewal"),
        pytest.param("", at(-600), id="no Lease: the window"),
        pytest.param("not a time", at(-600), id="a Lease time that does not parse: the window"),
    ],
)
def test_since_the_aggregator_went_away(renew_time: str, expected: datetime.datetime) -> None:
    assert since(renew_time, RELEASED, 600.0) == expected


def test_the_refusal_names_the_pods_and_what_to_do() -> None:
    pods = [
        pod(f"w-{i:02}", (WriteKind.CONDITION, "False", DAEMONSET, at(i + 1))) for i in range(12)
    ]
    writes = agent_writes(pods, RELEASED)
    message = refusal(writes, "2026-03-01T12:00:00.500000Z (its release)", "ray-serve-health")
    assert message.startswith(
        "refusing to clean up: agents in fallback (no aggregator answered them) wrote 12 pods "
        "after 2026-03-01T12:00:00.500000Z (its release): ray/w-00 (condition"
    )
    assert f"ray/w-{NAMED - 1:02}" in message
    assert f"ray/w-{NAMED:02}" not in message
    assert "; and 2 more." in message
    assert "kubectl -n ray-serve-health delete daemonset/ray-serve-health-agent" in message
    assert "SERVE_HEALTH_AGENT_FALLBACK=off" in message
    assert "remove them from the Ray pod templates" in message
    assert "--force=true" in message
    assert "if the aggregator ran in between, marks older than its release no longer count" in (
        message
    )
    assert evidence(writes[:1], "then") == (
        "agents in fallback (no aggregator answered them) wrote 1 pod after then: "
        + writes[0].describe()
    )


def test_written_back_says_what_and_what_to_do() -> None:
    writes = agent_writes([pod("w", (WriteKind.CONDITION, "False", DAEMONSET, at(40)))], RELEASED)
    message = written_back(writes, "the start", "ns")
    assert message.startswith(
        "not cleaned up for good: agents in fallback (no aggregator answered them) wrote 1 pod "
        "after the start: ray/w (condition"
    )
    assert "so they write back what this changed." in message
    assert "kubectl -n ns delete daemonset/ray-serve-health-agent" in message
    assert message.endswith("Then run the cleanup again.")
