"""What a real ``serve-health-aggregator --leader-elect`` leaves in its Lease when it is stopped
gracefully (SIGTERM), and what that means for an agent that waits behind the Lease gate of
issue 26, on the Kubernetes API emulator.

- SIGTERM releases the Lease (``aggregator/server.py``, ``Aggregator.stop``, then
  ``LeaderElector.release``, as client-go's ``ReleaseOnCancel``): an empty holder and
  ``leaseDurationSeconds: 1``, written after the aggregator's last write; it exits 0.
- So an agent that a live aggregator refused (its gate closed while the Lease was renewed)
  falls back at once when that aggregator stops: it does not wait out the Lease's duration (30 s
  here), as it must after a crash (SIGKILL: tests/kube/test_fallback_refused_processes.py).

Observed: the Lease as stored, the requests that reach the emulator (by User-Agent), the
label the pod carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from testsupport import harness
from testsupport.kube.agent_processes import (
    AGGREGATOR_UA,
    FAILING,
    FALLBACK_AFTER,
    LABEL,
    LEASE,
    ProxyPool,
    add_pod,
    agent_read_the_lease,
    leading_aggregator,
    lease_holder,
    lease_spec,
    lease_writes,
    more_probes,
    pod_writes_by_agents,
    spawn_sidecar,
    stop_all,
    user_agent,
)
from testsupport.kube.emulator import ApiCall, KubeEmulator

#: A long Lease: an agent that waited it out after the stop would take this long to write.
LEASE_SECONDS = 30
RENEW_DEADLINE = 8.0
#: How long a wait for what real processes do may take: only a hang takes that long.
WAIT = 90.0
#: The aggregator's refusal of the agent: a pod it does not select (FAILED_PRECONDITION). It
#: selects no pod of these tests, so it never writes one itself.
REFUSING = ("--auth=none", "--mode=label", "--agent-fallback=on", "--pod-selector=app=elsewhere")


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


def by_aggregator(call: ApiCall) -> bool:
    """Sent by the aggregator: its writer (``ray-serve-health``) or its elector
    (``ray-serve-health/leader-election``); not an agent (``ray-serve-health-agent/...``)."""
    ua = user_agent(call)
    return ua == AGGREGATOR_UA or ua.startswith(f"{AGGREGATOR_UA}/")


def releases(kube: KubeEmulator) -> list[ApiCall]:
    """The aggregator's writes of the Lease that name no holder."""
    return [
        call
        for call in lease_writes(kube)
        if by_aggregator(call) and not ((call.body or {}).get("spec") or {}).get("holderIdentity")
    ]


def the_release(kube: KubeEmulator) -> ApiCall:
    """The aggregator's one release of the Lease. Its HTTP client may send the same request
    twice (urllib3 retries a PUT whose keep-alive connection the server closed as it was
    reused; seen once in CI on a loaded machine): the copies must be the same request, and the
    first one counts."""
    found = releases(kube)
    assert found, "the aggregator did not release the Lease"
    assert all(call.body == found[0].body for call in found), [c.body for c in found]
    return found[0]


async def leading(kube: KubeEmulator, aggregator: harness.AggregatorProcess) -> None:
    """Wait until ``aggregator`` leads: the Lease names it *and* it has the answer (its log says
    so). The emulator stores the Lease before the answer reaches the aggregator: a SIGTERM in
    between finds a standby, which has nothing to release (seen once in CI, 28 ms apart)."""
    await eventually(lambda: lease_holder(kube), WAIT)
    await eventually(lambda: "standby -> leading" in aggregator.log_text(), WAIT)


async def start(tmp_path: Path, kubeconfig: Path) -> harness.AggregatorProcess:
    return await asyncio.to_thread(
        leading_aggregator,
        tmp_path / "aggregator",
        kubeconfig,
        *REFUSING,
        lease_seconds=LEASE_SECONDS,
        renew_deadline=RENEW_DEADLINE,
    )


async def test_sigterm_releases_the_lease(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    aggregator = await start(tmp_path, kubeconfig_path)
    processes.append(aggregator)
    await leading(kube, aggregator)
    assert lease_spec(kube)["leaseDurationSeconds"] == LEASE_SECONDS
    assert releases(kube) == []

    # In a thread: the emulator answers on this loop while the aggregator stops.
    assert await asyncio.to_thread(aggregator.stop, 30.0) == 0, aggregator.tail()
    spec = lease_spec(kube)
    assert spec, "the Lease is gone"
    assert lease_holder(kube) == "", spec
    assert spec["leaseDurationSeconds"] == 1, spec
    # The release is the aggregator's last write, of the Lease or of anything else.
    release = the_release(kube)
    copies = releases(kube)
    later = [c for m in ("POST", "PUT", "PATCH", "DELETE") for c in kube.requests(m)]
    assert [c for c in later if by_aggregator(c) and c.at > release.at and c not in copies] == []


async def test_a_refused_agent_falls_back_at_once_when_its_aggregator_stops(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    [proxy] = await proxies.start(1)
    proxy.set(FAILING)  # the agent has a write it wants to make from its first probe on
    pod = add_pod(kube, "worker", proxy, labels={LABEL: "true"})
    aggregator = await start(tmp_path, kubeconfig_path)
    processes.append(aggregator)
    await leading(kube, aggregator)
    agent = spawn_sidecar(
        tmp_path,
        aggregator.address,
        proxy,
        pod,
        kubeconfig_path,
        "--fallback-write=label",
        f"--fallback-lease={LEASE}",
    )
    processes.append(agent)
    # Refused, past --fallback-after, and gated: it has read the renewed Lease.
    await eventually(lambda: "FAILED_PRECONDITION" in agent.log_text(), WAIT)
    await eventually(lambda: agent_read_the_lease(kube), WAIT)
    await more_probes(proxy, FALLBACK_AFTER + 1.0)
    assert pod_writes_by_agents(kube) == [], agent.tail()

    assert await asyncio.to_thread(aggregator.stop, 30.0) == 0, aggregator.tail()
    release = the_release(kube)
    await eventually(lambda: kube.pod_labels("default", "worker")[LABEL] == "false", WAIT)
    written = pod_writes_by_agents(kube)
    assert {call.name for call in written} == {"worker"}
    first = min(call.at for call in written)
    # After the release, and well before the Lease's duration: the agent did not wait it out.
    assert release.at < first < release.at + LEASE_SECONDS, first - release.at
    print(f"the agent wrote {first - release.at:.2f}s after the release")
