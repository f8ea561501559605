"""Issue 26's Lease gate, for a DaemonSet agent, with the real program: a partition keeps a
real ``serve-health-agent --mode daemonset`` from every aggregator (it is pointed at a
loopback port where nothing listens), while the aggregators' Lease is renewed (by the test,
every second, in the emulator: what a leader that this agent cannot reach does). The agent's
node has two Ray pods, both in service (label ``ray.io/serve: "true"``); one's proxy answers
503, so the agent has a write it wants to make from its first probes on.

- While the Lease is renewed, for longer than ``--fallback-after`` plus the Lease's duration
  (when the agent would write if the gate failed), no write of the agent reaches the emulator.
- Once the renewals stop, the agent writes the failing pod (label ``"false"``), and only it:
  the healthy pod carries what its probes say already. Not before the Lease has gone a
  duration without renewal.

Observed: the writes that reach the emulator (by User-Agent) and the labels the pods carry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aggregator.leader.elector import micro_time, utc_now
from tests.conftest import eventually
from testsupport import harness
from testsupport.fakes import refused_port
from testsupport.kube.agent_processes import (
    AGENT_ARGS,
    FAILING,
    FALLBACK_AFTER,
    LABEL,
    LEASE,
    LEASE_NAME,
    LEASE_NAMESPACE,
    ProxyPool,
    add_pod,
    agent_read_the_lease,
    more_probes,
    pod_writes_by_agents,
    stop_all,
    writes_by,
)
from testsupport.kube.emulator import LEASES, KubeEmulator

#: The Lease the test renews: its duration, and how often it is renewed (well within it, so
#: that a busy test loop does not let it lapse).
LEASE_SECONDS = 5
RENEW_EVERY = 1.0
#: How long the agent must write nothing once it has read the Lease: longer than its
#: --fallback-after plus the Lease's duration.
QUIET = FALLBACK_AFTER + LEASE_SECONDS + 2.0
#: How long a wait for what real processes do may take: only a hang takes that long.
WAIT = 90.0
HOLDER = "aggregator-elsewhere"


@pytest.fixture
async def proxies() -> AsyncIterator[ProxyPool]:
    pool = ProxyPool()
    yield pool
    await pool.stop()


@pytest.fixture
def processes() -> Iterator[list[harness.Process]]:
    running: list[harness.Process] = []
    yield running
    stop_all(running)


class Renewer:
    """A leader the agent cannot reach, as the Lease shows it: holds the Lease and renews it
    every ``RENEW_EVERY`` seconds until :meth:`stop`."""

    def __init__(self, kube: KubeEmulator) -> None:
        self.kube = kube
        self.last = float("-inf")  # event-loop time of the latest renewal
        self._task: asyncio.Task[None] | None = None

    def _renew(self) -> None:
        now = micro_time(utc_now())
        self.kube.put_object(
            LEASES,
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"namespace": LEASE_NAMESPACE, "name": LEASE_NAME},
                "spec": {
                    "holderIdentity": HOLDER,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "acquireTime": now,
                    "renewTime": now,
                    "leaseTransitions": 0,
                },
            },
        )
        self.last = asyncio.get_running_loop().time()

    async def _run(self) -> None:
        while True:
            self._renew()
            await asyncio.sleep(RENEW_EVERY)

    def start(self) -> None:
        self._renew()  # held from now on
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


@pytest.fixture
async def renewer(kube_emulator: KubeEmulator) -> AsyncIterator[Renewer]:
    renewing = Renewer(kube_emulator)
    yield renewing
    await renewing.stop()


async def test_a_partitioned_daemonset_agent_writes_only_once_the_lease_lapses(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    renewer: Renewer,
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    failing, healthy = await proxies.start(2)
    failing.set(FAILING)
    add_pod(kube, "failing", failing, labels={LABEL: "true"}, node_name="node-1")
    add_pod(kube, "healthy", healthy, labels={LABEL: "true"}, node_name="node-1")
    renewer.start()
    agent = harness.spawn_daemonset_agent(
        tmp_path,
        f"127.0.0.1:{refused_port()}",  # the partition: no aggregator is ever reached
        kubeconfig_path,
        "node-1",
        extra_args=[*AGENT_ARGS, "--fallback-write=label", f"--fallback-lease={LEASE}"],
    )
    processes.append(agent)

    # Probing both pods, and (past --fallback-after, with a write it wants to make) reading
    # the Lease: from here on only the gate keeps it from writing.
    await eventually(lambda: failing.requests and healthy.requests, WAIT)
    await eventually(lambda: agent_read_the_lease(kube), WAIT)
    await more_probes(failing, QUIET)
    assert writes_by(kube, agent=True) == [], agent.tail()
    assert [kube.pod_labels("default", name)[LABEL] for name in ("failing", "healthy")] == [
        "true",
        "true",
    ]

    # The leader is gone: renewals stop, and the Lease is never released.
    await renewer.stop()
    last_renewal = renewer.last
    await eventually(lambda: kube.pod_labels("default", "failing")[LABEL] == "false", WAIT)
    await more_probes(healthy, 3.0)  # room for a wrong write of the healthy pod to land
    written = pod_writes_by_agents(kube)
    assert {call.name for call in written} == {"failing"}, agent.tail()
    assert kube.pod_labels("default", "healthy")[LABEL] == "true"
    first = min(call.at for call in written)
    assert first >= last_renewal + LEASE_SECONDS - 0.5, first - last_renewal
    print(f"the agent wrote {first - last_renewal:.2f}s after the last renewal")
