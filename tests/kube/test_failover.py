"""Failover of the aggregator, end to end, with the default leader-election timings: two real
aggregator processes (``python -m aggregator --leader-elect``) against one Kubernetes API
emulator served over HTTP by this test, and real agents (in-process, real gRPC streams, real
probes of a fake Serve proxy) given both addresses. SIGKILL the leader: the standby must answer
SERVING on grpc.health.v1 within 5 s, every agent must reconnect to it, and no pod may be
written in the meantime (the new leader seeds itself from the labels the old one wrote).

Also as a process: a leader that cannot renew its Lease exits 1 (the Deployment restarts it as
a standby), and ``--leader-elect`` with no namespace for the Lease is a clear startup error."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.kube.lease import NAMESPACE_FILE
from aggregator.settings import Settings as AggregatorSettings
from node_agent.agent import Agent
from node_agent.identity import Identity
from node_agent.settings import Settings as AgentSettings
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.probe import Prober, make_session
from tests.fakes import FakeServeProxy, free_port
from tests.kube.emulator import EVENTS, LEASES, PODS, KubeEmulator

NS = "ray"
LABEL = "ray.io/serve"
PODS_COUNT = 4
#: What the issue asks: the standby serves within 5 s of the leader's death.
FAILOVER_LIMIT = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Raw test agents carry no token; aggregators that authenticate agents are told not to.
NO_AUTH = (
    ["--auth", "none"] if "auth" in {f.name for f in dataclasses.fields(AggregatorSettings)} else []
)


@dataclasses.dataclass
class Replica:
    name: str
    port: int
    process: asyncio.subprocess.Process
    log: Path

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + "\n".join(self.log.read_text().splitlines()[-30:])


async def start_replica(name: str, kubeconfig: Path, log_dir: Path) -> Replica:
    port = free_port()
    log = log_dir / f"{name}.log"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aggregator",
            f"--listen=127.0.0.1:{port}",
            "--metrics-listen=",
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig}",
            "--namespace",
            NS,
            "--leader-elect=true",
            "--leader-elect-namespace=ray-serve-health",
            f"--leader-elect-identity={name}",
            *NO_AUTH,
            env={**environ, "PYTHONUNBUFFERED": "1"},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=output,
        )
    return Replica(name, port, process, log)


async def health(replica: Replica) -> int | None:
    """The replica's grpc.health.v1 status for "" (None: no answer)."""
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return answer.status
    except grpc.aio.AioRpcError:
        return None


async def summary(replica: Replica) -> pb.Summary:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        return await stub.GetSummary(pb.GetSummaryRequest(), timeout=2)


async def list_pods(replica: Replica) -> list[pb.Pod]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        return list((await stub.ListPods(pb.ListPodsRequest(), timeout=2)).pods)


async def until(
    check: Callable[[], Awaitable[bool]], within: float, what: str, replicas: list[Replica]
) -> float:
    """Poll ``check()`` every 50 ms until true; the seconds it took. Fails at once if one of
    ``replicas`` exits."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await check():
        exited = [replica for replica in replicas if replica.process.returncode is not None]
        if exited or loop.time() - started > within:
            logs = "\n".join(replica.tail() for replica in replicas)
            why = f"{exited[0].name} exited" if exited else f"not within {within:g}s"
            raise AssertionError(f"{what}: {why}\n{logs}")
        await asyncio.sleep(0.05)
    return loop.time() - started


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    proxy = await FakeServeProxy().start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def replicas(kubeconfig_path: Path, tmp_path: Path) -> AsyncIterator[list[Replica]]:
    started = [await start_replica(name, kubeconfig_path, tmp_path) for name in ("a", "b")]
    yield started
    for replica in started:
        if replica.process.returncode is None:
            replica.process.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(replica.process.wait(), 10)


@contextlib.asynccontextmanager
async def agents(
    emulator: KubeEmulator, proxy: FakeServeProxy, addresses: str
) -> AsyncIterator[list[Agent]]:
    """One sidecar agent per pod, each given every aggregator address."""
    session = make_session()
    running: list[Agent] = []
    tasks = []
    try:
        for pod in emulator.list_objects(PODS, NS):
            identity = Identity(NS, pod["metadata"]["name"], pod["metadata"]["uid"], "node-1")
            settings = AgentSettings(aggregator=addresses, proxy_url=proxy.url, token_file="")
            agent = Agent(settings, identity, Prober(session, settings.probe_timeout))
            running.append(agent)
            tasks.append(asyncio.create_task(agent.run(), name=f"agent {identity}"))
        yield running
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()


async def test_sigkill_of_the_leader_fails_over_within_five_seconds_and_writes_nothing(
    kube_emulator: KubeEmulator, proxy: FakeServeProxy, replicas: list[Replica]
) -> None:
    for number in range(PODS_COUNT):
        # All but the last carry the label already; the first leader has to write that one.
        labels = {"ray.io/node-type": "worker"} | ({LABEL: "true"} if number else {})
        kube_emulator.add_pod(
            NS, f"ray-worker-{number}", labels=labels, pod_ip="127.0.0.1", serve_port=proxy.port
        )
    addresses = ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)

    async def one_leader() -> bool:
        statuses = [await health(replica) for replica in replicas]
        return sorted(statuses, key=str) == sorted([SERVING, NOT_SERVING], key=str)

    await until(one_leader, 60, "one leader and one standby", replicas)
    leader, standby = sorted(replicas, key=lambda r: 0 if r.name == _holder(kube_emulator) else 1)
    assert await health(leader) == SERVING

    async with agents(kube_emulator, proxy, addresses):

        async def all_connected_to(replica: Replica) -> bool:
            return (await summary(replica)).agents_connected == PODS_COUNT

        async def first_pod_labelled() -> bool:
            return kube_emulator.pod_labels(NS, "ray-worker-0").get(LABEL) == "true"

        await until(lambda: all_connected_to(leader), 20, "agents connect to the leader", replicas)
        await until(first_pod_labelled, 20, "the leader labels the unlabelled pod", replicas)
        await asyncio.sleep(1.0)  # let any write in flight land before the mark
        mark = kube_emulator.checkpoint()

        leader.process.send_signal(signal.SIGKILL)
        loop = asyncio.get_running_loop()
        killed = loop.time()
        assert await asyncio.wait_for(leader.process.wait(), 10) == -signal.SIGKILL

        async def standby_serves() -> bool:
            return await health(standby) == SERVING

        took = await until(standby_serves, FAILOVER_LIMIT + 5, "the standby takes over", [standby])
        assert took <= FAILOVER_LIMIT, f"failover took {took:.2f}s"
        reconnected = await until(
            lambda: all_connected_to(standby), 10, "agents reconnect to the new leader", [standby]
        )
        assert loop.time() - killed <= FAILOVER_LIMIT + 3.0, f"agents back after {reconnected:.2f}s"

        async def all_pushed_serving() -> bool:
            pods = await list_pods(standby)
            return len(pods) == PODS_COUNT and all(
                pod.state == pb.SERVE_STATE_SERVING and pod.source == pb.SOURCE_PUSH for pod in pods
            )

        await until(all_pushed_serving, 10, "every pod pushed SERVING to the new leader", [standby])
        await asyncio.sleep(1.0)  # a spurious write would come now at the latest

    assert kube_emulator.requests("PATCH", resource=PODS, since=mark) == []
    assert kube_emulator.requests("POST", resource=EVENTS, since=mark) == []
    assert all(
        pod["metadata"]["labels"].get(LABEL) == "true"
        for pod in kube_emulator.list_objects(PODS, NS)
    )
    lease = kube_emulator.lease("ray-serve-health", "ray-serve-health-aggregator")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == standby.name
    assert lease["spec"]["leaseTransitions"] == 1


def _holder(emulator: KubeEmulator) -> str | None:
    lease = emulator.lease("ray-serve-health", "ray-serve-health-aggregator")
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_a_leader_that_cannot_renew_exits_1(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, tmp_path: Path
) -> None:
    replica = await start_replica("only", kubeconfig_path, tmp_path)
    try:

        async def serving() -> bool:
            return await health(replica) == SERVING

        await until(serving, 60, "the only replica leads", [replica])
        kube_emulator.fail_next(10_000, status=500, resource=LEASES)
        # Renew deadline 2 s, then the drain: well within 10 s.
        assert await asyncio.wait_for(replica.process.wait(), 10) == 1
    finally:
        if replica.process.returncode is None:
            replica.process.kill()
            await replica.process.wait()
    log = replica.log.read_text()
    assert "lost the lease" in log
    assert "within the renew deadline (2s)" in log


@pytest.mark.skipif(NAMESPACE_FILE.exists(), reason="runs in a pod: its namespace is known")
async def test_leader_election_without_a_namespace_is_a_clear_startup_error(
    kubeconfig_path: Path,
) -> None:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SERVE_HEALTH_") and k != "POD_NAMESPACE"
    }
    result = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aggregator",
        "--listen=127.0.0.1:0",
        "--metrics-listen=",
        "--kube-backend=kubernetes",
        f"--kubeconfig={kubeconfig_path}",
        "--leader-elect=true",
        *NO_AUTH,
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(result.communicate(), 30)
    assert result.returncode == 1
    assert "cannot start: --leader-elect needs the namespace of its Lease" in stderr.decode()
