"""The agent's read of the aggregator's Lease (issue 26, ``node_agent.fallback.lease_watch``), in
process, against the kmock API emulator (real HTTP, the official client): a Lease that does not
exist is told as absent, then each change of it (created, renewed, taken over, deleted) through
a watch of that one Lease, with a get and a watch only (no list); a watch the server ends
resumes from the last version seen, without another get."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from node_agent.fallback.lease_gate import LeaseName, LeaseSeen
from node_agent.fallback.lease_watch import follow_lease
from node_agent.kube_client import USER_AGENT
from servehealth_common.kube.client import KubeClient
from tests.conftest import eventually
from testsupport.kube.emulator import LEASES, KubeEmulator

NAME = LeaseName("serve-health", "ray-serve-health-aggregator")


class Told:
    """What ``follow_lease`` told (None: absent)."""

    def __init__(self) -> None:
        self.seen: list[LeaseSeen | None] = []
        self.unreadable = 0
        self.gaps = 0

    def lease_seen(self, name: LeaseName, record: LeaseSeen | None) -> None:
        assert name == NAME
        self.seen.append(record)

    def lease_unreadable(self, name: LeaseName) -> None:
        self.unreadable += 1

    def lease_gap(self, name: LeaseName) -> None:
        self.gaps += 1


@pytest.fixture
def client(kube_emulator: KubeEmulator) -> Iterator[KubeClient]:
    made = KubeClient(
        kube_emulator.client_configuration(), timeout=2, concurrency=2, user_agent=USER_AGENT
    )
    yield made
    made.close()


def lease(holder: str, renewed: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"namespace": NAME.namespace, "name": NAME.name},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renewed},
    }


async def at_once() -> None:
    """No budget: each request at once."""


async def test_the_lease_is_followed_from_absent_to_deleted(
    kube_emulator: KubeEmulator, client: KubeClient
) -> None:
    kube, told = kube_emulator, Told()
    task = asyncio.create_task(follow_lease(client, NAME, told, random.Random(1), at_once))
    try:
        await eventually(lambda: told.seen == [None], 10)  # no Lease: no aggregator leads
        await eventually(lambda: kube.requests("GET", resource=LEASES, verb="watch"), 10)
        kube.put_object(LEASES, lease("aggregator-0", "2030-01-01T00:00:01.000000Z"))
        await eventually(lambda: len(told.seen) == 2, 10)
        kube.put_object(LEASES, lease("aggregator-0", "2030-01-01T00:00:03.000000Z"))
        kube.put_object(LEASES, lease("aggregator-1", "2030-01-01T00:00:09.000000Z"))
        await eventually(lambda: len(told.seen) == 4, 10)
        kube.delete_object(LEASES, NAME.namespace, NAME.name)
        await eventually(lambda: len(told.seen) == 5, 10)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    holders = [(r.holder, r.renew_time) if r is not None else None for r in told.seen]
    assert holders == [
        None,
        ("aggregator-0", "2030-01-01T00:00:01.000000Z"),
        ("aggregator-0", "2030-01-01T00:00:03.000000Z"),
        ("aggregator-1", "2030-01-01T00:00:09.000000Z"),
        None,
    ]
    assert told.unreadable == 0
    verbs = sorted({call.verb for call in kube.requests(resource=LEASES)})
    assert verbs == ["get", "watch"]  # no list: RBAC grants get and watch on this Lease only


async def test_a_lease_the_agent_may_not_read_is_told_unreadable_and_read_again(
    kube_emulator: KubeEmulator, client: KubeClient
) -> None:
    """A 403 (no grant for the Lease): told unreadable (the gate opens if it was never read),
    retried with backoff; read once the API answers."""
    kube, told = kube_emulator, Told()
    kube.put_object(LEASES, lease("aggregator-0", "2030-01-01T00:00:01.000000Z"))
    kube.fail_next(1, status=403, verb="get", resource=LEASES)
    task = asyncio.create_task(follow_lease(client, NAME, told, random.Random(1), at_once))
    try:
        await eventually(lambda: told.unreadable == 1, 10)
        await eventually(lambda: told.seen, 10)  # the retry (backoff up to 1 s) reads it
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert told.seen[0] is not None
    assert told.seen[0].holder == "aggregator-0"
