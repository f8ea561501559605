"""Leader election against the Kubernetes API emulator (kmock over real HTTP, the official
client): electors contending for one ``coordination.k8s.io/v1`` Lease, a stale update answered
409, API faults and a hung API during renewal; then whole in-process aggregators with
``--leader-elect``: a standby serves no reports and makes no pod request, a graceful stop hands
over at once, and a leader that cannot renew stops writing and says why.

Timings are shorter than the defaults (lease 2 s, renew deadline 1.2 s, retry 0.3 s) so that
the tests are quick; the defaults themselves are exercised by ``test_failover.py``. What the
tests assert is the order of events (a takeover no sooner than a lease duration after the last
renewal, as the emulator saw both arrive; a released Lease taken at the standby's next read);
how long things took is printed, and the waits are generous (``WAIT``: only a hang takes that
long), so that a loaded machine does not fail them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.ingest.report_service import STANDBY_MESSAGE
from aggregator.leader.elector import (
    ElectionSettings,
    LeaderElector,
    LeaseRecord,
    micro_time,
    utc_now,
)
from aggregator.leader.lease import KubeLeaseStore, lease_api
from aggregator.server import LIVENESS, Aggregator
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.kube.errors import APIConflictError
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import LEASES, PODS, ApiCall, KubeEmulator
from testsupport.messages import hello

NS = "ray-serve-health"
NAME = "ray-serve-health-aggregator"
TIMINGS = ElectionSettings(lease_duration=2, renew_deadline=1.2, retry_period=0.3)
ELECTION = {
    "leader_elect": True,
    "leader_elect_namespace": NS,
    "leader_elect_lease_duration": 2.0,
    "leader_elect_renew_deadline": 1.2,
    "leader_elect_retry_period": 0.3,
}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

MakeElector = Callable[..., LeaderElector]
#: How long a test waits for an elector or an aggregator: only a hang takes this long.
WAIT = 30.0
#: Clocks: the electors' time.monotonic and the emulator's loop time (uvloop: whole ms, from a
#: coarse clock) may differ by a few ms.
CLOCKS = 0.05


@pytest.fixture
async def make_elector(kube_emulator: KubeEmulator) -> AsyncIterator[MakeElector]:
    """``make_elector("a")``: a candidate on the emulator's Lease, with a client of its own."""
    stores: list[KubeLeaseStore] = []

    def make(identity: str, timings: ElectionSettings = TIMINGS, **kwargs: Any) -> LeaderElector:
        store = KubeLeaseStore(lease_api(kube_emulator.client_configuration(), timings), NS, NAME)
        stores.append(store)
        return LeaderElector(store, identity, timings, **kwargs)

    yield make
    for store in stores:
        store.close()


@contextlib.asynccontextmanager
async def background(*coroutines: Any) -> AsyncIterator[list[asyncio.Task[Any]]]:
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def span(calls: list[ApiCall]) -> float:
    """Seconds from the first to the last of ``calls`` (their arrival at the emulator)."""
    return calls[-1].at - calls[0].at if len(calls) > 1 else 0.0


def holder(emulator: KubeEmulator) -> str | None:
    lease = emulator.lease(NS, NAME)
    return None if lease is None else lease["spec"].get("holderIdentity")


def written_holder(call: ApiCall) -> str:
    """The holder a Lease write (PUT) names ("" for a release)."""
    return (call.body or {}).get("spec", {}).get("holderIdentity") or ""


def takeover_after_renewal(emulator: KubeEmulator, old: str, new: str) -> float:
    """Seconds from ``old``'s last renewal to ``new``'s takeover (the last write naming it),
    as the emulator saw them arrive."""
    puts = emulator.requests("PUT", resource=LEASES)
    takeover = [call for call in puts if written_holder(call) == new][-1]
    renewals = [call for call in puts if written_holder(call) == old and call.at < takeover.at]
    return takeover.at - renewals[-1].at


def reads_before_taking_the_release(emulator: KubeEmulator, new: str, since: int) -> list[str]:
    """The Lease requests between the last release (a write naming no holder) since ``since``
    and ``new``'s takeover: a standby that takes a released Lease at its next read made one
    GET in between."""
    calls = emulator.requests(resource=LEASES, since=since)
    released = max(i for i, c in enumerate(calls) if c.method == "PUT" and not written_holder(c))
    taken = next(
        i
        for i, c in enumerate(calls)
        if i > released and c.method == "PUT" and written_holder(c) == new
    )
    return [call.method for call in calls[released + 1 : taken]]


# -- electors -----------------------------------------------------------------------------


async def test_two_candidates_one_leader_and_a_takeover_after_a_crash(
    kube_emulator: KubeEmulator, make_elector: MakeElector
) -> None:
    a, b = make_elector("a"), make_elector("b")
    async with background(a.acquire(), b.acquire()) as (acquiring_a, acquiring_b):
        done, _ = await asyncio.wait(
            (acquiring_a, acquiring_b), timeout=WAIT, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1
        leader, standby = (a, b) if acquiring_a in done else (b, a)
        waiting = acquiring_b if leader is a else acquiring_a
        assert holder(kube_emulator) == leader.identity
        async with background(leader.hold()) as (holding,):
            # Renewals keep it the leader's: wait (an event, not a sleep) until they have gone
            # on for longer than a lease duration.
            started = kube_emulator.checkpoint()
            await kube_emulator.wait_until(
                lambda: (
                    span(kube_emulator.requests("PUT", resource=LEASES, since=started))
                    > TIMINGS.lease_duration * 1.2
                ),
                within=WAIT,
            )
            assert not waiting.done()
            assert not holding.done()
            assert standby.leader == leader.identity
            renewals = kube_emulator.requests("PUT", resource=LEASES)
            assert len(renewals) >= 3
            # The crash: renewals stop, nothing is released.
            holding.cancel()
        loop = asyncio.get_running_loop()
        crashed = loop.time()
        await asyncio.wait_for(waiting, WAIT)
        took = loop.time() - crashed
    assert holder(kube_emulator) == standby.identity
    lease = kube_emulator.lease(NS, NAME)
    assert lease is not None
    assert lease["spec"]["leaseTransitions"] == 1
    assert lease["spec"]["leaseDurationSeconds"] == 2
    # Taken over no sooner than a lease duration after the last renewal (the standby waits a
    # lease duration after it last saw the Lease change); how much later is a figure.
    waited = takeover_after_renewal(kube_emulator, leader.identity, standby.identity)
    print(f"taken over {waited:.2f}s after the last renewal, {took:.2f}s after the crash")
    assert waited >= TIMINGS.lease_duration - CLOCKS


async def test_a_stale_update_is_refused_409_and_the_loser_waits(
    kube_emulator: KubeEmulator, make_elector: MakeElector
) -> None:
    a, b = make_elector("a"), make_elector("b")
    kube_emulator.put_object(
        LEASES,
        {
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": 3},
        },
    )
    read_by_b = await b.store.get()  # b sees the released lease...
    assert read_by_b is not None
    assert await a.try_acquire_or_renew(1.0)  # ...a takes it first...
    now = micro_time(utc_now())
    with pytest.raises(APIConflictError):  # ...so b's update, at the version b read, is a 409
        await b.store.update(LeaseRecord("b", 2, now, now, 4), read_by_b.version)
    assert not await b.try_acquire_or_renew(1.0)
    assert b.leader == "a"
    assert holder(kube_emulator) == "a"
    assert kube_emulator.lease(NS, NAME)["spec"]["leaseTransitions"] == 4  # type: ignore[index]


async def test_a_leader_overwritten_behind_its_back_loses_at_the_next_renewal(
    kube_emulator: KubeEmulator, make_elector: MakeElector
) -> None:
    a = make_elector("a")
    await asyncio.wait_for(a.acquire(), WAIT)
    lease = kube_emulator.lease(NS, NAME)
    assert lease is not None
    lease["spec"]["holderIdentity"] = "someone-else"
    kube_emulator.put_object(LEASES, lease)
    mark = kube_emulator.checkpoint()
    reason = await asyncio.wait_for(a.hold(), WAIT)
    assert reason == f"lease {NS}/{NAME} is now held by someone-else"
    # The optimistic renewal (a PUT at a's stale version: 409), then a read, and no more.
    assert [c.method for c in kube_emulator.requests(resource=LEASES, since=mark)] == [
        "PUT",
        "GET",
    ]


async def test_one_failed_renewal_is_survived(
    kube_emulator: KubeEmulator, make_elector: MakeElector
) -> None:
    failures: list[None] = []
    a = make_elector("a", on_renew_failure=lambda: failures.append(None))
    await asyncio.wait_for(a.acquire(), WAIT)
    kube_emulator.fail_next(1, status=500, resource=LEASES, method="PUT")
    kube_emulator.fail_next(1, status=500, resource=LEASES, method="GET")
    mark = kube_emulator.checkpoint()
    async with background(a.hold()) as (holding,):
        # Renewals succeed again after the failed one, for longer than the renew deadline.
        await kube_emulator.wait_until(
            lambda: (
                span(kube_emulator.requests("PUT", resource=LEASES, since=mark))
                > TIMINGS.renew_deadline * 1.5
            ),
            within=WAIT,
        )
        assert not holding.done()
    assert failures == [None]
    assert holder(kube_emulator) == "a"


@pytest.mark.parametrize("fault", ["errors", "hung"])
async def test_a_leader_that_cannot_renew_gives_up_at_the_renew_deadline(
    kube_emulator: KubeEmulator, make_elector: MakeElector, fault: str
) -> None:
    failures: list[None] = []
    # The usual renew deadline, a longer lease: the room between them (how late the give-up
    # may come) is what a loaded machine needs, not what is tested.
    timings = ElectionSettings(lease_duration=4, renew_deadline=1.2, retry_period=0.3)
    a = make_elector("a", timings, on_renew_failure=lambda: failures.append(None))
    await asyncio.wait_for(a.acquire(), WAIT)
    renewed_at = a.renewed_at
    assert renewed_at is not None
    if fault == "errors":
        kube_emulator.fail_next(1000, status=500, resource=LEASES)
    else:  # every Lease request hangs far longer than the call deadline
        kube_emulator.slow(30.0, where=kube_emulator.select(resource=LEASES))
    reason = await asyncio.wait_for(a.hold(), WAIT)
    lost_at = time.monotonic()  # the elector's clock (uvloop's loop.time() is in whole ms)
    assert "within the renew deadline (1.2s)" in reason
    # Given up at the deadline, not before, and before the lease could expire for anyone else
    # (a lease duration after they last saw it change).
    print(f"gave up {lost_at - renewed_at:.2f}s after the last renewal")
    assert timings.renew_deadline <= lost_at - renewed_at < timings.lease_duration
    assert len(failures) >= 1
    kube_emulator.clear_faults()


# -- aggregators --------------------------------------------------------------------------


async def health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return answer.status


def gauge(aggregator: Aggregator, name: str) -> float | None:
    return aggregator.metrics.registry.get_sample_value(name)


def is_serving(aggregator: Aggregator) -> Callable[[], Any]:
    async def check() -> bool:
        return await health(aggregator.port) == SERVING

    return check


def serve_pods(emulator: KubeEmulator, count: int = 3) -> list[str]:
    names = [f"ray-worker-{i}" for i in range(count)]
    for name in names:
        emulator.add_pod(
            "ray",
            name,
            labels={"ray.io/node-type": "worker", "ray.io/serve": "true"},
            pod_ip="127.0.0.1",
            serve_port=1,
        )
    return names


async def test_without_leader_election_every_health_name_serves(
    start_aggregator: StartAggregator,
) -> None:
    aggregator = await start_aggregator()  # memory backend, no --leader-elect
    assert aggregator.election is None
    assert await health(aggregator.port) == SERVING
    assert await health(aggregator.port, LIVENESS) == SERVING
    assert gauge(aggregator, "serve_health_leader") == 1


async def test_a_standby_refuses_reports_and_makes_no_pod_request(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    serve_pods(kube_emulator)
    leader = await start_kube(**ELECTION)
    await eventually(is_serving(leader), timeout=WAIT)
    assert gauge(leader, "serve_health_leader") == 1
    assert leader.core.tracked() == 3  # seeded from the pods' labels
    mark = kube_emulator.checkpoint()
    standby = await start_kube(**ELECTION)
    # The standby has looked at the Lease for longer than a lease duration (its reads: GET).
    await kube_emulator.wait_until(
        lambda: (
            span(kube_emulator.requests("GET", resource=LEASES, since=mark))
            > TIMINGS.lease_duration + TIMINGS.retry_period
        ),
        within=WAIT,
    )
    assert await health(standby.port) == NOT_SERVING
    assert await health(standby.port, LIVENESS) == SERVING
    assert standby.election is not None
    assert leader.election is not None
    assert standby.election.elector.leader == leader.election.elector.identity  # type: ignore[union-attr]
    assert gauge(standby, "serve_health_leader") == 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{standby.port}") as channel:
        call = pb_grpc.ReportServiceStub(channel).Report()

        async def say_hello() -> None:
            # The standby may end the stream before the hello is even written.
            await call.write(hello("ray", "ray-worker-0"))
            await asyncio.wait_for(call.read(), WAIT)

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await say_hello()
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == STANDBY_MESSAGE
    # Only Lease requests since the standby started: no list, watch, patch or event.
    requests = kube_emulator.requests(since=mark)
    assert requests
    assert {call.resource for call in requests} == {"leases"}
    assert {call.method for call in requests} <= {"GET", "PUT"}  # reads, and the renewals
    assert standby.core.tracked() == 0


async def test_a_graceful_stop_hands_over_at_once(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    serve_pods(kube_emulator)
    first = await start_kube(**ELECTION)
    await eventually(is_serving(first), timeout=WAIT)
    before_second = kube_emulator.checkpoint()
    second = await start_kube(**ELECTION)
    # The second replica has read the Lease (held by the first) twice: it is a standby.
    await kube_emulator.wait_until(
        lambda: len(kube_emulator.requests("GET", resource=LEASES, since=before_second)) >= 2,
        within=WAIT,
    )
    assert await health(second.port) == NOT_SERVING
    mark = kube_emulator.checkpoint()
    loop = asyncio.get_running_loop()
    stopped = loop.time()
    await first.stop()
    assert holder(kube_emulator) == ""  # released
    await eventually(is_serving(second), timeout=WAIT)
    print(f"the second serves {loop.time() - stopped:.2f}s after the first began to stop")
    assert second.lost is None
    assert second.election is not None
    identity = second.election.elector.identity  # type: ignore[union-attr]
    assert holder(kube_emulator) == identity
    # Taken at the second's next read of the released Lease, not a lease duration later.
    assert reads_before_taking_the_release(kube_emulator, identity, mark) == ["GET"]
    assert second.core.tracked() == 3
    assert kube_emulator.requests("PATCH", resource=PODS, since=mark) == []


async def test_a_leader_that_loses_the_lease_stops_writing_and_says_why(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, make_elector: MakeElector
) -> None:
    serve_pods(kube_emulator)
    leader = await start_kube(**ELECTION)
    await eventually(is_serving(leader), timeout=WAIT)
    kube_emulator.fail_next(1000, status=503, resource=LEASES)
    await asyncio.wait_for(leader.wait(), WAIT)
    assert leader.lost is not None
    assert "renew deadline" in leader.lost
    assert await health(leader.port) == NOT_SERVING
    assert await health(leader.port, LIVENESS) == SERVING  # until the process exits
    assert gauge(leader, "serve_health_leader") == 0
    assert gauge(leader, "serve_health_lease_renew_failures_total") >= 2
    kube_emulator.clear_faults()
    # Nothing watches or writes any more: a label changed now is left alone (a leader would
    # put "true" back at once), until another candidate may take over. That candidate's
    # Lease requests are the clock: it takes the Lease over once it has seen it unchanged for
    # a lease duration.
    mark = kube_emulator.checkpoint()
    kube_emulator.modify_pod("ray", "ray-worker-0", labels={"ray.io/serve": "false"})
    successor = make_elector("successor")
    await asyncio.wait_for(successor.acquire(), WAIT)
    assert holder(kube_emulator) == "successor"
    assert span(kube_emulator.requests(resource=LEASES, since=mark)) >= TIMINGS.lease_duration
    assert kube_emulator.requests(resource=PODS, since=mark) == []
    assert kube_emulator.pod_labels("ray", "ray-worker-0")["ray.io/serve"] == "false"
