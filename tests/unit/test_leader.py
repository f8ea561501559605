"""Leader election decisions (``aggregator/leader/elector.py``), on a fake clock and an in-memory
Lease store with resourceVersions: when a candidate acquires, when it waits, lost races (409), the
renew deadline, release; plus the settings' validation and where the Lease's namespace and the
candidate's identity come from (``aggregator/leader/lease.py``). No sleeps: the elector's sleep
advances the fake clock."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from aggregator.flags import AggregatorFlags
from aggregator.leader.elector import (
    ElectionSettings,
    LeaderElector,
    Lease,
    LeaseRecord,
    micro_time,
)
from aggregator.leader.lease import (
    LeaderElectionConfigError,
    candidate_identity,
    lease_namespace,
    record_of,
    spec_of,
)
from node_agent.flags import AgentFlags
from servehealth_common.kube.errors import APIConflictError, APIError, APIRetryableError
from tests.conftest import FakeClock

TIMINGS = ElectionSettings(lease_duration=3, renew_deadline=2.0, retry_period=0.5)


class MemoryLeaseStore:
    """One Lease in a dict, with an increasing resourceVersion and a 409 on a stale one.

    ``failures[op]`` lists errors the next calls of ``op`` (get, create, update) raise;
    ``before[op]`` runs before a call (another candidate acting in between).
    """

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self._rv = 0
        self.calls: list[str] = []
        self.failures: dict[str, list[Exception]] = {"get": [], "create": [], "update": []}
        self.before: dict[str, Callable[[], None]] = {}

    def describe(self) -> str:
        return "ns/lease"

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if op in self.before:
            self.before.pop(op)()
        if self.failures[op]:
            raise self.failures[op].pop(0)

    def put(self, record: LeaseRecord) -> str:
        """Write directly (another candidate, or a person with kubectl)."""
        self._rv += 1
        self.lease = Lease(record, str(self._rv))
        return self.lease.version

    async def get(self) -> Lease | None:
        self._enter("get")
        return self.lease

    async def create(self, record: LeaseRecord) -> str:
        self._enter("create")
        if self.lease is not None:
            raise APIConflictError("create lease: HTTP 409: AlreadyExists", 409)
        return self.put(record)

    async def update(self, record: LeaseRecord, version: str) -> str:
        self._enter("update")
        if self.lease is None or self.lease.version != version:
            raise APIConflictError("update lease: HTTP 409: Conflict", 409)
        return self.put(record)


def retryable() -> APIError:
    return APIRetryableError("get lease: HTTP 500: injected", 500)


@dataclasses.dataclass
class World:
    clock: FakeClock
    store: MemoryLeaseStore
    wall: datetime = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)

    def candidate(self, identity: str, **kwargs: Any) -> LeaderElector:
        async def sleep(seconds: float) -> None:
            assert seconds >= 0
            self.clock.advance(seconds)

        return LeaderElector(
            self.store,
            identity,
            kwargs.pop("settings", TIMINGS),
            clock=self.clock,
            wall=lambda: self.wall,
            sleep=sleep,
            rng=random.Random(7),
            **kwargs,
        )


@pytest.fixture
def world() -> World:
    return World(FakeClock(), MemoryLeaseStore())


def held_by(
    holder: str, duration: int = 3, renew: str = "2024-05-01T12:00:00.000000Z"
) -> LeaseRecord:
    return LeaseRecord(holder, duration, renew, renew, 4)


# -- acquiring ------------------------------------------------------------------------------


async def test_no_lease_is_created_naming_the_candidate(world: World) -> None:
    a = world.candidate("a")
    assert await a.try_acquire_or_renew(1.0)
    assert a.is_leader
    assert world.store.calls == ["get", "create"]
    assert world.store.lease == Lease(
        LeaseRecord("a", 3, "2024-05-01T12:00:00.000000Z", "2024-05-01T12:00:00.000000Z", 0), "1"
    )


async def test_create_answered_409_means_another_candidate_won(world: World) -> None:
    a = world.candidate("a")
    world.store.before["create"] = lambda: world.store.put(held_by("b"))
    assert not await a.try_acquire_or_renew(1.0)
    assert not a.is_leader
    assert world.store.lease is not None
    assert world.store.lease.record.holder == "b"


async def test_a_held_lease_is_taken_only_after_it_stopped_changing_for_its_duration(
    world: World,
) -> None:
    world.store.put(held_by("b"))
    a = world.candidate("a")
    assert not await a.try_acquire_or_renew(1.0)  # first seen now
    assert a.leader == "b"
    world.clock.advance(2.9)
    world.store.put(held_by("b", renew="2024-05-01T12:00:02.900000Z"))  # b renews
    assert not await a.try_acquire_or_renew(1.0)  # seen changing now
    world.clock.advance(2.9)
    assert not await a.try_acquire_or_renew(1.0)  # changed 2.9 s ago: still b's
    world.clock.advance(0.11)
    assert await a.try_acquire_or_renew(1.0)  # unchanged for 3 s (by a's own clock)
    assert a.is_leader
    record = world.store.lease.record  # type: ignore[union-attr]
    assert (record.holder, record.duration_seconds, record.transitions) == ("a", 3, 5)
    assert record.acquire_time == record.renew_time == micro_time(world.wall)


@pytest.mark.parametrize(
    "renew_time",
    [
        pytest.param("1970-01-01T00:00:00.000000Z", id="renew-time-long-past"),
        pytest.param("2999-01-01T00:00:00.000000Z", id="renew-time-in-the-future"),
    ],
)
async def test_expiry_ignores_the_time_written_in_the_lease(world: World, renew_time: str) -> None:
    """Clock skew between replicas does not matter: only this process's observation does."""
    world.store.put(held_by("b", renew=renew_time))
    a = world.candidate("a")
    assert not await a.try_acquire_or_renew(1.0)
    world.clock.advance(2.99)
    assert not await a.try_acquire_or_renew(1.0)
    world.clock.advance(0.02)
    assert await a.try_acquire_or_renew(1.0)


async def test_expiry_uses_the_duration_written_by_the_holder(world: World) -> None:
    world.store.put(held_by("b", duration=10))
    a = world.candidate("a")
    assert not await a.try_acquire_or_renew(1.0)
    world.clock.advance(9.9)
    assert not await a.try_acquire_or_renew(1.0)
    world.clock.advance(0.11)
    assert await a.try_acquire_or_renew(1.0)


async def test_a_released_lease_is_taken_at_once(world: World) -> None:
    world.store.put(LeaseRecord("", 1, "t", "t", 4))
    a = world.candidate("a")
    assert await a.try_acquire_or_renew(1.0)
    assert world.store.lease.record.transitions == 5  # type: ignore[union-attr]


async def test_update_answered_409_means_another_candidate_won(world: World) -> None:
    world.store.put(LeaseRecord("", 1, "t", "t", 0))
    a = world.candidate("a")
    world.store.before["update"] = lambda: world.store.put(held_by("b"))
    assert not await a.try_acquire_or_renew(1.0)
    assert not a.is_leader
    assert world.store.lease.record.holder == "b"  # type: ignore[union-attr]


@pytest.mark.parametrize("op", ["get", "create"])
async def test_api_errors_answer_false(world: World, op: str) -> None:
    world.store.failures[op].append(retryable())
    a = world.candidate("a")
    assert not await a.try_acquire_or_renew(1.0)
    assert not a.is_leader
    assert await a.try_acquire_or_renew(1.0)


async def test_acquire_waits_and_wakes_when_the_lease_expires(world: World) -> None:
    world.store.put(held_by("b"))
    a = world.candidate("a")
    await a.acquire()
    # Observed at 1000.0, expired at 1003.0: woken right then, not up to a period later.
    assert 1003.0 <= world.clock.now <= 1003.0 + 0.01
    assert a.is_leader
    gets = world.store.calls.count("get")
    assert 6 <= gets <= 8  # every ~0.5 s (jittered by 10 %), then at expiry


async def test_two_candidates_one_leader(world: World) -> None:
    a, b = world.candidate("a"), world.candidate("b")
    await a.acquire()
    assert not await b.try_acquire_or_renew(1.0)
    assert (a.is_leader, b.is_leader, b.leader) == (True, False, "a")


# -- renewing -------------------------------------------------------------------------------


async def test_the_leader_renews_with_the_version_it_wrote_without_reading(world: World) -> None:
    a = world.candidate("a")
    await a.acquire()
    world.store.calls.clear()
    world.clock.advance(0.5)
    world.wall += timedelta(seconds=0.5)
    assert await a.try_acquire_or_renew(1.0)
    assert world.store.calls == ["update"]
    record = world.store.lease.record  # type: ignore[union-attr]
    assert record.renew_time == "2024-05-01T12:00:00.500000Z"
    assert record.acquire_time == "2024-05-01T12:00:00.000000Z"
    assert a.renewed_at == world.clock.now


async def test_a_renewal_that_finds_another_holder_loses_at_once(world: World) -> None:
    failures: list[None] = []
    a = world.candidate("a", on_renew_failure=lambda: failures.append(None))
    await a.acquire()
    started = world.clock.now
    world.store.put(held_by("b"))  # b took over behind a's back (a was too slow, say)
    reason = await a.hold()
    assert reason == "lease ns/lease is now held by b"
    assert world.clock.now - started == pytest.approx(0.5)  # the first renewal noticed
    assert world.store.calls[-2:] == ["update", "get"]  # 409 on the fast path, then a read
    assert not a.is_leader
    assert len(failures) == 1


async def test_renewal_failures_lose_leadership_at_the_renew_deadline(world: World) -> None:
    failures: list[None] = []
    a = world.candidate("a", on_renew_failure=lambda: failures.append(None))
    await a.acquire()
    renewed = world.clock.now
    world.store.failures["update"] = [retryable() for _ in range(100)]
    world.store.failures["get"] = [retryable() for _ in range(100)]
    reason = await a.hold()
    assert "within the renew deadline (2s)" in reason
    # Gave up at the deadline, before any standby may take over (lease duration 3 s).
    assert world.clock.now == pytest.approx(renewed + 2.0)
    assert len(failures) == 3  # attempts at +0.5, +1.0 and +1.5; +2.0 is the deadline
    assert a.renewed_at == renewed


async def test_a_short_outage_does_not_lose_leadership(world: World) -> None:
    a = world.candidate("a")
    await a.acquire()
    # Two failed renewals (+0.5 s, +1.0 s), then the API answers again.
    world.store.failures["update"] = [retryable() for _ in range(2)]
    world.store.failures["get"] = [retryable() for _ in range(2)]
    renewals: list[float] = []

    def then_b_takes_over() -> None:
        renewals.append(world.clock.now)
        if len(renewals) == 3:
            world.store.put(held_by("b"))

    store = world.store
    original = store.update

    async def update(record: LeaseRecord, version: str) -> str:
        if not store.failures["update"]:
            then_b_takes_over()
        return await original(record, version)

    store.update = update  # type: ignore[method-assign]
    reason = await a.hold()
    assert reason == "lease ns/lease is now held by b"  # ended only by the test's takeover
    assert renewals[0] - 1000.0 == pytest.approx(1.5)  # the 3rd attempt, within the deadline
    assert renewals[1] - renewals[0] == pytest.approx(0.5)


async def test_hold_is_only_for_the_leader(world: World) -> None:
    world.store.put(held_by("b"))
    a = world.candidate("a")
    await a.try_acquire_or_renew(1.0)
    assert await a.hold() == "not the leader"


# -- releasing ------------------------------------------------------------------------------


async def test_release_empties_the_holder_and_a_standby_takes_over_at_once(world: World) -> None:
    a, b = world.candidate("a"), world.candidate("b")
    await a.acquire()
    assert not await b.try_acquire_or_renew(1.0)
    assert await a.release()
    record = world.store.lease.record  # type: ignore[union-attr]
    assert (record.holder, record.duration_seconds, record.transitions) == ("", 1, 0)
    assert not a.is_leader
    assert await b.try_acquire_or_renew(1.0)  # no wait at all
    assert world.store.lease.record.transitions == 1  # type: ignore[union-attr]


async def test_release_by_a_standby_writes_nothing(world: World) -> None:
    world.store.put(held_by("b"))
    a = world.candidate("a")
    await a.try_acquire_or_renew(1.0)
    world.store.calls.clear()
    assert not await a.release()
    assert world.store.calls == []


async def test_release_after_a_renewal_landed_unseen_still_releases(world: World) -> None:
    a = world.candidate("a")
    await a.acquire()
    world.store.put(held_by("a"))  # a renewal cancelled in flight that landed after all
    assert await a.release()
    assert world.store.lease.record.holder == ""  # type: ignore[union-attr]


class AnswerLost(MemoryLeaseStore):
    """A create that lands on the server and whose answer never comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = asyncio.Event()

    async def create(self, record: LeaseRecord) -> str:
        version = await super().create(record)
        self.landed.set()
        await asyncio.Event().wait()  # the answer never comes (until cancelled)
        return version


async def test_a_stop_during_an_acquire_that_landed_releases_the_lease() -> None:
    """A standby stopped (SIGTERM) after its acquire reached the API server but before the
    answer reached it: the Lease names it, though it never led. Its release reads the Lease
    and gives it up, so the next standby takes over at once instead of a lease duration later
    (found by tests/kube/test_lease_release_processes.py: 28 ms between the two)."""
    world = World(FakeClock(), AnswerLost())
    a = world.candidate("a")
    acquiring = asyncio.create_task(a.acquire())
    await asyncio.wait_for(world.store.landed.wait(), 5)  # type: ignore[attr-defined]
    acquiring.cancel()  # the stop
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    assert not a.is_leader
    assert world.store.lease.record.holder == "a"  # type: ignore[union-attr]
    assert await a.release()
    assert world.store.lease.record.holder == ""  # type: ignore[union-attr]
    b = world.candidate("b")
    assert await b.try_acquire_or_renew(1.0)  # no wait at all


async def test_release_after_an_unanswered_acquire_leaves_anothers_lease_alone(
    world: World,
) -> None:
    a = world.candidate("a")
    world.store.failures["create"].append(TimeoutError())  # no answer: it may have landed
    assert not await a.try_acquire_or_renew(1.0)
    world.store.put(held_by("b"))
    world.store.calls.clear()
    assert not await a.release()
    assert world.store.calls == ["get"]  # read, and left alone
    assert world.store.lease.record.holder == "b"  # type: ignore[union-attr]


async def test_release_after_someone_else_took_over_is_refused(world: World) -> None:
    a = world.candidate("a")
    await a.acquire()
    world.store.put(held_by("b"))
    assert not await a.release()  # 409: a's version is stale
    assert world.store.lease.record.holder == "b"  # type: ignore[union-attr]


# -- settings, namespace, identity ----------------------------------------------------------


def test_defaults_ride_out_a_slow_api_and_fail_over_before_the_agents_fall_back() -> None:
    """Issue 28, point 9 (docs/benchmarks.md, "Leader election on a slow API server"): each
    Lease request may take three times an API server's p99 of 1 s, and a failover after a
    SIGKILL still ends before the agents' --fallback-after (so it never starts a fallback)."""
    settings = AggregatorFlags()
    assert settings.leader_elect is False
    duration = settings.leader_elect_lease_duration
    deadline = settings.leader_elect_renew_deadline
    retry = settings.leader_elect_retry_period
    timings = ElectionSettings(int(duration), deadline, retry)
    assert timings.call_timeout >= 3.0
    # Worst case after a SIGKILL: the standby saw the last renewal up to one (jittered) poll
    # late, then waits the lease duration; it wakes when the lease expires.
    assert duration + retry * 1.1 < 10 <= AgentFlags.fallback_after
    assert duration > deadline > retry * 1.2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"leader_elect_lease_duration": 2.5}, "whole number of seconds", id="fractional"
        ),
        pytest.param({"leader_elect_lease_duration": 0.0}, "at least 1", id="zero"),
        pytest.param(
            {"leader_elect_renew_deadline": 8.0}, "lease-duration .* > ", id="deadline-too-long"
        ),
        pytest.param({"leader_elect_retry_period": 5.5}, "1.2 x", id="retry-too-long"),
        pytest.param({"leader_elect_retry_period": 0.0}, "> 0", id="retry-zero"),
        pytest.param(
            {"leader_elect": True, "kube_backend": "memory"}, "kubernetes backend", id="memory"
        ),
        pytest.param({"leader_elect_lease_name": ""}, "must not be empty", id="no-name"),
    ],
)
def test_invalid_election_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AggregatorFlags(**overrides)


def test_the_lease_namespace_comes_from_the_flag_the_environment_or_the_pod(
    tmp_path: Path,
) -> None:
    file = tmp_path / "namespace"
    assert lease_namespace("flag", {"POD_NAMESPACE": "env"}, file) == "flag"
    assert lease_namespace("", {"POD_NAMESPACE": "env"}, file) == "env"
    file.write_text("own\n")
    assert lease_namespace("", {}, file) == "own"
    file.unlink()
    with pytest.raises(LeaderElectionConfigError, match="--leader-elect-namespace"):
        lease_namespace("", {}, file)


def test_the_identity_is_unique_per_process() -> None:
    assert candidate_identity("given", {"POD_NAME": "pod"}) == "given"
    first = candidate_identity("", {"POD_NAME": "aggregator-7d9f-x2x"})
    second = candidate_identity("", {"POD_NAME": "aggregator-7d9f-x2x"})
    assert first.startswith("aggregator-7d9f-x2x_")
    assert second.startswith("aggregator-7d9f-x2x_")
    assert first != second
    assert candidate_identity("", {}, hostname="host").startswith("host_")


def test_the_record_round_trips_through_the_lease_spec() -> None:
    record = LeaseRecord("a", 3, "2024-05-01T12:00:00.000000Z", "2024-05-01T12:00:01.000000Z", 2)
    assert spec_of(record) == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 3,
        "acquireTime": "2024-05-01T12:00:00.000000Z",
        "renewTime": "2024-05-01T12:00:01.000000Z",
        "leaseTransitions": 2,
    }
    assert record_of(spec_of(record)) == record
    assert record_of({}) == LeaseRecord("", 0)
