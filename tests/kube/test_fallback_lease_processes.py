"""The Lease gate of the agents' fallback, with the real programs (issue 26): a real
``serve-health-aggregator --leader-elect`` and ``serve-health-agent`` sidecars on the
Kubernetes API emulator, ``--fallback-after 2s``. Agents fall back only when no aggregator
renews the Lease (``--fallback-lease``), whatever they can or cannot reach.

- Bug 5: an aggregator that refuses the agent's stream (``--auth tokenreview``, the agent has
  no token: UNAUTHENTICATED; or a pod it does not track: FAILED_PRECONDITION) renews its
  Lease: the agent writes nothing, however long.
- The hand-over (bug 4, the agent's side): an agent in fallback (no aggregator, no Lease)
  stops writing at once when an aggregator renews the Lease again, before any stream of it is
  accepted (here: never).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from testsupport import harness
from testsupport.fakes import HEALTHY
from testsupport.kube.agent_processes import (
    FAILING,
    FALLBACK_AFTER,
    FALLBACK_BEGAN,
    GATE,
    ProxyPool,
    add_pod,
    by_agent,
    condition,
    more_probes,
    spawn_sidecar,
    stop_all,
    writes_by,
)
from testsupport.kube.emulator import KubeEmulator

LEASE = "default/ray-serve-health-aggregator"
#: The agent is refused: its log says how.
REFUSED = re.compile(r"UNAUTHENTICATED|FAILED_PRECONDITION")
RENEWED_AGAIN = re.compile(r"Lease \S+ .*is renewed again after [\d.]+s of fallback")
READY = [{"type": "Ready", "status": "True"}, {"type": GATE, "status": "True"}]
WRITE = ("--fallback-write=condition", f"--fallback-lease={LEASE}")


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


#: How a live aggregator refuses the agent's stream: its token (it has none), or its pod (one
#: the aggregator does not track, as after a version skew in what is selected).
REFUSALS = {
    "unauthenticated": ("--auth=tokenreview",),
    "unknown-pod": ("--auth=none", "--pod-selector=app=elsewhere"),
}


def refusing_aggregator(
    tmp_path: Path, kubeconfig: Path, port: int | None = None, how: str = "unauthenticated"
) -> harness.AggregatorProcess:
    """An aggregator that leads (its Lease renewed) and refuses the agent's stream."""
    return harness.start_aggregator(
        tmp_path / "aggregator",
        port,
        [
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig}",
            *REFUSALS[how],
            "--mode=condition",
            "--agent-fallback=on",
            "--leader-elect=true",
            "--leader-elect-namespace=default",
            # Room to renew on a loaded machine: a leader that misses its renew deadline gives
            # up its Lease, and then the agent is right to fall back (not what is tested here).
            "--leader-elect-lease-duration=10s",
            "--leader-elect-renew-deadline=8s",
        ],
    )


def read_lease(kube: KubeEmulator) -> bool:
    return any(by_agent(call) for call in kube.requests("GET", resource="leases"))


def lease_held(kube: KubeEmulator) -> bool:
    lease = kube.lease("default", "ray-serve-health-aggregator")
    return bool(lease and (lease.get("spec") or {}).get("holderIdentity"))


@pytest.mark.parametrize("how", sorted(REFUSALS))
async def test_an_agent_refused_while_the_lease_is_renewed_never_falls_back(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
    how: str,
) -> None:
    kube = kube_emulator
    [proxy] = await proxies.start(1)
    pod = add_pod(kube, "worker", proxy, readiness_gates=[GATE], conditions=READY)
    aggregator = await asyncio.to_thread(refusing_aggregator, tmp_path, kubeconfig_path, None, how)
    processes.append(aggregator)
    await eventually(lambda: lease_held(kube), 20)
    agent = spawn_sidecar(tmp_path, aggregator.address, proxy, pod, kubeconfig_path, *WRITE)
    processes.append(agent)
    proxy.set(FAILING)  # an agent in fallback would write False within a probe or two

    await more_probes(proxy, 5 * FALLBACK_AFTER)  # well past --fallback-after
    if FALLBACK_BEGAN.search(agent.log_text()):
        # Fell back after all: let its write land, so that the failure below shows it.
        with contextlib.suppress(AssertionError):
            await eventually(lambda: writes_by(kube, agent=True), 20)
    assert REFUSED.search(agent.log_text()), agent.tail()
    assert writes_by(kube, agent=True) == [], agent.tail()
    assert read_lease(kube), "the agent never read the Lease"
    assert not FALLBACK_BEGAN.search(agent.log_text()), agent.tail()


async def test_fallback_stops_at_once_when_an_aggregator_renews_the_lease_again(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    [proxy] = await proxies.start(1)
    pod = add_pod(kube, "worker", proxy, readiness_gates=[GATE], conditions=READY)
    port = harness.free_port()
    address = f"{harness.HOST}:{port}"  # nothing there yet, and no Lease
    agent = spawn_sidecar(tmp_path, address, proxy, pod, kubeconfig_path, *WRITE)
    processes.append(agent)
    proxy.set(FAILING)
    # The agent's fallback: on two busy cores its start, its Kubernetes client's import and its
    # Lease read took over 30 s once.
    await eventually(lambda: condition(kube, "worker") == "False", 90)
    assert FALLBACK_BEGAN.search(agent.log_text()), agent.tail()

    aggregator = await asyncio.to_thread(refusing_aggregator, tmp_path, kubeconfig_path, port)
    processes.append(aggregator)
    await eventually(lambda: RENEWED_AGAIN.search(agent.log_text()), 20)
    since = asyncio.get_running_loop().time()
    proxy.set(HEALTHY)  # in fallback the agent would now write True
    await more_probes(proxy, 5 * FALLBACK_AFTER)
    assert writes_by(kube, agent=True, since=since) == [], agent.tail()
    assert FALLBACK_BEGAN.search(agent.log_text()) is not None
    assert len(FALLBACK_BEGAN.findall(agent.log_text())) == 1, agent.tail()
