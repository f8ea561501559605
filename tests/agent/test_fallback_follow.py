"""A sidecar in fallback follows its own pod (issue 26, bug 2), in process, against the kmock
API emulator (real HTTP, the official client): ``FallbackWriter.follow_pod`` lists the one pod
(field selector ``metadata.name``) and watches it, so that a manual override added or taken off
during the outage reaches the decider; the pod's deletion is told; an account that may not
list pods (403, a Role that grants ``get`` only) reads the pod once instead and says so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback.writer import FallbackWriter
from node_agent.kube_client import USER_AGENT
from servehealth_common.kube.client import KubeClient
from servehealth_common.pod_identity import PodKey
from tests.conftest import eventually
from testsupport.kube.emulator import KubeEmulator

GATE = "ray.io/serve-proxy-healthy"
KEY = PodKey("default", "worker-0")
OVERRIDE = "ray-serve-health/override"


class Sink:
    def __getattr__(self, name: str) -> object:
        return lambda *args: None


class Seen:
    """What ``follow_pod`` told: each version of the pod, and whether it went."""

    def __init__(self) -> None:
        self.pods: list[PodFacts] = []
        self.gone: list[PodKey] = []

    @property
    def last(self) -> PodFacts | None:
        return self.pods[-1] if self.pods else None


@pytest.fixture
def client(kube_emulator: KubeEmulator) -> Iterator[KubeClient]:
    made = KubeClient(
        kube_emulator.client_configuration(), timeout=2, concurrency=2, user_agent=USER_AGENT
    )
    yield made
    made.close()


@pytest.fixture
def writer(client: KubeClient) -> FallbackWriter:
    """A sidecar's writer, its decider in fallback (it reads its pod only then)."""
    now = [0.0]
    core = Fallback(
        after=1,
        own=WhosePods(pod=KEY, uid=""),
        flag_rules=WriteRules(condition_type=GATE),
        clock=lambda: now[0],
    )
    now[0] += 1
    assert core.tick() is not None
    return FallbackWriter(client, core, who="default/worker-0 (sidecar)", metrics=Sink())


@asynccontextmanager
async def following(writer: FallbackWriter) -> AsyncIterator[Seen]:
    found = Seen()
    task = asyncio.create_task(writer.follow_pod(KEY, found.pods.append, found.gone.append))
    try:
        yield found
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def annotate(kube: KubeEmulator, value: str | None) -> None:
    kube.modify_pod(KEY.namespace, KEY.name, patch={"metadata": {"annotations": {OVERRIDE: value}}})


async def test_an_override_added_and_taken_off_is_seen(
    kube_emulator: KubeEmulator, writer: FallbackWriter
) -> None:
    kube_emulator.add_pod(KEY.namespace, KEY.name, readiness_gates=[GATE])
    kube_emulator.add_pod(KEY.namespace, "another")  # never listed nor watched
    async with following(writer) as found:
        await eventually(lambda: found.last is not None and not found.last.overridden)
        annotate(kube_emulator, "in-service")
        await eventually(lambda: found.last.overridden)
        annotate(kube_emulator, "maintenance")  # ignored, as the aggregator ignores it
        await eventually(lambda: found.last.resource_version == pod_version(kube_emulator))
        assert not found.last.overridden
        annotate(kube_emulator, "out-of-service")
        await eventually(lambda: found.last.overridden)
        annotate(kube_emulator, None)
        await eventually(lambda: not found.last.overridden)
        kube_emulator.delete_pod(KEY.namespace, KEY.name)
        await eventually(lambda: found.gone == [KEY])
    assert {facts.key for facts in found.pods} == {KEY}
    lists = kube_emulator.requests("GET", verb="list", resource="pods")
    assert [call.params.get("fieldSelector") for call in lists] == [f"metadata.name={KEY.name}"]
    assert all(call.namespace == KEY.namespace for call in lists)


def pod_version(kube: KubeEmulator) -> str:
    pod = kube.pod(KEY.namespace, KEY.name)
    return str(pod["metadata"]["resourceVersion"]) if pod else ""


async def test_without_list_and_watch_the_pod_is_read_once(
    kube_emulator: KubeEmulator, writer: FallbackWriter, caplog: pytest.LogCaptureFixture
) -> None:
    kube_emulator.add_pod(KEY.namespace, KEY.name, readiness_gates=[GATE])
    kube_emulator.fail_next(1, status=403, verb="list")
    found = Seen()
    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(writer.follow_pod(KEY, found.pods.append, found.gone.append), 10)
    assert [facts.key for facts in found.pods] == [KEY]
    assert "cannot watch pod default/worker-0" in caplog.text
    assert "grant pods list and watch" in caplog.text
    assert len(kube_emulator.requests("GET", verb="get", resource="pods")) == 1
    assert len(kube_emulator.requests("GET", verb="list", resource="pods")) == 1  # not retried
