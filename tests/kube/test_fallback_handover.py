"""The hand-over after an outage does not flap (issue 26, bug 4), on the Kubernetes API
emulator, in process: an aggregator that has listed the pods (and seeded each from what it
carried) sees an agent's fallback write arrive before that agent's first report (the agent
still reconnecting); it must not repair the pod back to its older, seeded view. It takes the
agent's write as the pod's new seed until a report arrives, in the startup grace.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator

import pytest

from aggregator.leader.elector import micro_time
from servehealth_common import fallback_marks
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import PODS, KubeEmulator

LABEL = "ray.io/serve"
GATE = "ray.io/serve-proxy-healthy"
MARK = fallback_marks.ANNOTATION
KEY = PodKey("default", "worker")
REASON = "agent's fallback write"


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    started = await FakeServeProxy().start()
    yield started
    await started.stop()


def agent_write(kube: KubeEmulator, value: str) -> None:
    """What an agent in fallback writes (node_agent/fallback/writer.py): the label and its mark."""
    now = datetime.datetime.now(datetime.UTC)
    mark = fallback_marks.annotation_value(micro_time(now), "default/worker (sidecar)")
    kube.modify_pod(
        "default",
        "worker",
        labels={LABEL: value},
        patch={"metadata": {"annotations": {MARK: mark}}},
    )


def agent_condition(kube: KubeEmulator, value: str) -> None:
    """What an agent in fallback writes in condition mode: the condition, reason NoAggregator."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": GATE,
        "status": value,
        "reason": fallback_marks.CONDITION_REASON,
        "lastTransitionTime": now,
    }
    kube.modify_pod("default", "worker", patch={"status": {"conditions": [condition]}})


@pytest.mark.parametrize(("listed", "written"), [("True", "False"), ("False", "True")])
async def test_the_same_in_condition_mode(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    proxy: FakeServeProxy,
    listed: str,
    written: str,
) -> None:
    kube = kube_emulator
    kube.add_pod(
        "default",
        "worker",
        labels={"ray.io/node-type": "worker"},
        pod_ip="127.0.0.1",
        serve_port=proxy.port,
        readiness_gates=[GATE],
        conditions=[{"type": GATE, "status": listed, "reason": "ServeProxyServing"}],
    )
    aggregator = await start_kube(mode="condition", startup_grace=60.0)
    agent_condition(kube, written)

    def settled() -> bool:
        record = aggregator.core.pod(KEY)
        return bool(status_patches(kube)) or (record is not None and REASON in record.reason)

    await eventually(settled, 10)
    assert status_patches(kube) == []
    assert kube.pod_conditions("default", "worker")[GATE]["status"] == written


def status_patches(kube: KubeEmulator) -> list[object]:
    return list(kube.requests("PATCH", resource=PODS, subresource="status", name="worker"))


@pytest.mark.parametrize(("listed", "written"), [("true", "false"), ("false", "true")])
async def test_an_agents_late_fallback_write_is_not_repaired_back_to_the_seed(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    proxy: FakeServeProxy,
    listed: str,
    written: str,
) -> None:
    kube = kube_emulator
    kube.add_pod(
        "default",
        "worker",
        labels={"ray.io/node-type": "worker", LABEL: listed},
        pod_ip="127.0.0.1",
        serve_port=proxy.port,
    )
    aggregator = await start_kube(startup_grace=60.0)  # no pull, no expiry: agents reconnect
    assert aggregator.core.in_grace()

    agent_write(kube, written)  # its agent, still in fallback, after the aggregator's list

    def settled() -> bool:
        record = aggregator.core.pod(KEY)
        repaired = kube.requests("PATCH", resource=PODS, name="worker")
        return bool(repaired) or (record is not None and REASON in record.reason)

    await eventually(settled, 10)
    assert kube.requests("PATCH", resource=PODS, name="worker") == []
    assert kube.pod_labels("default", "worker")[LABEL] == written
    record = aggregator.core.pod(KEY)
    assert record is not None
    assert (record.state is ServeState.SERVING) == (written == "true")
