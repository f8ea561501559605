"""Agents in fallback during an outage, with the real programs (issue 26): real
``serve-health-aggregator`` and ``serve-health-agent`` processes on the Kubernetes API emulator,
each agent probing a loopback ``FakeServeProxy``, with ``--fallback-after 2s``. Agent requests
are told from the aggregator's by their User-Agent.

- A shadow aggregator (``--dry-run``) never arms the agents (bug 3): it tells them that agents
  may not write, whatever its ``--agent-fallback`` says, and an agent that learned so writes
  nothing when it is gone, not even what its own ``--fallback-write`` says.
- A sidecar in fallback sees its pod's manual override change (bug 2): an ``in-service``
  override added during the outage keeps a failing pod in service, and the agent writes again
  once it is removed; an override value the aggregator ignores (``maintenance``) is ignored by
  the agent too: a failing pod leaves service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from testsupport import harness
from testsupport.fakes import FakeServeProxy, refused_port
from testsupport.kube.agent_processes import (
    FAILING,
    FALLBACK_AFTER,
    FALLBACK_BEGAN,
    GATE,
    LABEL,
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

NO_FALLBACK = "the aggregator allows no fallback writes by agents"


@pytest.fixture
async def proxies() -> AsyncIterator[ProxyPool]:
    pool = ProxyPool()
    yield pool
    await pool.stop()


@pytest.fixture
def processes() -> Iterator[list[harness.Process]]:
    """Processes to stop at teardown (in reverse order)."""
    running: list[harness.Process] = []
    yield running
    stop_all(running)


@pytest.mark.parametrize(
    ("mode", "agent_fallback"),
    [("condition", "auto"), ("label", "on"), ("both", "on")],
)
async def test_a_shadow_aggregator_never_arms_the_agents(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
    mode: str,
    agent_fallback: str,
) -> None:
    kube = kube_emulator
    failing, fresh = await proxies.start(2)
    # One pod in service that starts failing, one new pod that carries nothing yet: an agent
    # in fallback would write both.
    pods = [
        add_pod(kube, "failing", failing, readiness_gates=[GATE], labels={LABEL: "true"}),
        add_pod(kube, "fresh", fresh, readiness_gates=[GATE]),
    ]
    shadow = await asyncio.to_thread(
        harness.start_aggregator,
        tmp_path / "shadow",
        None,
        [
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig_path}",
            f"--mode={mode}",
            f"--agent-fallback={agent_fallback}",
            "--dry-run=true",
        ],
    )
    processes.append(shadow)
    # Their own flags would write too: the last aggregator's settings win once received.
    agents = [
        spawn_sidecar(
            tmp_path, shadow.address, proxy, pod, kubeconfig_path, f"--fallback-write={mode}"
        )
        for proxy, pod in zip((failing, fresh), pods, strict=True)
    ]
    processes += agents
    for agent in agents:
        await asyncio.to_thread(harness.wait_connected, agent)

    await asyncio.to_thread(shadow.stop)
    failing.set(FAILING)
    await more_probes(fresh, 4 * FALLBACK_AFTER)  # well past --fallback-after
    await more_probes(failing, 1)
    if any(FALLBACK_BEGAN.search(agent.log_text()) for agent in agents):
        # Armed after all: let the writes land (the sidecar loads its Kubernetes client first,
        # seconds on a busy machine), so that the failure below shows them.
        with contextlib.suppress(AssertionError):
            await eventually(lambda: len(writes_by(kube, agent=True)) >= 2, 20)

    assert writes_by(kube, agent=True) == []
    assert writes_by(kube, agent=False) == []  # and the shadow aggregator wrote nothing
    for agent in agents:
        assert NO_FALLBACK in agent.log_text(), agent.tail()
        assert not FALLBACK_BEGAN.search(agent.log_text()), agent.tail()
    assert kube.pod_labels("default", "failing")[LABEL] == "true"
    assert GATE not in kube.pod_conditions("default", "fresh")


OVERRIDE = "ray-serve-health/override"
READY = [{"type": "Ready", "status": "True"}, {"type": GATE, "status": "True"}]


def annotate(kube: KubeEmulator, name: str, value: str | None) -> None:
    kube.modify_pod("default", name, patch={"metadata": {"annotations": {OVERRIDE: value}}})


def condition_patches(kube: KubeEmulator, name: str) -> list[str]:
    """The condition statuses agents PATCHed on the pod, in order."""
    return [
        condition["status"]
        for call in kube.requests("PATCH", resource="pods", subresource="status", name=name)
        if by_agent(call)
        for condition in (call.body or {}).get("status", {}).get("conditions", [])
        if condition.get("type") == GATE
    ]


def read_by_agent(kube: KubeEmulator, name: str) -> bool:
    """Whether an agent has read the pod (a GET, or a list of it)."""
    return any(
        by_agent(call) and call.verb in ("get", "list")
        for call in kube.requests("GET", resource="pods", subresource=None)
        if call.name == name or name in call.params.get("fieldSelector", "")
    )


async def sidecar_in_an_outage(
    kube: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
    *,
    annotations: dict[str, str] | None = None,
    failing: bool = False,
) -> tuple[FakeServeProxy, harness.Process]:
    """A gated, Ready pod ``worker`` (its proxy failing from the start, if ``failing``) and its
    real sidecar with condition writes in fallback, whose aggregator never answers."""
    [proxy] = await proxies.start(1)
    extra = {"annotations": annotations} if annotations else {}
    pod = add_pod(kube, "worker", proxy, readiness_gates=[GATE], conditions=READY, **extra)
    if failing:
        proxy.set(FAILING)
    nowhere = f"127.0.0.1:{refused_port()}"  # no aggregator answers there
    agent = spawn_sidecar(
        tmp_path, nowhere, proxy, pod, kubeconfig_path, "--fallback-write=condition"
    )
    processes.append(agent)
    return proxy, agent


async def test_an_override_added_during_the_outage_is_honoured(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    proxy, agent = await sidecar_in_an_outage(kube, kubeconfig_path, proxies, processes, tmp_path)
    await eventually(lambda: FALLBACK_BEGAN.search(agent.log_text()), 15)
    await eventually(lambda: read_by_agent(kube, "worker"), 15)  # it has read its pod

    annotate(kube, "worker", "in-service")  # the operator, during the outage
    await more_probes(proxy, 1)
    proxy.set(FAILING)
    await more_probes(proxy, 3)  # the agent would have written False within a probe or two
    # Its write, decided on the version it read, is refused (409): the pod has changed since.
    # It reads the pod again, sees the override, and writes nothing more (the attempt waits
    # for its slot of the fleet's API budget: it may come a few seconds later).
    assert condition(kube, "worker") == "True", agent.tail()
    await more_probes(proxy, 6)
    assert condition(kube, "worker") == "True", agent.tail()
    refused = condition_patches(kube, "worker")
    assert refused in ([], ["False"])

    annotate(kube, "worker", None)  # the override taken off: its health decides again
    await eventually(lambda: condition(kube, "worker") == "False", 20)
    assert condition_patches(kube, "worker") == [*refused, "False"]


async def test_an_out_of_service_override_is_written_during_the_outage(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    """As the aggregator would (issue 25: both programs write the same): the override decides
    against the probes, which say SERVING; taken off during the outage (the sidecar follows its
    pod while an override decides), the probes decide again."""
    kube = kube_emulator
    _, agent = await sidecar_in_an_outage(
        kube,
        kubeconfig_path,
        proxies,
        processes,
        tmp_path,
        annotations={OVERRIDE: "out-of-service"},
    )
    await eventually(lambda: FALLBACK_BEGAN.search(agent.log_text()), 15)
    await eventually(lambda: condition(kube, "worker") == "False", 20)
    assert "override out-of-service" in agent.log_text(), agent.tail()
    annotate(kube, "worker", None)  # taken off: the probes (SERVING) decide again
    await eventually(lambda: condition(kube, "worker") == "True", 20)
    assert condition_patches(kube, "worker") == ["False", "True"]


async def test_an_override_value_the_aggregator_ignores_is_ignored(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    _, agent = await sidecar_in_an_outage(
        kube,
        kubeconfig_path,
        proxies,
        processes,
        tmp_path,
        annotations={OVERRIDE: "maintenance"},
        failing=True,
    )
    await eventually(lambda: FALLBACK_BEGAN.search(agent.log_text()), 15)
    with contextlib.suppress(AssertionError):  # shown by the assertion below if it never comes
        await eventually(lambda: condition(kube, "worker") == "False", 10)
    assert condition_patches(kube, "worker") == ["False"], agent.tail()
