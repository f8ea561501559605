"""How long does the aggregator take to fail over, and does a failover write anything?

Two real aggregator processes (``python -m aggregator --leader-elect``, the default timings:
lease 3 s, renew deadline 2 s, retry 500 ms) run against the Kubernetes API emulator of the
tests (``tests/kube/emulator.py``, kmock over real HTTP, served by this process). The emulator
holds ``--pods`` Ray pods, all labelled ``ray.io/serve=true``, whose pod IP and serve port point
at one fake Serve proxy (healthy), and one pod per replica in the aggregator's namespace. One
sidecar agent per Ray pod (real ``node_agent`` code, real gRPC streams, run in this process)
connects through the aggregator's Service, emulated by ``tests/kube/service_router.py``: the
pods labelled ``ray-serve-health/leader=true`` (the label the leader puts on its own pod) that
are Ready (``/readyz``, probed every second as the Deployment's readiness probe does).

Before each kill, both replicas must be Ready and only the leader routed to. Then ``--kills``
times: SIGKILL the leader and measure, from the kill,

- ``serving``: until the standby answers SERVING on grpc.health.v1 (service ""), i.e. until it
  holds the Lease, has listed the pods and seeded them from their labels;
- ``routed``: until the Service routes to it alone (it labelled its own pod; it is Ready);
- ``agents``: until every agent has reconnected to it (``GetSummary.agents_connected``);
- ``spurious writes``: PATCH requests to Ray pods (and Events created) from one second before
  the kill until one second after every agent is back. Nothing changed, so any write is
  spurious. The leader-label PATCHes of the aggregator's own pods are counted apart.

The killed replica is then started again (same ports) as the new standby, and the next kill
comes once it is Ready. Prints one row per kill and the medians; writes
bench/results/failover.json. About a minute with the defaults::

    .venv/bin/python -m bench.failover
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import kmock
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.flags import AggregatorFlags
from bench import harness
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.probe import Prober, make_session
from tests.fakes import FakeServeProxy
from tests.kube.emulator import EVENTS, PODS, KubeEmulator
from tests.kube.service_router import Backend, ServiceRouter

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "failover.json"
NS = "ray"
LEASE_NAMESPACE = "ray-serve-health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: How often the bench looks at the replicas while it waits.
POLL = 0.02
#: Agents reporting for pods need no token here (the aggregators are told so).
NO_AUTH = ("--auth", "none")
TARGET = 5.0  # issue 7: the standby takes over within 5 s
#: The label the leader puts on its own pod (--leader-label's default); the Service selects it.
LEADER_LABEL = "ray-serve-health/leader"
AGGREGATOR_LABELS = {
    "app.kubernetes.io/name": "ray-serve-health",
    "app.kubernetes.io/component": "aggregator",
}


@dataclass
class Replica:
    name: str
    port: int
    log_dir: Path
    metrics_port: int = 0
    generation: int = 0
    process: asyncio.subprocess.Process | None = None

    def __post_init__(self) -> None:
        if not self.metrics_port:
            self.metrics_port = harness.free_port()

    @property
    def pod(self) -> str:
        """Its pod in the emulator ($POD_NAME), in LEASE_NAMESPACE."""
        return f"ray-serve-health-aggregator-{self.name}"

    @property
    def address(self) -> str:
        return f"{harness.HOST}:{self.port}"

    @property
    def identity(self) -> str:
        """Its --leader-elect-identity (the Lease's holderIdentity while it leads)."""
        return f"{self.name}-{self.generation}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"aggregator-{self.name}-{self.generation}.log"

    async def start(self, kubeconfig: Path) -> None:
        self.generation += 1
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
        with self.log.open("wb") as output:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "aggregator",
                f"--listen={self.address}",
                f"--metrics-listen={harness.HOST}:{self.metrics_port}",
                "--kube-backend=kubernetes",
                f"--kubeconfig={kubeconfig}",
                "--namespace",
                NS,
                "--leader-elect=true",
                f"--leader-elect-namespace={LEASE_NAMESPACE}",
                f"--leader-elect-identity={self.identity}",
                *NO_AUTH,
                env={
                    **environ,
                    "PYTHONUNBUFFERED": "1",
                    "POD_NAME": self.pod,
                    "POD_NAMESPACE": LEASE_NAMESPACE,
                },
                cwd=REPO_ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=output,
            )

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.process.wait(), 10)

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-20:]
        return f"--- {self.log} ---\n" + "\n".join(lines)


def add_aggregator_pods(emulator: KubeEmulator, replicas: Sequence[Replica]) -> None:
    """One pod per replica in LEASE_NAMESPACE, on a node of its own (no serve port)."""
    for number, replica in enumerate(replicas):
        emulator.add_pod(
            LEASE_NAMESPACE,
            replica.pod,
            labels=AGGREGATOR_LABELS,
            node_name=f"system-{number}",
            pod_ip=harness.HOST,
            serve_port=None,
        )


@contextlib.asynccontextmanager
async def service(
    emulator: KubeEmulator, replicas: Sequence[Replica]
) -> AsyncIterator[ServiceRouter]:
    """The aggregator's Service: Ready pods labelled as the leader (see the docstring)."""
    router = ServiceRouter(
        emulator,
        LEASE_NAMESPACE,
        {**AGGREGATOR_LABELS, LEADER_LABEL: "true"},
        {r.pod: Backend(r.port, r.metrics_port) for r in replicas},
    )
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


async def health(replica: Replica) -> int | None:
    try:
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return answer.status
    except grpc.aio.AioRpcError:
        return None


async def has_status(replica: Replica, status: int) -> bool:
    return await health(replica) == status


async def agents_on(replica: Replica, count: int) -> bool:
    return await agents_connected(replica) == count


async def agents_connected(replica: Replica) -> int:
    try:
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = pb_grpc.InspectionServiceStub(channel)
            summary = await stub.GetSummary(pb.GetSummaryRequest(), timeout=1)
            return summary.agents_connected
    except grpc.aio.AioRpcError:
        return -1


async def until(
    check: Callable[[], Awaitable[bool]], within: float, what: str, replicas: Sequence[Replica]
) -> float:
    """Poll ``check()`` every POLL seconds; the seconds it took (TimeoutError after within)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await check():
        if loop.time() - started > within:
            logs = "\n".join(replica.tail() for replica in replicas)
            raise TimeoutError(f"{what}: not within {within:g}s\n{logs}")
        await asyncio.sleep(POLL)
    return loop.time() - started


@contextlib.asynccontextmanager
async def run_agents(
    emulator: KubeEmulator, proxy: FakeServeProxy, addresses: str
) -> AsyncIterator[list[Agent]]:
    session = make_session(max_idle=64, max_idle_per_host=64)  # every agent probes one proxy
    agents: list[Agent] = []
    tasks = []
    try:
        for pod in emulator.list_objects(PODS, NS):
            identity = SidecarPod(NS, pod["metadata"]["name"], pod["metadata"]["uid"], "node-1")
            settings = AgentFlags(aggregator=addresses, proxy_url=proxy.url, token_file="")
            agent = Agent(settings, identity, Prober(session, settings.probe_timeout))
            agents.append(agent)
            tasks.append(asyncio.create_task(agent.run(), name=f"agent {identity}"))
        yield agents
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()


@dataclass
class Kill:
    kill: int
    killed: str
    new_leader: str
    serving_s: float
    routed_s: float
    agents_s: float
    spurious_patches: int
    spurious_events: int
    leader_label_patches: int


async def roles(
    replicas: Sequence[Replica], router: ServiceRouter
) -> tuple[Replica, Replica] | None:
    """(leader, standby) once one serves, the other does not, both are Ready and the Service
    routes to the leader alone; else None."""
    statuses = [await health(replica) for replica in replicas]
    if sorted(statuses, key=str) != sorted([SERVING, NOT_SERVING], key=str):
        return None
    leader = replicas[statuses.index(SERVING)]
    standby = next(r for r in replicas if r is not leader)
    if not all(router.ready(r.pod) for r in replicas) or router.endpoints() != [leader.pod]:
        return None
    return leader, standby


async def failover(args: argparse.Namespace, log_dir: Path) -> list[Kill]:
    kills: list[Kill] = []
    async with (
        KubeEmulator() as emulator,
        kmock.Server(emulator),
    ):
        proxy = await FakeServeProxy().start()
        replicas = [Replica(name, harness.free_port(), log_dir) for name in ("a", "b")]
        try:
            for number in range(args.pods):
                emulator.add_pod(
                    NS,
                    f"ray-worker-{number:04d}",
                    labels={"ray.io/node-type": "worker", "ray.io/serve": "true"},
                    node_name=f"node-{number % 10}",
                    pod_ip=harness.HOST,
                    serve_port=proxy.port,
                )
            add_aggregator_pods(emulator, replicas)
            kubeconfig = emulator.write_kubeconfig(log_dir / "kubeconfig")
            for replica in replicas:
                await replica.start(kubeconfig)
            async with (
                service(emulator, replicas) as router,
                run_agents(emulator, proxy, router.address),
            ):

                async def settled() -> bool:
                    return await roles(replicas, router) is not None

                for index in range(1, args.kills + 1):
                    await until(settled, 60, "both Ready, the Service on the leader", replicas)
                    found = await roles(replicas, router)
                    assert found is not None
                    leader, standby = found
                    all_on = functools.partial(agents_on, count=args.pods)
                    await until(
                        functools.partial(all_on, leader), 60, "agents on the leader", replicas
                    )
                    assert await agents_connected(standby) == 0, "agents on the standby"
                    await asyncio.sleep(args.steady)  # the standby watches the Lease meanwhile
                    mark = emulator.checkpoint()
                    await asyncio.sleep(1.0)
                    loop = asyncio.get_running_loop()
                    killed = loop.time()
                    await leader.kill()

                    serving = functools.partial(has_status, standby, SERVING)
                    serving_s = await until(serving, 30, "the standby takes over", [standby])

                    async def routed(standby: Replica = standby) -> bool:
                        return router.endpoints() == [standby.pod]

                    await until(routed, 30, "the Service routes to the new leader", [standby])
                    routed_s = loop.time() - killed
                    await until(
                        functools.partial(all_on, standby), 30, "agents reconnect", [standby]
                    )
                    agents_s = loop.time() - killed
                    await asyncio.sleep(1.0)
                    patches = emulator.requests("PATCH", resource=PODS, namespace=NS, since=mark)
                    events = emulator.requests("POST", resource=EVENTS, since=mark)
                    own = emulator.requests(
                        "PATCH", resource=PODS, namespace=LEASE_NAMESPACE, since=mark
                    )
                    kill = Kill(
                        index,
                        leader.identity,
                        standby.identity,
                        round(serving_s, 3),
                        round(routed_s, 3),
                        round(agents_s, 3),
                        len(patches),
                        len(events),
                        len(own),
                    )
                    kills.append(kill)
                    print(
                        f"  kill {index}: {kill.killed} killed; {kill.new_leader} SERVING after "
                        f"{serving_s:.2f}s, routed after {routed_s:.2f}s, all {args.pods} agents "
                        f"back after {agents_s:.2f}s, {len(patches)} Ray pod PATCHes, "
                        f"{len(events)} Events, {len(own)} leader-label PATCHes",
                        flush=True,
                    )
                    await leader.start(kubeconfig)  # back, as the new standby
        finally:
            for replica in replicas:
                await replica.kill()
            await proxy.stop()
            await emulator.close()
    return kills


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=50, help="pods, one agent each (50)")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs of the leader (5)")
    parser.add_argument(
        "--steady", type=float, default=2.0, help="seconds of steady state before a kill (2)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    # The agents run in this process: their reconnection warnings are the expected story.
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    load_before = os.getloadavg()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-failover-"))
    print(
        f"failover: {args.kills} SIGKILLs of the leader, {args.pods} pods and agents, logs in "
        f"{log_dir} (load average {load_before[0]:.2f} on {os.cpu_count()} CPUs)",
        flush=True,
    )
    try:
        kills = asyncio.run(failover(args, log_dir))
    except (TimeoutError, harness.HarnessError, AssertionError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()

    print()
    print(
        f"{'kill':>4}  {'killed':>7}  {'new leader':>10}  {'SERVING':>8}  {'routed':>8}  "
        f"{'agents back':>11}  {'PATCHes':>7}  {'Events':>6}  {'label PATCHes':>13}"
    )
    for kill in kills:
        print(
            f"{kill.kill:>4}  {kill.killed:>7}  {kill.new_leader:>10}  {kill.serving_s:>7.2f}s  "
            f"{kill.routed_s:>7.2f}s  {kill.agents_s:>10.2f}s  {kill.spurious_patches:>7}  "
            f"{kill.spurious_events:>6}  {kill.leader_label_patches:>13}"
        )
    median_serving = statistics.median(kill.serving_s for kill in kills)
    median_routed = statistics.median(kill.routed_s for kill in kills)
    median_agents = statistics.median(kill.agents_s for kill in kills)
    spurious = sum(kill.spurious_patches + kill.spurious_events for kill in kills)
    print(
        f"{'med':>4}  {'':>7}  {'':>10}  {median_serving:>7.2f}s  {median_routed:>7.2f}s  "
        f"{median_agents:>10.2f}s"
    )
    print()
    print(
        f"median failover (SIGKILL -> new leader SERVING): {median_serving:.2f}s "
        f"(target <= {TARGET:g}s, max {max(k.serving_s for k in kills):.2f}s); routed by the "
        f"Service: {median_routed:.2f}s (max {max(k.routed_s for k in kills):.2f}s); all agents "
        f"back: {median_agents:.2f}s; spurious writes: {spurious}"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")

    result = {
        "benchmark": "failover",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "pods": args.pods,
        "timings": {
            "lease_duration_s": AggregatorFlags.leader_elect_lease_duration,
            "renew_deadline_s": AggregatorFlags.leader_elect_renew_deadline,
            "retry_period_s": AggregatorFlags.leader_elect_retry_period,
            "agent_reconnect_max_s": AgentFlags.reconnect_max,
        },
        "unit": "seconds after SIGKILL of the leader",
        "kills": [dataclasses.asdict(kill) for kill in kills],
        "routing": "Service: Ready pods labelled ray-serve-health/leader=true",
        "median": {
            "serving_s": median_serving,
            "routed_s": median_routed,
            "agents_s": median_agents,
        },
        "max": {
            "serving_s": max(kill.serving_s for kill in kills),
            "routed_s": max(kill.routed_s for kill in kills),
            "agents_s": max(kill.agents_s for kill in kills),
        },
        "spurious_writes": spurious,
        "target_s": TARGET,
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 0 if spurious == 0 and max(k.routed_s for k in kills) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
