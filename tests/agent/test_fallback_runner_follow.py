"""What a sidecar's fallback runner reads of its own pod (issue 26), with a fake writer and a
fake clock: nothing when the aggregator told it what the pod carries (its writes are
conditional on that version); one read when nobody did; a watch only while a manual override
holds a write back, stopped when a stream is accepted (what it showed is then forgotten); and
nothing at all, not even the Kubernetes client, while the pod carries what its probes say."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.rules import PodFacts, WhosePods, Write, WriteRules
from node_agent.fallback.runner import FallbackRunner
from node_agent.sink import NO_METRICS
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.override import ANNOTATION
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import ProbeResult
from servehealth_common.states import ServeState
from tests.conftest import eventually

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
GATE = "ray.io/serve-proxy-healthy"
AFTER = 10.0
WRITES = pb.WriteSettings(condition=True, condition_type=GATE, fallback=True)


class FakeWriter:
    """Records writes, reads and follows of the pod; a follow holds until cancelled."""

    def __init__(self) -> None:
        self.follows: list[Callable[[PodFacts], None]] = []
        self.cancelled = 0
        self.reads = 0
        self.read_answer: PodFacts | None = None
        self.writes: list[Write] = []

    def submit(self, write: Write) -> None:
        self.writes.append(write)

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def read_pod(self, key: PodKey) -> PodFacts | None:
        self.reads += 1
        return self.read_answer

    async def follow_pod(
        self, key: PodKey, seen: Callable[[PodFacts], None], gone: Callable[[PodKey], None]
    ) -> None:
        assert key == KEY
        self.follows.append(seen)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def follow_lease(self, name: object, to: object) -> None:
        raise AssertionError("no Lease is named")


class Rig:
    def __init__(self, open_delay: asyncio.Event | None = None) -> None:
        self.now = 0.0
        self.core = Fallback(
            after=AFTER,
            own=WhosePods(pod=KEY, uid=UID),
            flag_rules=WriteRules(condition_type=GATE),
            clock=lambda: self.now,
        )
        self.writer = FakeWriter()
        self.opened = asyncio.Event()
        self._release = open_delay

        async def open_writer(core: Fallback) -> FakeWriter:
            self.opened.set()
            if self._release is not None:
                await self._release.wait()
            return self.writer

        self.runner = FallbackRunner(
            self.core, open_writer, metrics=NO_METRICS, own_pod=KEY, clock=lambda: self.now
        )
        self.runner.settings(WRITES)

    def probe(self, state: ServeState) -> None:
        self.runner.observe(KEY, ProbeResult(state, "probed", 200, 0.01))

    def pass_fallback_after(self) -> None:
        self.now += AFTER
        self.runner.ended()  # wakes the loop (no stream was up: nothing else changes)


def view(version: str, *, overridden: bool = False) -> pb.PodView:
    return pb.PodView(
        pod=pb.PodRef(namespace=KEY.namespace, name=KEY.name, uid=UID),
        resource_version=version,
        condition="True",
        gated=True,
        overridden=overridden,
    )


def facts(version: str, *, override: str = "") -> PodFacts:
    annotations = {ANNOTATION: override} if override else {}
    return PodFacts.from_pod(
        {
            "metadata": {
                "namespace": KEY.namespace,
                "name": KEY.name,
                "uid": UID,
                "resourceVersion": version,
                "annotations": annotations,
            },
            "spec": {"readinessGates": [{"conditionType": GATE}]},
            "status": {"conditions": [{"type": GATE, "status": "True"}]},
        }
    )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    made = Rig()
    task = asyncio.create_task(made.runner.run())
    yield made
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_pod_the_aggregator_told_is_written_without_a_read(rig: Rig) -> None:
    rig.runner.pod_view(view("41"))
    rig.probe(ServeState.NOT_READY)
    rig.pass_fallback_after()
    await eventually(lambda: rig.writer.writes)
    (write,) = rig.writer.writes
    assert (write.value, write.version) == ("False", "41")  # conditional on what it was told
    assert (rig.writer.reads, rig.writer.follows) == (0, [])


async def test_a_pod_nobody_told_is_read_once_then_written(rig: Rig) -> None:
    rig.writer.read_answer = facts("7")
    rig.probe(ServeState.NOT_READY)
    rig.pass_fallback_after()
    await eventually(lambda: rig.writer.writes)
    assert rig.writer.reads == 1
    assert rig.writer.writes[0].version == "7"


async def test_nothing_is_read_or_loaded_while_the_pod_carries_what_its_probes_say(
    rig: Rig,
) -> None:
    rig.runner.pod_view(view("41"))
    rig.probe(ServeState.SERVING)
    rig.probe(ServeState.SERVING)
    rig.pass_fallback_after()
    await eventually(lambda: rig.core.phase is FallbackPhase.FALLBACK)
    for _ in range(10):
        await asyncio.sleep(0)
    assert not rig.opened.is_set()  # not even the client


async def test_an_override_is_followed_until_it_goes(rig: Rig) -> None:
    rig.runner.pod_view(view("41", overridden=True))
    rig.probe(ServeState.NOT_READY)
    rig.pass_fallback_after()
    await eventually(lambda: len(rig.writer.follows) == 1)
    assert rig.writer.writes == []  # the operator decides
    rig.writer.follows[0](facts("42", override="in-service"))
    rig.writer.follows[0](facts("43"))  # taken off
    await eventually(lambda: rig.writer.writes)
    assert rig.writer.writes[0].version == "43"

    rig.runner.accepted()  # an aggregator back
    await eventually(lambda: rig.writer.cancelled == 1)
    assert rig.core.phase is FallbackPhase.CONNECTED
    assert rig.core.facts(KEY) is None  # forgotten: a view or a read tells it afresh


async def test_the_writer_is_made_ahead_of_fallback_once_a_write_is_wanted(rig: Rig) -> None:
    """Its client takes a second of CPU to load: made while the agent waits out
    --fallback-after, as soon as its probes call for a write (nothing is sent before)."""
    rig.runner.pod_view(view("41"))
    rig.runner.ended()  # a stream was up: it ended now
    rig.probe(ServeState.SERVING)
    rig.probe(ServeState.SERVING)
    for _ in range(10):
        await asyncio.sleep(0)
    assert not rig.opened.is_set()  # nothing to write: nothing loaded
    rig.probe(ServeState.NOT_READY)
    await asyncio.wait_for(rig.opened.wait(), 5)
    assert rig.core.phase is FallbackPhase.WAITING  # still before --fallback-after
    assert rig.writer.writes == []
    rig.now += AFTER
    rig.runner.ended()
    await eventually(lambda: rig.writer.writes)


async def test_no_read_when_fallback_ended_while_the_writer_was_made() -> None:
    release = asyncio.Event()
    rig = Rig(open_delay=release)
    task = asyncio.create_task(rig.runner.run())
    try:
        rig.probe(ServeState.NOT_READY)
        rig.pass_fallback_after()
        await asyncio.wait_for(rig.opened.wait(), 5)
        rig.runner.accepted()
        release.set()
        await eventually(lambda: rig.core.phase is FallbackPhase.CONNECTED)
        for _ in range(10):
            await asyncio.sleep(0)
        assert (rig.writer.follows, rig.writer.reads, rig.writer.writes) == ([], 0, [])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
