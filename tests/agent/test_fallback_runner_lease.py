"""The fallback runner reads the aggregator's Lease only while it has no stream (issue 26), with
a fake writer and a fake clock: no read before ``--fallback-after`` has passed, nor while the
agent has nothing to write (its pod carries what its probes say), a watch once it has
(through the writer, whose client is made for it), fallback held back while the Lease is
renewed and begun once it no longer is, stopped at once when it is renewed again, and the
watch cancelled when a stream is accepted. The aggregator's settings name the Lease too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.lease_gate import LeaseName, LeaseSeen
from node_agent.fallback.ports import LeaseListener
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback.runner import FallbackRunner
from node_agent.sink import NO_METRICS
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import ProbeResult
from servehealth_common.states import ServeState
from tests.conftest import eventually

KEY = PodKey("ray", "worker-0")
GATE = "ray.io/serve-proxy-healthy"
AFTER, DURATION = 10.0, 15.0
LEASE = LeaseName("serve-health", "ray-serve-health-aggregator")


class FakeWriter:
    """Records each ``follow_lease`` (and its listener) and holds it until cancelled."""

    def __init__(self) -> None:
        self.leases: list[tuple[LeaseName, LeaseListener]] = []
        self.cancelled = 0

    def submit(self, write: object) -> None:
        pass

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def follow_pod(
        self, key: PodKey, seen: Callable[[PodFacts], None], gone: Callable[[PodKey], None]
    ) -> None:
        await asyncio.Event().wait()

    async def read_pod(self, key: PodKey) -> PodFacts | None:
        return None

    async def follow_lease(self, name: LeaseName, to: LeaseListener) -> None:
        self.leases.append((name, to))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class Rig:
    def __init__(self, lease: LeaseName | None) -> None:
        self.now = 0.0
        self.core = Fallback(
            after=AFTER,
            own=WhosePods(pod=KEY, uid="u"),
            flag_rules=WriteRules(condition_type=GATE),
            clock=lambda: self.now,
            lease=lease,
        )
        self.writer = FakeWriter()

        async def open_writer(core: Fallback) -> FakeWriter:
            return self.writer

        self.runner = FallbackRunner(
            self.core, open_writer, metrics=NO_METRICS, own_pod=KEY, clock=lambda: self.now
        )

    def wake(self) -> None:
        self.runner.ended()  # wakes the loop (no stream was up: nothing else changes)

    def pod(self, carries: str, state: ServeState) -> None:
        """The pod carries the condition ``carries``; its proxy probes ``state``."""
        facts = PodFacts(KEY, "u", conditions={GATE: carries}, readiness_gates=frozenset({GATE}))
        self.core.pod_seen(facts)
        self.runner.observe(KEY, ProbeResult(state, "probed", 200, 0.01))


def renewal(n: int) -> LeaseSeen:
    return LeaseSeen(holder="aggregator-0", renew_time=str(n), duration=DURATION)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    made = Rig(getattr(request, "param", LEASE))
    made.pod("True", ServeState.NOT_READY)  # a write is wanted
    task = asyncio.create_task(made.runner.run())
    yield made
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_lease_is_watched_only_once_fallback_is_due(rig: Rig) -> None:
    rig.wake()
    await settle()
    assert rig.writer.leases == []  # --fallback-after has not passed: no request at all
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.writer.leases, 5)
    assert rig.writer.leases[0][0] == LEASE
    assert rig.core.phase is FallbackPhase.WAITING  # not read yet: no fallback


async def test_an_agent_with_nothing_to_write_reads_no_lease(rig: Rig) -> None:
    rig.pod("True", ServeState.SERVING)  # carries what its probes say
    rig.now += AFTER + DURATION
    rig.wake()
    await settle()
    assert rig.writer.leases == []
    assert rig.core.phase is FallbackPhase.WAITING
    rig.pod("True", ServeState.DRAINING)  # now it has something to write
    await eventually(lambda: rig.writer.leases, 5)


async def test_fallback_waits_for_the_lease_and_stops_when_it_is_renewed_again(rig: Rig) -> None:
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.writer.leases, 5)
    _, listener = rig.writer.leases[0]
    listener.lease_seen(LEASE, renewal(1))
    await settle()
    assert rig.core.phase is FallbackPhase.WAITING  # an aggregator renews it
    rig.now += DURATION  # ... no longer
    rig.wake()
    await eventually(lambda: rig.core.phase is FallbackPhase.FALLBACK, 5)
    listener.lease_seen(LEASE, renewal(2))  # a new leader
    await eventually(lambda: rig.core.phase is FallbackPhase.WAITING, 5)
    assert rig.writer.cancelled == 0  # still watched: no stream yet


async def test_an_accepted_stream_cancels_the_watch(rig: Rig) -> None:
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.writer.leases, 5)
    rig.runner.accepted()
    await eventually(lambda: rig.writer.cancelled == 1, 5)
    assert rig.core.lease is not None
    assert rig.core.lease.renewed_until() is None  # read afresh next time


async def test_a_lease_the_agent_may_not_read_leaves_fallback_as_before(rig: Rig) -> None:
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.writer.leases, 5)
    rig.writer.leases[0][1].lease_unreadable(LEASE)  # a 403
    await eventually(lambda: rig.core.phase is FallbackPhase.FALLBACK, 5)


@pytest.mark.parametrize("rig", [None], indirect=True)
async def test_the_aggregators_settings_name_the_lease(rig: Rig) -> None:
    rig.runner.settings(
        pb.WriteSettings(condition=True, condition_type=GATE, fallback=True, lease=str(LEASE))
    )
    assert rig.core.lease is not None
    assert rig.core.lease.name == LEASE
    rig.runner.settings(pb.WriteSettings(condition=True, condition_type=GATE, fallback=True))
    assert rig.core.lease is None  # an aggregator without --leader-elect
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.core.phase is FallbackPhase.FALLBACK, 5)
    assert rig.writer.leases == []


async def test_another_lease_named_is_watched_instead(rig: Rig) -> None:
    rig.now += AFTER
    rig.wake()
    await eventually(lambda: rig.writer.leases, 5)
    other = LeaseName("elsewhere", "aggregators")
    rig.core.learned_lease(other)  # (settings come with a stream; the decider allows it anyway)
    rig.wake()
    await eventually(lambda: len(rig.writer.leases) == 2, 5)
    assert rig.writer.leases[1][0] == other
    assert rig.writer.cancelled == 1
