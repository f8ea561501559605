"""The marks of agents' fallback writes, as an aggregator counts them (issue 26, bug 6), on the
Kubernetes API emulator, in process:

- the aggregator removes the annotation of an agent's label write when it writes that label
  again (as its own write of the condition replaces the reason ``NoAggregator``): without
  ``--leader-elect`` a restart no longer counts every mark ever written, only those still
  standing (the pods whose label an agent wrote last);
- a take-over compares marks with the Lease's last renewal like with like: the annotation has
  microseconds as the Lease has; a condition's time has whole seconds (the API server keeps no
  fraction), so a condition marked in the renewal's second counts.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aggregator.leader.elector import micro_time
from aggregator.server import Aggregator
from servehealth_common import fallback_marks
from tests.conftest import StartAggregator, eventually
from tests.kube.test_leader_election import ELECTION, NAME, NS, is_serving
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import LEASES, PODS, KubeEmulator

LABEL = "ray.io/serve"
CONDITION = "ray.io/serve-proxy-healthy"
MARK = fallback_marks.ANNOTATION
FAILING = (503, "Service Unavailable")
PODS_WRITTEN = "serve_health_agent_fallback_pods"


@pytest.fixture
async def proxies() -> AsyncIterator[list[FakeServeProxy]]:
    started = [await FakeServeProxy().start() for _ in range(2)]
    yield started
    for proxy in started:
        await proxy.stop()


def counted(aggregator: Aggregator) -> float | None:
    return aggregator.metrics.registry.get_sample_value(PODS_WRITTEN)


def agent_mark(when: datetime.datetime) -> str:
    return fallback_marks.annotation_value(micro_time(when), "default/x (sidecar)")


async def test_the_aggregator_removes_the_mark_when_it_writes_the_label_again(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, proxies: list[FakeServeProxy]
) -> None:
    kube = kube_emulator
    healthy, failing = proxies
    failing.set(FAILING)
    written = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    for name, proxy in (("recovered", healthy), ("still-out", failing)):
        # Taken out by its agent during an outage three days ago.
        kube.add_pod(
            "default",
            name,
            labels={"ray.io/node-type": "worker", LABEL: "false"},
            pod_ip="127.0.0.1",
            serve_port=proxy.port,
            annotations={MARK: agent_mark(written), "team": "a"},
        )
    settings: dict[str, Any] = {"startup_grace": 0.3, "pull_interval": 0.2, "pull_timeout": 0.5}
    first = await start_kube(**settings)
    assert counted(first) == 2  # no Lease: every mark standing
    await eventually(lambda: kube.pod_labels("default", "recovered").get(LABEL) == "true", 10)
    [patch] = kube.requests("PATCH", resource=PODS, name="recovered")
    assert patch.body == {"metadata": {"labels": {LABEL: "true"}, "annotations": {MARK: None}}}
    assert kube.pod("default", "recovered")["metadata"]["annotations"] == {"team": "a"}
    # The pod whose label the agent wrote last keeps its mark (nothing was written to it).
    assert kube.requests("PATCH", resource=PODS, name="still-out") == []
    assert MARK in kube.pod("default", "still-out")["metadata"]["annotations"]
    await first.stop()

    again = await start_kube(**settings)  # a restart without --leader-elect
    assert counted(again) == 1


@pytest.mark.parametrize(
    ("mark", "at", "count"),
    [
        pytest.param("annotation", 0.3, 0, id="annotation-before-in-the-same-second"),
        pytest.param("annotation", 0.7, 1, id="annotation-after-in-the-same-second"),
        pytest.param("condition", 0.0, 1, id="condition-in-the-renewals-second"),
        pytest.param("condition", -1.0, 0, id="condition-the-second-before"),
        pytest.param("condition", 1.0, 1, id="condition-the-second-after"),
    ],
)
async def test_a_take_over_compares_like_with_like(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, mark: str, at: float, count: int
) -> None:
    """The Lease was last renewed at T + 0.5 s; the pod was marked at T + ``at``."""
    second = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    second -= datetime.timedelta(minutes=5)
    renewed = second + datetime.timedelta(seconds=0.5)
    when = second + datetime.timedelta(seconds=at)
    if mark == "annotation":
        extra: dict[str, Any] = {"annotations": {MARK: agent_mark(when)}}
    else:
        condition = {
            "type": CONDITION,
            "status": "True",
            "reason": fallback_marks.CONDITION_REASON,
            "lastTransitionTime": when.strftime("%Y-%m-%dT%H:%M:%SZ"),  # as the API keeps it
        }
        extra = {"conditions": [condition]}
    kube_emulator.add_pod(
        "ray",
        "worker",
        labels={"ray.io/node-type": "worker", LABEL: "true"},
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
                "acquireTime": micro_time(renewed),
                "renewTime": micro_time(renewed),
                "leaseTransitions": 3,
            },
        },
    )
    aggregator = await start_kube(mode="both", condition_type=CONDITION, **ELECTION)
    await eventually(is_serving(aggregator), timeout=10)
    assert counted(aggregator) == count
