"""Helpers for tests that run real ``serve-health-agent`` processes on the Kubernetes API
emulator and tell their requests from the aggregator's (by User-Agent): sidecars, loopback
proxies, and the write requests each side made.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from testsupport import harness
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import ApiCall, KubeEmulator
from testsupport.waiting import eventually

GATE = "ray.io/serve-proxy-healthy"
LABEL = "ray.io/serve"
LABELS = {"ray.io/node-type": "worker"}
FALLBACK_AFTER = 2.0
#: Probes: short enough that the stories stay short, long enough that a healthy loopback proxy
#: in a loaded test process is never taken for a hung one (with a 200 ms timeout and two busy
#: loops on the cores, a healthy proxy timed out, and the aggregator rightly wrote it False).
PROBE_INTERVAL = 0.6
FAILING = (503, "Service Unavailable")
AGENT_UA = "ray-serve-health-agent/"
AGGREGATOR_UA = "ray-serve-health"
WRITES = ("PATCH", "POST", "PUT", "DELETE")
AGENT_ARGS = (
    f"--interval={PROBE_INTERVAL * 1000:.0f}ms",
    "--probe-timeout=500ms",
    f"--fallback-after={FALLBACK_AFTER}s",
)
FALLBACK_BEGAN = re.compile(r"no aggregator for \d+s: writing for my \d+ pods? myself")
STARTED = re.compile(r"agent for pod \S+ on node")


def user_agent(call: ApiCall) -> str:
    return next((v for k, v in call.headers.items() if k.lower() == "user-agent"), "")


def by_agent(call: ApiCall) -> bool:
    return user_agent(call).startswith(AGENT_UA)


def writes_by(kube: KubeEmulator, agent: bool, since: float = float("-inf")) -> list[ApiCall]:
    """Write requests (PATCH, POST, ...) made by agents (or by the aggregator) since ``since``
    (event-loop time)."""
    return [
        call
        for method in WRITES
        for call in kube.requests(method)
        if call.at >= since and (by_agent(call) if agent else user_agent(call) == AGGREGATOR_UA)
    ]


def condition(kube: KubeEmulator, name: str) -> str | None:
    found = kube.pod_conditions("default", name).get(GATE)
    return found["status"] if found else None


def add_pod(kube: KubeEmulator, name: str, proxy: FakeServeProxy, **settings: Any) -> dict:
    return kube.add_pod(
        "default",
        name,
        labels={**LABELS, **settings.pop("labels", {})},
        pod_ip="127.0.0.1",
        serve_port=proxy.port,
        **settings,
    )


def spawn_sidecar(
    log_dir: Path,
    aggregator: str,
    proxy: FakeServeProxy,
    pod: dict[str, Any],
    kubeconfig: Path,
    *extra: str,
) -> harness.Process:
    """A sidecar agent process for ``pod`` (as stored in the emulator), returned at once."""
    metadata = pod["metadata"]
    identity = harness.PodIdentity("default", metadata["name"], metadata["uid"], "node-1")
    return harness.spawn(
        metadata["name"],
        [
            "-m",
            "node_agent",
            f"--aggregator={aggregator}",
            f"--proxy-url={proxy.url}",
            f"--kubeconfig={kubeconfig}",
            *AGENT_ARGS,
            *extra,
        ],
        log_dir / f"{metadata['name']}.log",
        harness.agent_environ(identity),
    )


async def more_probes(proxy: FakeServeProxy, seconds: float) -> None:
    """Wait until ``proxy`` has seen ``seconds`` worth of the agent's probes (at least): the
    agent's probes as a clock."""
    target = proxy.requests + max(1, round(seconds / PROBE_INTERVAL))
    await eventually(lambda: proxy.requests >= target, timeout=seconds * 3 + 10)


class ProxyPool:
    """Running loopback proxies: ``await pool.start(n)`` more, ``await pool.stop()`` them all."""

    def __init__(self) -> None:
        self.started: list[FakeServeProxy] = []

    async def start(self, count: int) -> list[FakeServeProxy]:
        fresh = [await FakeServeProxy().start() for _ in range(count)]
        self.started.extend(fresh)
        return fresh

    async def stop(self) -> None:
        for proxy in self.started:
            await proxy.stop()


def stop_all(running: list[harness.Process]) -> None:
    """Stop ``running`` processes in reverse order."""
    for process in reversed(running):
        process.stop()


# -- the aggregators' Lease (issue 26) ---------------------------------------------------------

#: The Lease an aggregator run with ``--leader-elect-namespace=default`` renews (its default
#: ``--leader-elect-lease-name``), as an agent's ``--fallback-lease`` names it.
LEASE_NAMESPACE = "default"
LEASE_NAME = "ray-serve-health-aggregator"
LEASE = f"{LEASE_NAMESPACE}/{LEASE_NAME}"


def leading_aggregator(
    log_dir: Path,
    kubeconfig: Path,
    *extra: str,
    lease_seconds: int,
    renew_deadline: float,
    port: int | None = None,
) -> harness.AggregatorProcess:
    """A real aggregator on the emulator with ``--leader-elect`` (its Lease in ``default``,
    renewed every 500 ms), returned once it listens; ``extra`` says how it refuses agents.
    Blocking: call it with ``asyncio.to_thread``."""
    return harness.start_aggregator(
        log_dir,
        port,
        [
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=true",
            f"--leader-elect-namespace={LEASE_NAMESPACE}",
            f"--leader-elect-lease-duration={lease_seconds}s",
            f"--leader-elect-renew-deadline={renew_deadline}s",
            "--leader-elect-retry-period=500ms",
            *extra,
        ],
    )


def lease_spec(kube: KubeEmulator) -> dict[str, Any]:
    """The aggregators' Lease's spec as stored now ({} if there is none)."""
    lease = kube.lease(LEASE_NAMESPACE, LEASE_NAME)
    return dict((lease or {}).get("spec") or {})


def lease_holder(kube: KubeEmulator) -> str:
    """Who holds the aggregators' Lease now ("" if nobody: none, or released)."""
    return str(lease_spec(kube).get("holderIdentity") or "")


def lease_writes(kube: KubeEmulator) -> list[ApiCall]:
    """The writes (POST, PUT, PATCH) of the aggregators' Lease that reached the emulator."""
    return [
        call
        for method in ("POST", "PUT", "PATCH")
        for call in kube.requests(method, resource="leases", namespace=LEASE_NAMESPACE)
        if call.name in (LEASE_NAME, None)
    ]


def agent_read_the_lease(kube: KubeEmulator) -> bool:
    """Whether an agent has asked the emulator for a Lease (a get or a watch)."""
    return any(by_agent(call) for call in kube.requests("GET", resource="leases"))


def kill(process: harness.Process, timeout: float = 10.0) -> int:
    """SIGKILL ``process`` (by its pid; no chance to release anything) and wait for it; its
    exit code. Blocking: call it with ``asyncio.to_thread``."""
    if process.alive:
        process.popen.kill()
    return process.popen.wait(timeout)


def pod_writes_by_agents(kube: KubeEmulator, since: float = float("-inf")) -> list[ApiCall]:
    """Agents' writes of pods (PATCH of a pod or of its status; not Events) since ``since``."""
    return [call for call in writes_by(kube, agent=True, since=since) if call.resource == "pods"]
