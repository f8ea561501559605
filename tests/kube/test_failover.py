"""Failover of the aggregator, end to end, with the default leader-election timings: two real
aggregator processes (``python -m aggregator --leader-elect``) against one Kubernetes API
emulator served over HTTP by this test, each with a pod of its own there, and real agents
(in-process, real gRPC streams, real probes of a fake Serve proxy) that know only the
aggregator's Service, emulated by ``testsupport/kube/service_router.py`` (Ready pods labelled
``ray-serve-health/leader=true``). Both replicas must be Ready, the Service must route to the
leader alone and every agent must be on it; stale leader labels left on both pods are removed.
SIGKILL the leader: the standby must take the Lease over (no sooner than a lease duration after
the last renewal), answer SERVING on grpc.health.v1 and the Service route to it, every agent must
reconnect to it, and no Ray pod may be written in the meantime (the new leader seeds itself from
the labels the old one wrote). How long that takes (the issue asks for 5 s) is a figure:
``bench.failover`` measures it; here it is printed, and the waits are generous (``WAIT``).

Also as a process: a leader that cannot renew its Lease exits 1 (the Deployment restarts it as
a standby), and ``--leader-elect`` with no namespace for the Lease is a clear startup error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from aggregator.flags import AggregatorFlags
from aggregator.leader.lease import NAMESPACE_FILE
from bench import failover
from bench.failover import (
    LEADER_LABEL,
    NO_AUTH,
    NOT_SERVING,
    NS,
    SERVING,
    Replica,
    add_aggregator_pods,
    health,
    run_agents,
    service,
)
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport.fakes import FakeServeProxy, free_port
from testsupport.kube.emulator import EVENTS, LEASES, PODS, ApiCall, KubeEmulator

LABEL = "ray.io/serve"
PODS_COUNT = 4
#: How long a test waits for the replicas: only a hang takes this long. (The issue asks for a
#: failover within 5 s; bench.failover measures it, on a machine not loaded by other tests.)
WAIT = 30.0
#: The replicas' --leader-elect-lease-duration and --leader-elect-renew-deadline (the defaults).
LEASE_DURATION = AggregatorFlags.leader_elect_lease_duration
RENEW_DEADLINE = AggregatorFlags.leader_elect_renew_deadline
#: The replicas' time.monotonic and the emulator's loop time (whole ms, a coarse clock).
CLOCKS = 0.05


async def summary(replica: Replica) -> pb.Summary:
    async with grpc.aio.insecure_channel(replica.address) as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        return await stub.GetSummary(pb.GetSummaryRequest(), timeout=10)


async def list_pods(replica: Replica) -> list[pb.Pod]:
    async with grpc.aio.insecure_channel(replica.address) as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        return list((await stub.ListPods(pb.ListPodsRequest(), timeout=10)).pods)


def written_holder(call: ApiCall) -> str:
    """The holder a Lease write (POST, PUT) names ("" for a release)."""
    return (call.body or {}).get("spec", {}).get("holderIdentity") or ""


def lease_requests(emulator: KubeEmulator) -> list[ApiCall]:
    """Every request for the replicas' Lease (its creation included), oldest first."""
    return [
        call
        for call in emulator.requests(resource=LEASES, namespace="ray-serve-health")
        if call.name in (None, "ray-serve-health-aggregator")
    ]


async def until(
    check: Callable[[], Awaitable[bool]], within: float, what: str, replicas: list[Replica]
) -> float:
    """bench.failover.until, failing at once if one of ``replicas`` exits."""

    async def exited_or(check: Callable[[], Awaitable[bool]]) -> bool:
        exited = [
            r.name for r in replicas if r.process is not None and r.process.returncode is not None
        ]
        if exited:
            logs = "\n".join(replica.tail() for replica in replicas)
            raise AssertionError(f"{what}: {exited[0]} exited\n{logs}")
        return await check()

    try:
        return await failover.until(lambda: exited_or(check), within, what, replicas)
    except TimeoutError as error:
        raise AssertionError(str(error)) from None


def running(replica: Replica) -> asyncio.subprocess.Process:
    assert replica.process is not None
    return replica.process


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    proxy = await FakeServeProxy().start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def replicas(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, tmp_path: Path
) -> AsyncIterator[list[Replica]]:
    """Two replicas, each with its pod, both pods carrying a stale leader label."""
    started = [Replica(name, free_port(), tmp_path) for name in ("a", "b")]
    add_aggregator_pods(kube_emulator, started)
    for replica in started:
        kube_emulator.patch_object(
            PODS, "ray-serve-health", replica.pod, {"metadata": {"labels": {LEADER_LABEL: "true"}}}
        )
        await replica.start(kubeconfig_path)
    yield started
    for replica in started:
        with contextlib.suppress(TimeoutError):
            await replica.kill()


async def test_both_ready_agents_on_the_leader_alone_and_sigkill_fails_over_writing_nothing(
    kube_emulator: KubeEmulator, proxy: FakeServeProxy, replicas: list[Replica]
) -> None:
    for number in range(PODS_COUNT):
        # All but the last carry the label already; the first leader has to write that one.
        labels = {"ray.io/node-type": "worker"} | ({LABEL: "true"} if number else {})
        kube_emulator.add_pod(
            NS, f"ray-worker-{number}", labels=labels, pod_ip="127.0.0.1", serve_port=proxy.port
        )

    async def one_leader() -> bool:
        statuses = [await health(replica) for replica in replicas]
        return sorted(statuses, key=str) == sorted([SERVING, NOT_SERVING], key=str)

    await until(one_leader, 60, "one leader and one standby", replicas)
    leader, standby = sorted(
        replicas, key=lambda r: 0 if r.identity == _holder(kube_emulator) else 1
    )
    assert await health(leader) == SERVING

    async def labelled() -> list[str]:
        return [
            pod["metadata"]["name"]
            for pod in kube_emulator.list_objects(PODS, "ray-serve-health")
            if pod["metadata"]["labels"].get(LEADER_LABEL) == "true"
        ]

    async def only_the_leader_labelled() -> bool:
        return await labelled() == [leader.pod]

    await until(only_the_leader_labelled, WAIT, "the stale labels removed", replicas)

    async with (
        service(kube_emulator, replicas) as router,
        run_agents(kube_emulator, proxy, router.address),
    ):

        async def both_ready_leader_routed() -> bool:
            ready = all(router.ready(replica.pod) for replica in replicas)
            return ready and router.endpoints() == [leader.pod]

        await until(
            both_ready_leader_routed, WAIT, "both Ready, the Service on the leader", replicas
        )

        async def all_connected_to(replica: Replica) -> bool:
            return (await summary(replica)).agents_connected == PODS_COUNT

        async def first_pod_labelled() -> bool:
            return kube_emulator.pod_labels(NS, "ray-worker-0").get(LABEL) == "true"

        await until(
            lambda: all_connected_to(leader), WAIT, "agents connect to the leader", replicas
        )
        assert (await summary(standby)).agents_connected == 0
        assert set(router.forwarded) == {leader.pod}, router.forwarded
        await until(first_pod_labelled, WAIT, "the leader labels the unlabelled pod", replicas)

        async def its_event_recorded() -> bool:  # the last request that label change makes
            return any(
                (call.body or {}).get("involvedObject", {}).get("name") == "ray-worker-0"
                for call in kube_emulator.requests("POST", resource=EVENTS)
            )

        await until(its_event_recorded, WAIT, "the label change's Event", replicas)
        mark = kube_emulator.checkpoint()

        loop = asyncio.get_running_loop()
        killed = loop.time()
        await leader.kill()
        assert running(leader).returncode == -signal.SIGKILL

        async def standby_serves() -> bool:
            return await health(standby) == SERVING

        await until(standby_serves, WAIT, "the standby takes over", [standby])
        took_over = time.time()

        async def routed_to_the_new_leader() -> bool:
            return router.endpoints() == [standby.pod]

        await until(routed_to_the_new_leader, WAIT, "the Service moves", [standby])
        took = loop.time() - killed
        await until(
            lambda: all_connected_to(standby), WAIT, "agents reconnect to the new leader", [standby]
        )
        print(
            f"the Service on the new leader {took:.2f}s after the SIGKILL, "
            f"the agents on it {loop.time() - killed:.2f}s after"
        )
        # The Lease taken over no sooner than a lease duration after the old leader's last
        # renewal (the standby waits that long after it last saw the Lease change).
        # (Writes: its creation, which both replicas may have tried, and renewals.)
        writes = [c for c in lease_requests(kube_emulator) if c.method in ("POST", "PUT")]
        takeover = next(
            c for c in writes if c.at > killed and written_holder(c) == standby.identity
        )
        renewal = [
            c for c in writes if c.at < takeover.at and written_holder(c) == leader.identity
        ][-1]
        assert takeover.at - renewal.at >= LEASE_DURATION - CLOCKS

        async def all_pushed_serving() -> bool:
            pods = await list_pods(standby)
            return len(pods) == PODS_COUNT and all(
                pod.state == pb.SERVE_STATE_SERVING and pod.source == pb.SOURCE_PUSH for pod in pods
            )

        await until(
            all_pushed_serving, WAIT, "every pod pushed SERVING to the new leader", [standby]
        )
        # No write can be on its way: the new leader writes only for a state change (or a
        # label someone else changed, and nobody did), and no pod changed state since it took
        # over: each is still in the SERVING it was seeded with from its label.
        for pod in await list_pods(standby):
            assert pod.state_since.ToNanoseconds() / 1e9 <= took_over, pod

    assert kube_emulator.requests("PATCH", resource=PODS, namespace=NS, since=mark) == []
    assert kube_emulator.requests("POST", resource=EVENTS, since=mark) == []
    assert all(
        pod["metadata"]["labels"].get(LABEL) == "true"
        for pod in kube_emulator.list_objects(PODS, NS)
    )
    lease = kube_emulator.lease("ray-serve-health", "ray-serve-health-aggregator")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == standby.identity
    assert lease["spec"]["leaseTransitions"] == 1


def _holder(emulator: KubeEmulator) -> str | None:
    lease = emulator.lease("ray-serve-health", "ray-serve-health-aggregator")
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_a_leader_that_cannot_renew_exits_1(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, tmp_path: Path
) -> None:
    replica = Replica("only", free_port(), tmp_path)
    add_aggregator_pods(kube_emulator, [replica])
    await replica.start(kubeconfig_path)
    try:

        async def serving() -> bool:
            return await health(replica) == SERVING

        await until(serving, 60, "the only replica leads", [replica])
        kube_emulator.fail_next(10_000, status=500, resource=LEASES)
        # The renew deadline, then the drain (only a hang takes WAIT).
        assert await asyncio.wait_for(running(replica).wait(), WAIT) == 1
    finally:
        await replica.kill()
    log = replica.log.read_text()
    assert "lost the lease" in log
    assert f"within the renew deadline ({RENEW_DEADLINE:g}s)" in log


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


async def test_sigterm_of_the_leader_moves_the_service_at_once(
    kube_emulator: KubeEmulator, proxy: FakeServeProxy, replicas: list[Replica]
) -> None:
    """A graceful stop: the leader removes its own label and releases the Lease, so the
    standby takes it at its next read (not a lease duration later), and the Service routes to
    it."""

    async def leader_found() -> bool:
        statuses = [await health(replica) for replica in replicas]
        return _holder(kube_emulator) is not None and SERVING in statuses

    await until(leader_found, 60, "a leader", replicas)
    leader, standby = sorted(
        replicas, key=lambda r: 0 if r.identity == _holder(kube_emulator) else 1
    )
    async with service(kube_emulator, replicas) as router:

        async def routed_to(replica: Replica) -> bool:
            return router.endpoints() == [replica.pod]

        await until(lambda: routed_to(leader), WAIT, "the Service on the leader", replicas)
        running(leader).send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(running(leader).wait(), WAIT) == 0
        assert LEADER_LABEL not in kube_emulator.pod_labels("ray-serve-health", leader.pod)
        took = await until(lambda: routed_to(standby), WAIT, "the Service moves", [standby])
    print(f"the Service moved {took:.2f}s after the old leader exited")
    # After the release (a write naming no holder), the standby read the Lease once and took
    # it: its next read, not a lease duration later.
    lease = lease_requests(kube_emulator)
    released = max(i for i, c in enumerate(lease) if c.method == "PUT" and not written_holder(c))
    after = [(c.method, written_holder(c) if c.method == "PUT" else "") for c in lease]
    assert after[released + 1 : released + 3] == [("GET", ""), ("PUT", standby.identity)]
