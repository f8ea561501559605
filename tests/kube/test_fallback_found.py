"""An aggregator that takes over counts the pods agents wrote while no aggregator was there.

Agents in fallback mark their writes (``servehealth_common.fallback_marks``): the condition's
reason ``NoAggregator`` (its lastTransitionTime), or the annotation beside the label. Against
the Kubernetes API emulator, an in-process aggregator with ``--leader-elect`` takes over a
Lease whose holder last renewed at T: the pods marked after T are counted
(``serve_health_agent_fallback_pods``, one warning), those marked before are not (an earlier
fallback), and none of them is written (they carry what it wants). The mark parser's edge cases
are a table. So is the seeding of a gated pod at start, from what this aggregator writes (the
condition in condition mode, not KubeRay's label).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import pytest

from aggregator.leader.elector import micro_time
from servehealth_common import fallback_marks
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.pod import fallback_mark
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from tests.kube.test_leader_election import ELECTION, NAME, NS, is_serving
from testsupport.kube.emulator import LEASES, PODS, KubeEmulator

CONDITION = "ray.io/serve-proxy-healthy"
NOW = datetime.datetime.now(datetime.UTC)
RENEWED = NOW - datetime.timedelta(minutes=5)  # the last leader's last renewal


def rfc3339(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(status: str, reason: str, when: datetime.datetime) -> dict[str, Any]:
    return {
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "lastTransitionTime": rfc3339(when),
    }


async def test_pods_agents_wrote_after_the_last_renewal_are_counted_and_not_written(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    after, before = NOW - datetime.timedelta(minutes=1), RENEWED - datetime.timedelta(hours=1)
    pods = {
        # condition written by an agent after the aggregators went away: counted
        "by-agent-condition": {
            "conditions": [condition("True", fallback_marks.CONDITION_REASON, after)]
        },
        # the label (and its annotation) written by an agent after: counted
        "by-agent-label": {
            "annotations": {
                fallback_marks.ANNOTATION: fallback_marks.annotation_value(rfc3339(after), "node-1")
            }
        },
        # an agent's write from an earlier outage: not counted
        "earlier-outage": {
            "conditions": [condition("True", fallback_marks.CONDITION_REASON, before)]
        },
        # the aggregator's own write: not counted
        "by-aggregator": {"conditions": [condition("True", "ServeProxyServing", after)]},
    }
    for name, extra in pods.items():
        kube_emulator.add_pod(
            "ray",
            name,
            labels={"ray.io/node-type": "worker", "ray.io/serve": "true"},
            pod_ip="127.0.0.1",
            serve_port=1,
            readiness_gates=[CONDITION],
            **extra,
        )
    kube_emulator.put_object(
        LEASES,
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {
                "holderIdentity": "gone-leader",
                "leaseDurationSeconds": 1,
                "acquireTime": micro_time(RENEWED),
                "renewTime": micro_time(RENEWED),
                "leaseTransitions": 3,
            },
        },
    )
    mark = kube_emulator.checkpoint()
    with caplog.at_level(logging.WARNING, logger="aggregator.leader.fallback_found"):
        aggregator = await start_kube(mode="condition", condition_type=CONDITION, **ELECTION)
        await eventually(is_serving(aggregator), timeout=10)
    assert aggregator.metrics.registry.get_sample_value("serve_health_agent_fallback_pods") == 2
    assert "2 pods were written by agents in fallback" in caplog.text
    # Seeded from what they carry: nothing to write for any of them.
    assert kube_emulator.requests("PATCH", resource=PODS, namespace="ray", since=mark) == []


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        pytest.param({}, None, id="no-mark"),
        pytest.param(
            {"metadata": {"annotations": {fallback_marks.ANNOTATION: "2026-12-01T20:31:00Z n1"}}},
            datetime.datetime(2026, 12, 1, 20, 31, tzinfo=datetime.UTC),
            id="annotation",
        ),
        pytest.param(
            {"metadata": {"annotations": {fallback_marks.ANNOTATION: "yesterday n1"}}},
            None,
            id="annotation-unreadable",
        ),
        pytest.param(
            {
                "status": {
                    "conditions": [
                        {"reason": "NoAggregator", "lastTransitionTime": "2026-12-01T20:31:00Z"},
                        {"reason": "NoAggregator", "lastTransitionTime": "2026-12-01T20:32:00Z"},
                        {"reason": "Other", "lastTransitionTime": "2026-12-01T20:33:00Z"},
                    ]
                }
            },
            datetime.datetime(2026, 12, 1, 20, 32, tzinfo=datetime.UTC),
            id="latest-agent-condition",
        ),
        pytest.param({"status": {"conditions": [{"reason": "NoAggregator"}]}}, None, id="no-time"),
    ],
)
def test_the_mark_of_a_pod(pod: dict[str, Any], expected: datetime.datetime | None) -> None:
    assert fallback_mark(pod) == expected


@pytest.mark.parametrize(
    ("mode", "labels", "conditions", "seeded"),
    [
        pytest.param(
            "condition", {}, [condition("True", "ServeProxyServing", NOW)], True, id="c-true"
        ),
        pytest.param("condition", {"ray.io/serve": "true"}, [], False, id="c-new-kuberay-worker"),
        pytest.param(
            "condition",
            {"ray.io/serve": "true"},
            [condition("False", "X", NOW)],
            False,
            id="c-false",
        ),
        pytest.param(
            "both", {"ray.io/serve": "true"}, [condition("True", "X", NOW)], True, id="b-both-true"
        ),
        pytest.param("both", {"ray.io/serve": "true"}, [], False, id="b-no-condition"),
        pytest.param("both", {}, [condition("True", "X", NOW)], False, id="b-no-label"),
        pytest.param("label", {"ray.io/serve": "true"}, [], True, id="l-true"),
    ],
)
async def test_a_gated_pod_is_seeded_from_what_this_aggregator_writes(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    mode: str,
    labels: dict[str, str],
    conditions: list[dict[str, Any]],
    seeded: bool,
) -> None:
    """SERVING at start only where everything the aggregator writes on the pod says so: in
    condition mode the label is KubeRay's (a new worker carries ray.io/serve=true, and its
    condition must still be written once), and a restart must not rewrite a True condition."""
    kube_emulator.add_pod(
        "ray",
        "ray-worker-0",
        labels={"ray.io/node-type": "worker", **labels},
        pod_ip="127.0.0.1",
        serve_port=1,
        readiness_gates=[CONDITION],
        conditions=conditions,
    )
    mark = kube_emulator.checkpoint()
    aggregator = await start_kube(mode=mode, condition_type=CONDITION, startup_grace=60)
    record = aggregator.core.pod(PodKey("ray", "ray-worker-0"))
    assert record is not None
    assert (record.state is ServeState.SERVING) is seeded, record.state
    if seeded:  # nothing to write at start
        assert kube_emulator.requests("PATCH", resource=PODS, namespace="ray", since=mark) == []
