"""The agent's fallback writes on the Kubernetes API (``node_agent.fallback.writer``), in process,
against the kmock API emulator (real HTTP, the official client): the bodies (the aggregator's,
plus the marks of an agent's write: the condition's reason ``NoAggregator`` and a message naming
the agent, the label's annotation), an Event per write, retries of 5xx and 429, a pod that is
gone (404), a write given up (403), writes dropped once a stream is accepted, and the sidecar's
read of its own pod (its uid checked). Retries wait the writer's own short backoff (at most
0.2 s, 0.4 s, ...); nothing sleeps in the test itself. What the writer did is read from its own
record (the metrics it counts once the API's answer reached it), not only from the emulator's
store, which changes before the answer is back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest

from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback.writer import FallbackWriter
from node_agent.kube_client import USER_AGENT
from servehealth_common import fallback_marks as marks
from servehealth_common.kube.client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeClient
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import eventually
from testsupport.kube.emulator import KubeEmulator

GATE = "ray.io/serve-proxy-healthy"
LABEL = "ray.io/serve"
NODE = "node-1"
KEY = PodKey("default", "worker-0")
WHO = "node node-1 (DaemonSet)"
#: How long a test waits for the writer: only a hang takes this long.
WAIT = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sink:
    """The writer's metrics, counted."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def fallback_write(self, kind: str, result: str) -> None:
        self.writes.append((kind, result))

    def __getattr__(self, name: str) -> object:
        return lambda *args: None


@pytest.fixture
def client(kube_emulator: KubeEmulator) -> Iterator[KubeClient]:
    made = KubeClient(
        # A request timeout no answer of the in-process emulator reaches, even on a loaded
        # machine (a timeout would be one more error, retried, than a test counts).
        kube_emulator.client_configuration(),
        timeout=10,
        concurrency=2,
        user_agent=USER_AGENT,
    )
    yield made
    made.close()


class Rig:
    def __init__(self, kube: KubeEmulator, client: KubeClient, rules: WriteRules) -> None:
        self.kube = kube
        self.clock = Clock()
        self.core = Fallback(
            after=10, own=WhosePods(node_name=NODE), flag_rules=rules, clock=self.clock
        )
        self.sink = Sink()
        self.stored_version = ""
        self.writer = FallbackWriter(
            client, self.core, who=WHO, metrics=self.sink, rng=random.Random(1)
        )

    def add_pod(self, **settings: object) -> None:
        stored = self.kube.add_pod(
            KEY.namespace, KEY.name, node_name=NODE, readiness_gates=[GATE], **settings
        )
        self.stored_version = stored["metadata"]["resourceVersion"]
        self.core.pod_seen(PodFacts.from_pod(stored))

    def fall_back(self) -> None:
        self.clock.now += 10
        assert self.core.tick() is not None

    def decide(self, *states: ServeState) -> int:
        for state in states:
            self.core.observe(KEY, state, f"probe says {state.name}")
        writes = self.core.decide()
        for write in writes:
            self.writer.submit(write)
        return len(writes)

    def patches(self) -> list:
        return self.kube.requests("PATCH", resource="pods", name=KEY.name)


@pytest.fixture
async def rig(kube_emulator: KubeEmulator, client: KubeClient) -> AsyncIterator[Rig]:
    made = Rig(kube_emulator, client, WriteRules(label_key=LABEL, condition_type=GATE))
    task = asyncio.create_task(made.writer.run())
    yield made
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_condition_write_carries_the_marks_and_an_event(rig: Rig) -> None:
    rig.add_pod(labels={LABEL: "true"})
    rig.fall_back()
    assert rig.decide(ServeState.SERVING, ServeState.SERVING) == 1  # the label is right
    await eventually(lambda: rig.kube.pod_conditions(*KEY).get(GATE))
    condition = rig.kube.pod_conditions(*KEY)[GATE]
    assert (condition["status"], condition["reason"]) == ("True", marks.CONDITION_REASON)
    assert condition["message"].startswith(f"no aggregator: written by the agent {WHO}")
    assert condition["lastTransitionTime"]
    [patch] = rig.patches()
    assert (patch.subresource, patch.content_type) == ("status", STRATEGIC_MERGE_PATCH)
    assert set(patch.body) == {"status", "metadata"}
    # Conditional on the version the decision was made on (409 if the pod changed since).
    assert patch.body["metadata"] == {"resourceVersion": rig.stored_version}
    event = (await eventually(lambda: rig.kube.events(KEY.namespace)))[0]
    assert (event["reason"], event["type"]) == (marks.EVENT_REASON, "Normal")
    assert event["involvedObject"]["name"] == KEY.name
    assert event["involvedObject"]["uid"] == rig.core.facts(KEY).uid
    assert "no aggregator" in event["message"]
    assert all(
        call.headers.get("User-Agent") == USER_AGENT
        for call in rig.kube.requests()
        if call.method in ("PATCH", "POST")
    )
    await eventually(lambda: ("event", "success") in rig.sink.writes)
    assert rig.sink.writes == [("condition", "success"), ("event", "success")]
    # The answer is what the pod carries now: nothing more to write.
    assert rig.decide(ServeState.SERVING) == 0


async def test_a_label_write_carries_the_annotation(rig: Rig) -> None:
    rig.add_pod(labels={LABEL: "true"}, conditions=[{"type": GATE, "status": "True"}])
    rig.fall_back()
    assert rig.decide(ServeState.DRAINING) == 2
    await eventually(lambda: rig.kube.pod_labels(*KEY).get(LABEL) == "false")
    await eventually(lambda: rig.kube.pod_conditions(*KEY)[GATE]["status"] == "False")
    pod = rig.kube.pod(*KEY)
    annotation = pod["metadata"]["annotations"][marks.ANNOTATION]
    assert annotation.endswith(f" {WHO}")
    assert marks.annotation_time(annotation).endswith("Z")
    label_patch = next(call for call in rig.patches() if call.subresource is None)
    assert label_patch.content_type == MERGE_PATCH
    assert label_patch.body["metadata"]["labels"] == {LABEL: "false"}
    assert label_patch.body["metadata"]["annotations"] == {marks.ANNOTATION: annotation}
    assert label_patch.body["metadata"]["resourceVersion"]
    events = await eventually(
        lambda: len(rig.kube.events(KEY.namespace)) == 2 and rig.kube.events()
    )
    assert {event["type"] for event in events} == {"Warning"}


async def test_5xx_and_429_are_retried_until_the_write_lands(rig: Rig) -> None:
    rig.add_pod(labels={LABEL: "false"})
    rig.kube.fail_next(2, status=500, method="PATCH")
    rig.kube.fail_next(1, status=429, method="PATCH")  # overlaps the first: two fail, then OK
    rig.fall_back()
    assert rig.decide(ServeState.SERVING, ServeState.SERVING) == 2
    # Both writes landed, as the writer saw it: the condition used to be read from the store
    # alone, which has it before the writer has the answer (and counts the success).
    landed = {("label", "success"), ("condition", "success")}
    await eventually(lambda: landed <= set(rig.sink.writes), timeout=WAIT)
    assert rig.kube.pod_labels(*KEY).get(LABEL) == "true"
    assert GATE in rig.kube.pod_conditions(*KEY)
    assert rig.sink.writes.count(("label", "success")) == 1
    assert rig.sink.writes.count(("condition", "success")) == 1
    assert sum(result == "error" for _, result in rig.sink.writes) == 2


async def test_a_pod_gone_is_dropped_and_forgotten(rig: Rig) -> None:
    rig.add_pod()
    rig.kube.delete_pod(*KEY)
    rig.fall_back()
    assert rig.decide(ServeState.SERVING, ServeState.SERVING) == 2
    await eventually(lambda: ("label", "not_found") in rig.sink.writes)
    assert rig.core.facts(KEY) is None
    assert rig.kube.events() == []


async def test_a_refused_write_is_given_up_until_the_next_fallback(rig: Rig) -> None:
    rig.add_pod(labels={LABEL: "true"})
    rig.kube.fail_next(1, status=403, method="PATCH")
    rig.fall_back()
    assert rig.decide(ServeState.SERVING, ServeState.SERVING) == 1
    await eventually(lambda: ("condition", "error") in rig.sink.writes)
    await asyncio.sleep(0)  # the worker marks it given up
    assert rig.decide(ServeState.SERVING) == 0
    assert len(rig.patches()) == 1


async def test_writes_not_sent_when_a_stream_is_accepted_are_dropped(rig: Rig) -> None:
    rig.add_pod()
    rig.fall_back()
    for _ in range(2):
        rig.core.observe(KEY, ServeState.SERVING)
    writes = rig.core.decide()
    assert len(writes) == 2
    rig.core.stream_up()  # before the writer's workers run
    for write in writes:
        rig.writer.submit(write)
    await eventually(lambda: rig.sink.writes.count(("label", "dropped")) == 1)
    await eventually(lambda: ("condition", "dropped") in rig.sink.writes)
    assert rig.patches() == []


async def test_the_sidecar_reads_its_own_pod_and_checks_its_uid(
    kube_emulator: KubeEmulator, client: KubeClient
) -> None:
    stored = kube_emulator.add_pod(KEY.namespace, KEY.name, readiness_gates=[GATE])
    clock = Clock()
    for uid, accepted in ((stored["metadata"]["uid"], True), ("another-uid", False)):
        core = Fallback(
            after=1,
            own=WhosePods(pod=KEY, uid=uid),
            flag_rules=WriteRules(condition_type=GATE),
            clock=clock,
        )
        writer = FallbackWriter(client, core, who="default/worker-0 (sidecar)", metrics=Sink())
        clock.now += 1
        core.tick()
        facts = await writer.read_pod(KEY)
        assert facts is not None
        assert facts.readiness_gates == {GATE}
        assert (core.pod_seen(facts) is None) == accepted
    assert await writer.read_pod(PodKey("default", "nobody")) is None


async def test_a_pod_changed_since_the_decision_is_not_written_over(rig: Rig) -> None:
    """The write is conditional on the version decided on: an override added meanwhile (a
    new version the agent has not seen) answers 409, the write is not retried on the old
    version, and the pod waits for a newer version (a read, a watch event) before any write:
    the condition's write, decided with the label's, is dropped unsent."""
    rig.add_pod(labels={LABEL: "true"}, conditions=[{"type": GATE, "status": "True"}])
    rig.fall_back()
    rig.kube.modify_pod(
        *KEY, patch={"metadata": {"annotations": {"ray-serve-health/override": "in-service"}}}
    )
    assert rig.decide(ServeState.NOT_READY) == 2
    await eventually(lambda: rig.sink.writes.count(("label", "conflict")) == 1)
    await eventually(lambda: ("condition", "dropped") in rig.sink.writes)
    assert rig.kube.pod_labels(*KEY)[LABEL] == "true"  # the operator's override stands
    assert len(rig.patches()) == 1  # one attempt, and no request for the condition
    assert rig.decide(ServeState.NOT_READY) == 0
    assert rig.core.needs_facts(KEY) is False  # a DaemonSet agent's watch tells it
    assert rig.kube.events() == []


async def test_pods_waiting_for_their_retry_do_not_hold_the_writers_workers(rig: Rig) -> None:
    """Two pods whose writes keep failing (429 with Retry-After: 30 s, the longest honoured)
    and a third whose write is fine: the third lands at once, although the writer has only two
    workers (each failing pod waits for its retry in the queue, not in a worker). Before the
    shared queue (issue 25) a retry slept in its worker, and the third pod waited 30 s."""
    names = ["worker-a", "worker-b", "worker-c"]
    for name in names:
        stored = rig.kube.add_pod(
            KEY.namespace, name, node_name=NODE, readiness_gates=[GATE], labels={LABEL: "true"}
        )
        rig.core.pod_seen(PodFacts.from_pod(stored))
    for name in names[:2]:
        rig.kube.fail_next(100, status=429, retry_after=30, method="PATCH", name=name)
    rig.fall_back()
    for name in names:
        for _ in range(2):
            rig.core.observe(PodKey(KEY.namespace, name), ServeState.NOT_READY, "503")
    writes = rig.core.decide()
    assert [write.key.name for write in writes] == [name for name in names for _ in range(2)]
    for write in writes:  # (a label and a condition each)
        rig.writer.submit(write)
    landed = {("label", "success"), ("condition", "success")}
    await eventually(lambda: landed <= set(rig.sink.writes), timeout=WAIT)
    assert rig.kube.pod_labels(KEY.namespace, "worker-c").get(LABEL) == "false"
    # One attempt each, then waiting (a pod's condition waits behind its label).
    assert rig.sink.writes.count(("label", "error")) == 2
    assert ("condition", "error") not in rig.sink.writes
