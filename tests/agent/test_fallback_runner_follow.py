"""The fallback runner has a sidecar's pod followed while fallback lasts (issue 26, bug 2), with
a fake writer and a fake clock: the watch starts when fallback begins, stops when a stream is
accepted, and what the pod carried is then forgotten, so that the next fallback writes nothing
before it has seen the pod afresh; a fallback that ended while the writer was being made starts
no watch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.fallback import Fallback, FallbackPhase
from node_agent.fallback_rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback_runner import FallbackRunner
from node_agent.sink import NO_METRICS
from servehealth_common.pod_identity import PodKey
from tests.conftest import eventually

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
GATE = "ray.io/serve-proxy-healthy"
AFTER = 10.0


class FakeWriter:
    """Records each ``follow_pod`` and holds it until cancelled."""

    def __init__(self) -> None:
        self.follows: list[Callable[[PodFacts], None]] = []
        self.cancelled = 0

    def submit(self, write: object) -> None:
        pass

    async def run(self) -> None:
        await asyncio.Event().wait()

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

    def pass_fallback_after(self) -> None:
        self.now += AFTER
        self.runner.ended()  # wakes the loop (no stream was up: nothing else changes)


def facts() -> PodFacts:
    return PodFacts.from_pod(
        {
            "metadata": {"namespace": KEY.namespace, "name": KEY.name, "uid": UID},
            "spec": {"readinessGates": [{"conditionType": GATE}]},
        }
    )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    made = Rig()
    task = asyncio.create_task(made.runner.run())
    yield made
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_pod_is_followed_while_fallback_lasts(rig: Rig) -> None:
    rig.pass_fallback_after()
    await eventually(lambda: len(rig.writer.follows) == 1)
    rig.writer.follows[0](facts())
    assert rig.core.facts(KEY) is not None

    rig.runner.accepted()  # an aggregator back
    await eventually(lambda: rig.writer.cancelled == 1)
    assert rig.core.phase is FallbackPhase.CONNECTED
    assert rig.core.facts(KEY) is None  # forgotten: the next fallback reads it afresh

    rig.runner.ended()
    rig.pass_fallback_after()
    await eventually(lambda: len(rig.writer.follows) == 2)
    assert rig.core.facts(KEY) is None  # nothing written on what it carried before


async def test_no_watch_when_fallback_ended_while_the_writer_was_made() -> None:
    release = asyncio.Event()
    rig = Rig(open_delay=release)
    task = asyncio.create_task(rig.runner.run())
    try:
        rig.pass_fallback_after()
        await asyncio.wait_for(rig.opened.wait(), 5)
        rig.runner.accepted()
        release.set()
        await eventually(lambda: rig.core.phase is FallbackPhase.CONNECTED)
        for _ in range(10):
            await asyncio.sleep(0)
        assert rig.writer.follows == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
