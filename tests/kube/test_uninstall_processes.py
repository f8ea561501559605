"""docs/install.md's "Uninstalling", with the real programs on the Kubernetes API emulator
(issue 28, point 4): a real ``serve-health-aggregator`` in readiness-gate mode (condition,
``--agent-fallback auto``: on, ``--leader-elect``), a real DaemonSet agent for node-2 (two gated
pods, one healthy, one whose proxy answers 503) and a real sidecar for a gated pod on node-1
(its proxy answers 503), both with the Lease gate and the ``--fallback-write condition`` preset
the manifests give them; the pods carry the aggregator's conditions. The cleanup runs as the
console script with the environment the CronJob's Job gets (rendered from the readiness-gate
overlay: the settings ConfigMap's keys, its own ``env``; the kubeconfig in place of the
in-cluster account, the Lease's namespace as its ``POD_NAMESPACE``).

- In the documented order (the sidecar disarmed by an aggregator rolled with
  ``SERVE_HEALTH_AGENT_FALLBACK=off``, the DaemonSet deleted, the aggregator scaled to 0, the
  cleanup): afterwards no pod carries our condition False, an agent's ``NoAggregator`` reason
  or the agents' annotation, and nothing writes them back for longer than the agents'
  ``--fallback-after`` plus the Lease's duration (the sidecar runs on, disarmed).
- In the wrong order (the aggregator scaled to 0 first, the agents armed): the agents fall
  back and write (a proxy that fails, one that recovers), and the cleanup refuses (exit 2),
  naming those pods and what to do, and changes nothing. The recovery it advises (the
  aggregator back with the fallback off, the DaemonSet deleted, the aggregator scaled to 0
  again) lets the next run clean up, and nothing writes back.
- The DaemonSet left running (armed, in fallback, with nothing to write before: no mark for
  the cleanup's first look): it writes back what the cleanup changed, at once; the cleanup's
  second look (``--verify-for``, its default) finds it and fails (exit 1), naming the pod, and
  the next run refuses (exit 2).

"Stopped" is SIGTERM (what scaling to 0 and deleting the DaemonSet send). Observed: the pods
as stored, the requests that reach the emulator (agents' by User-Agent), the agents' logs.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aggregator.cleanup.rules import UNINSTALLED_REASON
from servehealth_common import fallback_marks as marks
from tests.conftest import eventually
from tests.deploy.manifests import environment, find, render
from testsupport import harness
from testsupport.fakes import HEALTHY, FakeServeProxy
from testsupport.kube.agent_processes import (
    AGENT_ARGS,
    FAILING,
    FALLBACK_AFTER,
    FALLBACK_BEGAN,
    GATE,
    LEASE,
    LEASE_NAMESPACE,
    ProxyPool,
    add_pod,
    condition,
    leading_aggregator,
    lease_holder,
    more_probes,
    pod_writes_by_agents,
    spawn_sidecar,
    stop_all,
    user_agent,
)
from testsupport.kube.emulator import PODS, KubeEmulator

COMMAND = str(Path(sys.executable).parent / "serve-health-cleanup")
OVERLAY = "deploy/overlays/readiness-gate-mode"
#: The aggregator's Lease: short, so that the quiet period after the cleanup stays short.
LEASE_SECONDS = 3
RENEW_DEADLINE = 2.0
#: How long nothing may write back after the cleanup: longer than the agents' --fallback-after
#: plus the Lease's duration (when a still armed agent would have written).
QUIET = FALLBACK_AFTER + LEASE_SECONDS + 3.0
#: How long the sidecar's proxy serves again after the cleanup: long enough for an armed sidecar
#: to begin its fallback (it wants True, and believes its pod False).
RECOVERED = 3.0
#: How long a wait for what real processes do may take: only a hang takes that long.
WAIT = 90.0
AGGREGATOR_ARGS = ("--mode=condition", "--agent-fallback=auto")
#: The agents' flags as the manifests set them: the Lease gate, the fallback preset.
ARMED = (f"--fallback-lease={LEASE}", "--fallback-write=condition")
DISARMED = "the aggregator allows no fallback writes by agents"
CLEANUP_UA = "ray-serve-health/cleanup"
WRITES = ("POST", "PUT", "PATCH", "DELETE")


@dataclass
class Fleet:
    """The running programs and the pods' proxies."""

    aggregator: harness.AggregatorProcess
    daemonset: harness.Process
    sidecar: harness.Process
    healthy: FakeServeProxy  # node-2, the DaemonSet's
    failing: FakeServeProxy  # node-2, the DaemonSet's
    own: FakeServeProxy  # node-1, the sidecar's


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


@pytest.fixture(scope="module")
def job_environment() -> dict[str, str]:
    """The cleanup container's environment in the readiness-gate overlay's CronJob, as the
    kubelet builds it (the settings ConfigMap's keys, then its ``env``)."""
    objects = render(OVERLAY)
    cronjob = find(objects, "CronJob", "ray-serve-health-cleanup")
    [container] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["serve-health-cleanup"]
    assert "args" not in container
    return environment(container, objects)


async def aggregator(
    tmp_path: Path, kubeconfig: Path, name: str, *extra: str, port: int | None = None
) -> harness.AggregatorProcess:
    return await asyncio.to_thread(
        leading_aggregator,
        tmp_path / name,
        kubeconfig,
        *AGGREGATOR_ARGS,
        *extra,
        lease_seconds=LEASE_SECONDS,
        renew_deadline=RENEW_DEADLINE,
        port=port,
    )


async def stop(process: harness.Process) -> None:
    """SIGTERM, as Kubernetes stops a pod; it exits 0."""
    assert await asyncio.to_thread(process.stop, 30.0) == 0, process.tail()


async def start_fleet(
    kube: KubeEmulator,
    kubeconfig: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    tmp_path: Path,
) -> Fleet:
    """The installation at work: the pods' conditions written by the aggregator, the agents
    connected and armed (they know what to write when no aggregator answers)."""
    healthy, failing, own = await proxies.start(3)
    failing.set(FAILING)
    own.set(FAILING)
    add_pod(kube, "ds-healthy", healthy, readiness_gates=[GATE], node_name="node-2")
    add_pod(kube, "ds-failing", failing, readiness_gates=[GATE], node_name="node-2")
    pod = add_pod(kube, "sidecar-pod", own, readiness_gates=[GATE], node_name="node-1")
    leader = await aggregator(tmp_path, kubeconfig, "first")
    processes.append(leader)
    daemonset = harness.spawn_daemonset_agent(
        tmp_path,
        leader.address,
        kubeconfig,
        "node-2",
        name="daemonset",
        extra_args=[*AGENT_ARGS, *ARMED],
    )
    processes.append(daemonset)
    sidecar = spawn_sidecar(tmp_path, leader.address, own, pod, kubeconfig, *ARMED)
    processes.append(sidecar)
    for agent in (daemonset, sidecar):
        await asyncio.to_thread(harness.wait_connected, agent, WAIT)
        await eventually(lambda a=agent: "this agent will write" in a.log_text(), WAIT)
    wanted = {"ds-healthy": "True", "ds-failing": "False", "sidecar-pod": "False"}
    await eventually(lambda: all(condition(kube, n) == v for n, v in wanted.items()), WAIT)
    assert pod_writes_by_agents(kube) == []
    return Fleet(leader, daemonset, sidecar, healthy, failing, own)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


async def run_cleanup(environ: dict[str, str], kubeconfig: Path, tmp_path: Path) -> Outcome:
    """The cleanup Job's container, as a process: its command, its environment (the
    kubeconfig instead of the in-cluster account; the Lease's namespace as its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(name, None)
    env |= environ | {"POD_NAMESPACE": LEASE_NAMESPACE, "HOME": str(tmp_path)}
    env["SERVE_HEALTH_KUBECONFIG"] = str(kubeconfig)
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(WAIT):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Outcome(process.returncode, stdout.decode(), stderr.decode())


def cleanup_writes(kube: KubeEmulator) -> list[str]:
    return [
        f"{call.method} {call.name}"
        for method in WRITES
        for call in kube.requests(method)
        if user_agent(call) == CLEANUP_UA
    ]


def gates(kube: KubeEmulator) -> dict[str, dict[str, Any]]:
    """Each pod's condition of our type, as stored."""
    return {
        pod["metadata"]["name"]: next(c for c in pod["status"]["conditions"] if c["type"] == GATE)
        for pod in kube.list_objects(PODS)
    }


def assert_given_back(kube: KubeEmulator) -> None:
    """Every pod's condition True, the cleanup's reason; no agent's mark anywhere."""
    for name, written in gates(kube).items():
        assert (written["status"], written["reason"]) == ("True", UNINSTALLED_REASON), name
    for pod in kube.list_objects(PODS):
        assert marks.ANNOTATION not in (pod["metadata"].get("annotations") or {})
        reasons = [c.get("reason") for c in pod["status"]["conditions"]]
        assert marks.CONDITION_REASON not in reasons, pod["metadata"]["name"]


async def nothing_writes_back(kube: KubeEmulator, fleet: Fleet, since: float) -> None:
    """For QUIET (by the sidecar's probes, which go on), no agent writes a pod, and every pod
    stays given back. The sidecar's proxy recovers for a while, then fails again: an armed
    sidecar (which reads its pod only once its probes give it something to write: it is not
    watching when the cleanup writes) would begin its fallback, then write False back."""
    fleet.own.set(HEALTHY)
    await more_probes(fleet.own, RECOVERED)
    fleet.own.set(FAILING)
    await more_probes(fleet.own, QUIET)
    assert pod_writes_by_agents(kube, since) == [], fleet.sidecar.tail()
    assert_given_back(kube)


async def disarm_and_stop(
    kube: KubeEmulator,
    fleet: Fleet,
    kubeconfig: Path,
    processes: list[harness.Process],
    tmp_path: Path,
    name: str,
) -> None:
    """Steps 2 and 3 of docs/install.md's Uninstalling: the aggregator rolled with the agents'
    fallback off (the sidecar hears it), the DaemonSet deleted, the aggregator scaled to 0."""
    port = fleet.aggregator.port  # the Service's address
    rolled = await aggregator(tmp_path, kubeconfig, name, "--agent-fallback=off", port=port)
    processes.append(rolled)
    await eventually(lambda: DISARMED in fleet.sidecar.log_text(), WAIT)
    await stop(fleet.daemonset)
    await stop(rolled)
    assert lease_holder(kube) == ""


async def test_the_documented_order_gives_the_pods_back_and_nothing_writes_them_again(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    job_environment: dict[str, str],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    loop = asyncio.get_running_loop()
    fleet = await start_fleet(kube, kubeconfig_path, proxies, processes, tmp_path)

    # Step 2: the aggregator rolls with SERVE_HEALTH_AGENT_FALLBACK=off (the old one stopped,
    # the new one on the Service's address), then the rest.
    await stop(fleet.aggregator)
    await disarm_and_stop(kube, fleet, kubeconfig_path, processes, tmp_path, "rolled")
    # Step 4: the cleanup Job.
    result = await run_cleanup(job_environment, kubeconfig_path, tmp_path)
    assert result.code == 0, result.stderr
    done = loop.time()
    assert "refusing" not in result.stderr
    assert (
        result.stdout.strip()
        .splitlines()[-1]
        .startswith("summary: 3 pods: 3 changed, 0 already right, 0 failed")
    )
    assert_given_back(kube)
    await nothing_writes_back(kube, fleet, done)
    assert fleet.sidecar.alive


async def test_the_wrong_order_is_refused_and_the_advised_recovery_works(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    job_environment: dict[str, str],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    loop = asyncio.get_running_loop()
    fleet = await start_fleet(kube, kubeconfig_path, proxies, processes, tmp_path)

    # The aggregator scaled to 0 first: the agents, armed, fall back and write.
    await stop(fleet.aggregator)
    fleet.healthy.set(FAILING)
    fleet.own.set(HEALTHY)
    await eventually(lambda: condition(kube, "ds-healthy") == "False", WAIT)
    await eventually(lambda: condition(kube, "sidecar-pod") == "True", WAIT)
    for agent in (fleet.daemonset, fleet.sidecar):
        assert FALLBACK_BEGAN.search(agent.log_text()), agent.tail()
    before = gates(kube)

    refused = await run_cleanup(job_environment, kubeconfig_path, tmp_path)
    assert refused.code == 2, refused.stderr
    assert "refusing to clean up: agents in fallback" in refused.stderr
    assert "wrote 2 pods after" in refused.stderr
    assert (
        "default/ds-healthy (condition ray.io/serve-proxy-healthy=False, reason NoAggregator, "
        "by the agent node node-2 (DaemonSet)"
    ) in refused.stderr
    assert (
        "default/sidecar-pod (condition ray.io/serve-proxy-healthy=True, reason NoAggregator, "
        "by the agent default/sidecar-pod (sidecar)"
    ) in refused.stderr
    assert "delete daemonset/ray-serve-health-agent" in refused.stderr
    assert "SERVE_HEALTH_AGENT_FALLBACK=off" in refused.stderr
    assert cleanup_writes(kube) == []
    assert gates(kube) == before

    # What the refusal advises: the aggregator back with the fallback off (the apply), the
    # DaemonSet deleted, the aggregator scaled to 0 again; then the cleanup, again.
    fleet.own.set(FAILING)  # (the sidecar, disarmed, would write this back if it could)
    await disarm_and_stop(kube, fleet, kubeconfig_path, processes, tmp_path, "back")
    result = await run_cleanup(job_environment, kubeconfig_path, tmp_path)
    assert result.code == 0, result.stderr
    done = loop.time()
    assert_given_back(kube)
    await nothing_writes_back(kube, fleet, done)


async def test_an_agent_left_running_is_caught_writing_back(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: ProxyPool,
    processes: list[harness.Process],
    job_environment: dict[str, str],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    fleet = await start_fleet(kube, kubeconfig_path, proxies, processes, tmp_path)
    await stop(fleet.sidecar)  # (the sidecar is not the point here)
    await stop(fleet.aggregator)
    # The DaemonSet's pods carry what its probes say: it has nothing to write, so no mark.
    await more_probes(fleet.failing, FALLBACK_AFTER + LEASE_SECONDS)
    assert pod_writes_by_agents(kube) == []

    result = await run_cleanup(job_environment, kubeconfig_path, tmp_path)
    assert result.code == 1, result.stderr
    assert "default/ds-failing: written back by an agent in fallback" in result.stdout
    assert "not cleaned up for good: agents in fallback" in result.stderr
    assert (
        "default/ds-failing (condition ray.io/serve-proxy-healthy=False, reason NoAggregator, "
        "by the agent node node-2 (DaemonSet)"
    ) in result.stderr
    assert "delete daemonset/ray-serve-health-agent" in result.stderr
    assert condition(kube, "ds-failing") == "False"

    again = await run_cleanup(job_environment, kubeconfig_path, tmp_path)
    assert again.code == 2, again.stderr
    assert "refusing to clean up: agents in fallback" in again.stderr
    # Only the first run wrote (each pod once); the second changed nothing.
    assert sorted(cleanup_writes(kube)) == [
        "PATCH ds-failing",
        "PATCH ds-healthy",
        "PATCH sidecar-pod",
    ]
