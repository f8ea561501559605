"""How long does the aggregator take to fail over, and does a failover write anything?

Two real aggregator processes (``python -m aggregator --leader-elect``, the default timings:
lease 8 s, renew deadline 6 s, retry 1 s; lease 3 s, 2 s, 500 ms before issue 28) run against
the Kubernetes API emulator of the tests (``testsupport/kube/emulator.py``, kmock over real HTTP,
served by this process). The emulator
holds ``--pods`` Ray pods, all labelled ``ray.io/serve=true``, whose pod IP and serve port point
at one fake Serve proxy (healthy), and one pod per replica in the aggregator's namespace. One
sidecar agent per Ray pod (real ``node_agent`` code, real gRPC streams, run in this process)
connects through the aggregator's Service, emulated by ``testsupport/kube/service_router.py``: the
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
bench/results/failover.json; fails if a failover took longer than ``--target`` (the lease
duration + 2 s) or wrote anything. About two minutes with the defaults::

    .venv/bin/python -m bench.failover

On a slow API server (issue 28, point 9): ``--api-latency`` delays every request the emulator
answers by a draw from a distribution (``bench/api_latency.py``: ``p99-1s`` answers 99 % in
20-50 ms and 1 % in 1-3 s), ``--lease-duration``/``--renew-deadline``/``--retry-period`` set
both replicas' ``--leader-elect-*`` timings, and ``--quiet SECONDS`` first watches the pair
with no kill for that long: every leadership loss then is churn (the leader could not renew in
time and exited, or a standby took the Lease over). A replica that exits on its own is started
again after ``--restart-delay`` (as the kubelet would restart it; in the kill phase too).
The quiet phase reports the losses, the Lease's holder changes and leaseTransitions, the
seconds with no replica SERVING, and the leaders' failed renewal attempts
(``serve_health_lease_renew_failures_total``)::

    .venv/bin/python -m bench.failover --api-latency p99-1s --quiet 600 \
        --lease-duration 15 --renew-deadline 10 --retry-period 2 --target 0 \
        --output bench/results/failover-slow-api-15s.json
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
import subprocess
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
from bench import api_latency
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.probe import Prober, make_session
from testsupport import harness
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import EVENTS, LEASES, PODS, KubeEmulator
from testsupport.kube.service_router import Backend, ServiceRouter

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
#: The target: routed within a lease duration (the standby waits that long after the last
#: renewal it saw) plus this (the Lease write, the pod list, the label). With lease 3 s, issue
#: 7's 5 s; with the defaults since issue 28 (lease 8 s), 10 s.
TARGET_MARGIN = 2.0
#: The label the leader puts on its own pod (--leader-label's default); the Service selects it.
LEADER_LABEL = "ray-serve-health/leader"
AGGREGATOR_LABELS = {
    "app.kubernetes.io/name": "ray-serve-health",
    "app.kubernetes.io/component": "aggregator",
}
#: The replicas' Lease (--leader-elect-lease-name's default).
LEASE_NAME = "ray-serve-health-aggregator"
#: The leader's /metrics counter of failed renewal attempts.
RENEW_FAILURES = "serve_health_lease_renew_failures_total"


@dataclass(frozen=True)
class Timings:
    """The replicas' --leader-elect-* timings, seconds (None: the aggregator's default)."""

    lease_duration: float | None = None
    renew_deadline: float | None = None
    retry_period: float | None = None

    def flags(self) -> list[str]:
        given = (
            ("lease-duration", self.lease_duration),
            ("renew-deadline", self.renew_deadline),
            ("retry-period", self.retry_period),
        )
        return [f"--leader-elect-{name}={value:g}s" for name, value in given if value is not None]

    def effective(self) -> dict[str, float]:
        """What the replicas run with (the defaults where not given)."""
        defaults = AggregatorFlags
        return {
            "lease_duration_s": self.lease_duration or defaults.leader_elect_lease_duration,
            "renew_deadline_s": self.renew_deadline or defaults.leader_elect_renew_deadline,
            "retry_period_s": self.retry_period or defaults.leader_elect_retry_period,
        }


@dataclass
class Exit:
    """A replica's process that ended without the bench killing it."""

    at_s: float  # seconds since the bench started
    replica: str
    identity: str
    returncode: int | None
    reason: str  # the "leader election: ..." line of its log, if any
    load_average: float = 0.0  # the machine's, over the last minute (shared cores)


@dataclass
class Replica:
    name: str
    port: int
    log_dir: Path
    metrics_port: int = 0
    generation: int = 0
    process: asyncio.subprocess.Process | None = None
    timings: Timings = dataclasses.field(default_factory=Timings)
    #: Started again by :func:`supervise` when it exits on its own (not while the bench kills).
    supervised: bool = False
    #: The last value of RENEW_FAILURES seen, per generation.
    renew_failures: dict[int, float] = dataclasses.field(default_factory=dict)

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
                *self.timings.flags(),
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
        self.supervised = True

    async def kill(self) -> None:
        self.supervised = False
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.process.wait(), 10)

    def exited(self) -> bool:
        return self.process is not None and self.process.returncode is not None

    def why_exited(self) -> str:
        """The log's last "leader election: ... exiting" line (why it stepped down)."""
        lines = self.log.read_text(errors="replace").splitlines()
        found = [line for line in lines if "leader election:" in line and "exiting" in line]
        return found[-1].strip()[-400:] if found else ""

    async def scrape_renew_failures(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        try:
            value = await asyncio.to_thread(harness.metric_value, self.metrics_port, RENEW_FAILURES)
        except OSError:
            return
        if value is not None:
            self.renew_failures[self.generation] = value

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


async def supervise(
    replicas: Sequence[Replica], kubeconfig: Path, delay: float, started: float, exits: list[Exit]
) -> None:
    """The kubelet's part: a supervised replica whose process ended is recorded and started
    again ``delay`` seconds later (as the Deployment's pod restarts its container)."""
    loop = asyncio.get_running_loop()
    while True:
        for replica in replicas:
            if replica.supervised and replica.exited():
                assert replica.process is not None
                exits.append(
                    Exit(
                        round(loop.time() - started, 2),
                        replica.name,
                        replica.identity,
                        replica.process.returncode,
                        replica.why_exited(),
                        round(os.getloadavg()[0], 2),
                    )
                )
                print(f"  {replica.identity} exited by itself: {exits[-1].reason}", flush=True)
                replica.supervised = False
                await asyncio.sleep(delay)
                await replica.start(kubeconfig)
        await asyncio.sleep(POLL * 5)


@dataclass
class Churn:
    """What happened while nobody killed anything (``--quiet``)."""

    seconds: float
    leadership_losses: int  # the leader stepped down by itself ("lost the lease")
    exits: int  # replicas that ended by themselves, whatever the reason
    holder_changes: int  # the Lease named another holder (as polled in the store)
    lease_transitions: int  # spec.leaseTransitions, end minus start
    leaderless_s: float  # no replica answered SERVING
    renew_failures: float  # the leaders' failed renewal attempts (/metrics, every second)
    lease_requests: int
    #: How late this process's event loop (the emulator's, the agents') woke from 100 ms
    #: sleeps: CPU starvation that slows the API beyond the injected delays.
    loop_lag_p50_s: float
    loop_lag_p99_s: float
    loop_lag_max_s: float
    load_average_max: float  # the machine's 1-minute load, highest seen
    events: list[dict[str, object]]

    @property
    def losses_per_hour(self) -> float:
        return self.leadership_losses * 3600 / self.seconds if self.seconds else 0.0


class HealthChecks:
    """grpc.health.v1 checks of the replicas on one channel per process (a new channel per
    check, as :func:`health` opens, costs this process CPU the emulator shares)."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}

    async def status(self, replica: Replica) -> int | None:
        key = f"{replica.identity}@{replica.address}"
        known = self._channels.get(replica.name)
        if known is None or known[0] != key:
            if known is not None:
                await known[1].close()
            known = (key, grpc.aio.insecure_channel(replica.address))
            self._channels[replica.name] = known
        try:
            stub = health_pb2_grpc.HealthStub(known[1])
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return answer.status
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        for _, channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def lease_spec(emulator: KubeEmulator) -> dict[str, object]:
    lease = emulator.lease(LEASE_NAMESPACE, LEASE_NAME)
    return dict(lease.get("spec") or {}) if lease else {}


async def quiet_period(
    seconds: float,
    emulator: KubeEmulator,
    replicas: Sequence[Replica],
    exits: list[Exit],
    started: float,
) -> Churn:
    """Watch the pair for ``seconds`` without killing anything (see the module's docstring)."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    mark = emulator.checkpoint()
    exits_before = len(exits)
    before = {(r.name, r.generation): r.renew_failures.get(r.generation, 0.0) for r in replicas}
    spec = lease_spec(emulator)
    first_transitions = int(spec.get("leaseTransitions") or 0)  # type: ignore[call-overload]
    holder = str(spec.get("holderIdentity") or "")
    events: list[dict[str, object]] = []
    changes = 0
    leaderless = 0.0
    checks = HealthChecks()
    lags: list[float] = []
    load_max = 0.0
    last_check = loop.time()
    last_scrape = loop.time()
    while (now := loop.time()) - begin < seconds:
        spec = lease_spec(emulator)
        current = str(spec.get("holderIdentity") or "")
        if current != holder:
            changes += 1
            events.append({"at_s": round(now - started, 2), "holder": current, "was": holder})
            print(f"  Lease holder {holder or '(none)'} -> {current or '(none)'}", flush=True)
            holder = current
        if now - last_check >= 0.25:
            statuses = await asyncio.gather(*(checks.status(r) for r in replicas))
            checked = loop.time()
            if SERVING not in statuses:
                leaderless += checked - last_check
            last_check = checked
        if now - last_scrape >= 1.0:
            await asyncio.gather(*(r.scrape_renew_failures() for r in replicas))
            last_scrape = loop.time()
        asleep = loop.time()
        await asyncio.sleep(0.1)
        lags.append(max(0.0, loop.time() - asleep - 0.1))
        load_max = max(load_max, os.getloadavg()[0])
    await checks.close()
    lags.sort()
    await asyncio.gather(*(r.scrape_renew_failures() for r in replicas))
    failures = 0.0
    for replica in replicas:
        for generation, value in replica.renew_failures.items():
            failures += value - before.get((replica.name, generation), 0.0)
    spec = lease_spec(emulator)
    quiet_exits = exits[exits_before:]
    for found in quiet_exits:
        events.append(dataclasses.asdict(found))
    return Churn(
        seconds=round(loop.time() - begin, 1),
        leadership_losses=sum(1 for e in quiet_exits if "lost the lease" in e.reason),
        exits=len(quiet_exits),
        holder_changes=changes,
        lease_transitions=int(spec.get("leaseTransitions") or 0) - first_transitions,  # type: ignore[call-overload]
        leaderless_s=round(leaderless, 2),
        renew_failures=failures,
        lease_requests=len(emulator.requests(resource=LEASES, since=mark)),
        loop_lag_p50_s=round(lags[len(lags) // 2], 4) if lags else 0.0,
        loop_lag_p99_s=round(lags[int(len(lags) * 0.99)], 4) if lags else 0.0,
        loop_lag_max_s=round(lags[-1], 4) if lags else 0.0,
        load_average_max=round(load_max, 2),
        events=events,
    )


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


@dataclass
class Run:
    kills: list[Kill]
    churn: Churn | None
    exits: list[Exit]
    kill_error: str = ""  # the kill phase did not complete (why)


async def failover(args: argparse.Namespace, log_dir: Path) -> Run:
    kills: list[Kill] = []
    churn: Churn | None = None
    exits: list[Exit] = []
    kill_error = ""
    timings = Timings(args.lease_duration, args.renew_deadline, args.retry_period)
    lease_s = timings.effective()["lease_duration_s"]
    within = max(30.0, 2 * lease_s + 10)  # a takeover waits a lease duration, then lists pods
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with (
        KubeEmulator() as emulator,
        kmock.Server(emulator),
    ):
        if args.latency.kind != "none":
            emulator.slow(args.recorder)  # every request, Lease, pods and watches alike
        proxy = await FakeServeProxy().start()
        replicas = [
            Replica(name, harness.free_port(), log_dir, timings=timings) for name in ("a", "b")
        ]
        supervisor: asyncio.Task[None] | None = None
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
            supervisor = asyncio.create_task(
                supervise(replicas, kubeconfig, args.restart_delay, started, exits),
                name="supervisor",
            )
            async with (
                service(emulator, replicas) as router,
                run_agents(emulator, proxy, router.address),
            ):

                async def settled() -> bool:
                    return await roles(replicas, router) is not None

                if args.quiet > 0:
                    await until(settled, 120, "both Ready, the Service on the leader", replicas)
                    print(f"  quiet: {args.quiet:g}s with no kill", flush=True)
                    churn = await quiet_period(args.quiet, emulator, replicas, exits, started)
                    print(
                        f"  quiet: {churn.leadership_losses} leadership losses, "
                        f"{churn.holder_changes} Lease holder changes, {churn.leaderless_s:.1f}s "
                        f"with no leader SERVING, {churn.renew_failures:g} failed renewals",
                        flush=True,
                    )
                try:
                    for index in range(1, args.kills + 1):
                        await until(settled, 120, "both Ready, the Service on the leader", replicas)
                        while (found := await roles(replicas, router)) is None:
                            # A leadership loss between the two looks: wait again.
                            await until(settled, 120, "both Ready, one leader", replicas)
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
                        serving_s = await until(
                            serving, within, "the standby takes over", [standby]
                        )

                        async def routed(standby: Replica = standby) -> bool:
                            return router.endpoints() == [standby.pod]

                        await until(
                            routed, within, "the Service routes to the new leader", [standby]
                        )
                        routed_s = loop.time() - killed
                        await until(
                            functools.partial(all_on, standby),
                            within,
                            "agents reconnect",
                            [standby],
                        )
                        agents_s = loop.time() - killed
                        await asyncio.sleep(1.0)
                        patches = emulator.requests(
                            "PATCH", resource=PODS, namespace=NS, since=mark
                        )
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
                            f"  kill {index}: {kill.killed} killed; {kill.new_leader} "
                            f"SERVING after {serving_s:.2f}s, routed after {routed_s:.2f}s, "
                            f"all {args.pods} agents back after {agents_s:.2f}s, "
                            f"{len(patches)} Ray pod PATCHes, {len(events)} Events, "
                            f"{len(own)} leader-label PATCHes",
                            flush=True,
                        )
                        await leader.start(kubeconfig)  # back, as the new standby
                except (TimeoutError, AssertionError) as error:
                    # Keep what the quiet phase found: report it with the kills done so far.
                    kill_error = (str(error).splitlines() or [repr(error)])[0]
                    print(f"FAILED in the kill phase: {error}", file=sys.stderr, flush=True)
        finally:
            if supervisor is not None:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
            for replica in replicas:
                await replica.kill()
            await proxy.stop()
            await emulator.close()
    return Run(kills, churn, exits, kill_error)


def seconds(text: str) -> float:
    """A bench option in seconds: ``3``, ``2.5`` or ``500ms``/``3s``."""
    value = text.strip()
    if value.endswith("ms"):
        return float(value[:-2]) / 1000
    return float(value.removesuffix("s"))


def latency_option(text: str) -> api_latency.Latency:
    try:
        return api_latency.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def uptime() -> str:
    """``uptime``'s line (other benchmarks may share the machine), or the load averages."""
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=50, help="pods, one agent each (50)")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs of the leader (5)")
    parser.add_argument(
        "--steady", type=float, default=2.0, help="seconds of steady state before a kill (2)"
    )
    parser.add_argument(
        "--api-latency",
        dest="latency",
        type=latency_option,
        default=api_latency.parse("none"),
        help="how the emulated API answers: none (default), p99-1s (99%% in 20-50 ms, 1%% in "
        "1-3 s), p99-1s-lognormal, mix:LO-HI,FRACTION,SLOW_LO-SLOW_HI or "
        "lognormal:MEDIAN,P99[,CAP] (bench/api_latency.py)",
    )
    parser.add_argument("--latency-seed", type=int, default=1, help="seed of the delays (1)")
    parser.add_argument(
        "--lease-duration", type=seconds, default=None, help="--leader-elect-lease-duration"
    )
    parser.add_argument(
        "--renew-deadline", type=seconds, default=None, help="--leader-elect-renew-deadline"
    )
    parser.add_argument(
        "--retry-period", type=seconds, default=None, help="--leader-elect-retry-period"
    )
    parser.add_argument(
        "--quiet",
        type=seconds,
        default=0.0,
        help="seconds of watching the pair with no kill first, counting leadership losses (0)",
    )
    parser.add_argument(
        "--restart-delay",
        type=seconds,
        default=1.0,
        help="seconds before a replica that exited by itself is started again (1)",
    )
    parser.add_argument(
        "--target",
        type=seconds,
        default=None,
        help="fail if a failover (routed) takes longer; 0: no target (the lease duration + "
        f"{TARGET_MARGIN:g}s)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    if args.kills < 1 and args.quiet <= 0:
        parser.error("nothing to measure: --kills 0 needs --quiet")
    args.recorder = api_latency.Recorder(args.latency, args.latency_seed)
    timings = Timings(args.lease_duration, args.renew_deadline, args.retry_period)
    if args.target is None:
        args.target = timings.effective()["lease_duration_s"] + TARGET_MARGIN
    # The agents run in this process: their reconnection warnings are the expected story.
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    load_before = os.getloadavg()
    uptime_before = uptime()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-failover-"))
    effective = timings.effective()
    print(
        f"failover: {args.kills} SIGKILLs of the leader, {args.pods} pods and agents, lease "
        f"{effective['lease_duration_s']:g}s / renew deadline {effective['renew_deadline_s']:g}s "
        f"/ retry {effective['retry_period_s']:g}s, API: {args.latency.describe()}, logs in "
        f"{log_dir} ({uptime_before}; {os.cpu_count()} CPUs)",
        flush=True,
    )
    try:
        run = asyncio.run(failover(args, log_dir))
    except (TimeoutError, harness.HarnessError, AssertionError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()
    uptime_after = uptime()
    kills = run.kills

    result: dict[str, object] = {
        "benchmark": "failover",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
        "command": "python -m bench.failover " + " ".join(sys.argv[1:] if argv is None else argv),
        "pods": args.pods,
        "timings": {**effective, "agent_reconnect_max_s": AgentFlags.reconnect_max},
        "api_latency": {
            "spec": args.latency.spec,
            "described": args.latency.describe(),
            "drawn": args.recorder.summary(),
        },
        "restart_delay_s": args.restart_delay,
        "exits": [dataclasses.asdict(found) for found in run.exits],
        "target_s": args.target,
    }
    ok = not run.kill_error
    if run.kill_error:
        result["kill_error"] = run.kill_error
    if run.churn is not None:
        churn = run.churn
        print()
        print(
            f"quiet {churn.seconds:g}s: {churn.leadership_losses} leadership losses "
            f"({churn.losses_per_hour:.2f}/h), {churn.exits} exits, {churn.holder_changes} Lease "
            f"holder changes, {churn.lease_transitions} leaseTransitions, "
            f"{churn.leaderless_s:.1f}s with no replica SERVING, {churn.renew_failures:g} "
            f"failed renewal attempts, {churn.lease_requests} Lease requests; this process's "
            f"loop lag p99 {churn.loop_lag_p99_s * 1000:.0f} ms (max "
            f"{churn.loop_lag_max_s * 1000:.0f} ms), load average up to {churn.load_average_max}"
        )
        result["churn"] = {
            **dataclasses.asdict(churn),
            "losses_per_hour": round(churn.losses_per_hour, 3),
        }
    if kills:
        print()
        print(
            f"{'kill':>4}  {'killed':>7}  {'new leader':>10}  {'SERVING':>8}  {'routed':>8}  "
            f"{'agents back':>11}  {'PATCHes':>7}  {'Events':>6}  {'label PATCHes':>13}"
        )
        for kill in kills:
            print(
                f"{kill.kill:>4}  {kill.killed:>7}  {kill.new_leader:>10}  "
                f"{kill.serving_s:>7.2f}s  {kill.routed_s:>7.2f}s  {kill.agents_s:>10.2f}s  "
                f"{kill.spurious_patches:>7}  {kill.spurious_events:>6}  "
                f"{kill.leader_label_patches:>13}"
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
        target = f"target <= {args.target:g}s, " if args.target > 0 else ""
        print(
            f"median failover (SIGKILL -> new leader SERVING): {median_serving:.2f}s "
            f"({target}max {max(k.serving_s for k in kills):.2f}s); routed by the "
            f"Service: {median_routed:.2f}s (max {max(k.routed_s for k in kills):.2f}s); all "
            f"agents back: {median_agents:.2f}s; spurious writes: {spurious}"
        )
        result.update(
            {
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
            }
        )
        ok = ok and spurious == 0
        if args.target > 0 and max(k.routed_s for k in kills) > args.target:
            ok = False
    print(f"API delays drawn: {args.recorder.summary()}")
    print(f"uptime before: {uptime_before}")
    print(f"uptime after:  {uptime_after}")
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
