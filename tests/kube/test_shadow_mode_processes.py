"""Shadow mode with the real programs (issue 16): a real aggregator process with ``--dry-run``
on the Kubernetes API emulator, real sidecar agent processes for some pods, the others pulled.
Proxies drain, pods come and go, three quarters of the fleet hangs (PANIC) and heals: every
decision is made, the disagreement figures follow it exactly (metrics and GetSummary agree), and
the API receives not one write request of any kind (no POST, PUT, PATCH or DELETE).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import eventually
from tests.kube.fleet import fleet
from testsupport.fakes import DRAINING, HEALTHY, FakeServeProxy
from testsupport.kube.emulator import KubeEmulator

PODS = 9  # pod-8 appears later
AGENTS = 4  # pods 0-3 have a sidecar agent; the others are pulled
LABELLED = range(6)  # pods 0-5 carry ray.io/serve=true at start; 6-8 carry nothing
HUNG = [1, 2, 3, 5, 6]  # 5 of the 8 pods then tracked
LABEL = "ray.io/serve"
WRITES = ("POST", "PUT", "PATCH", "DELETE")


@pytest.fixture
async def proxies() -> AsyncIterator[list[FakeServeProxy]]:
    started = [await FakeServeProxy().start() for _ in range(PODS)]
    try:
        yield started
    finally:
        for proxy in started:
            await proxy.stop()


def add_pod(kube: KubeEmulator, number: int, proxy: FakeServeProxy) -> str:
    labels = {"ray.io/node-type": "worker"} | ({LABEL: "true"} if number in LABELLED else {})
    pod = kube.add_pod(
        "default", f"pod-{number}", labels=labels, pod_ip="127.0.0.1", serve_port=proxy.port
    )
    return str(pod["metadata"]["uid"])


async def test_shadow_mode_decides_everything_and_writes_nothing(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: list[FakeServeProxy],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    uids = [add_pod(kube, i, proxies[i]) for i in range(PODS - 1)]
    async with fleet(
        tmp_path,
        [
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig_path}",
            "--dry-run=true",
            "--pull-interval=1s",
            "--log-level=debug",
        ],
        proxies,
        uids,
        AGENTS,
    ) as running:
        aggregator = running.aggregator
        channel = grpc.aio.insecure_channel(aggregator.address)
        stub = pb_grpc.InspectionServiceStub(channel)

        metric, metric_is = running.metric, running.metric_is

        async def figures_are(enter: int, leave: int, *, serving: int | None = None) -> bool:
            summary = await stub.GetSummary(pb.GetSummaryRequest(), timeout=10)
            if serving is not None and summary.pods_by_state["SERVE_STATE_SERVING"] != serving:
                return False
            metrics = (
                await metric('serve_health_shadow_disagreements{direction="in"}'),
                await metric('serve_health_shadow_disagreements{direction="out"}'),
            )
            return (summary.would_enter, summary.would_leave) == (enter, leave) == metrics

        # Everything serves: the two unlabelled pods would enter.
        await eventually(lambda: figures_are(2, 0, serving=8), 30)
        assert (await stub.GetSummary(pb.GetSummaryRequest())).dry_run
        assert await metric("serve_health_dry_run") == 1
        pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name="pod-6"))
        assert (pod.carried, pod.desired_label) == ("", "true")

        # Proxies flip: a pushed and a pulled pod drain, and would leave.
        proxies[0].set(DRAINING)
        proxies[4].set(DRAINING)
        await eventually(lambda: figures_are(2, 2, serving=6), 30)
        pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name="pod-0"))
        assert (pod.carried, pod.desired_label) == ("true", "false")

        # Pods come and go.
        add_pod(kube, 8, proxies[8])
        await eventually(lambda: figures_are(3, 2, serving=7), 30)
        kube.delete_pod("default", "pod-7")
        await eventually(lambda: figures_are(2, 2, serving=6), 30)

        # PANIC: a held removal is no write, so no disagreement; the drained pods still are.
        for i in HUNG:
            proxies[i].hang = True
        await eventually(lambda: metric_is("serve_health_panic", 1), 30)
        assert await metric("serve_health_panic_held_writes") >= 1
        await eventually(lambda: figures_are(1, 2), 30)  # pod-8 would enter; pod-6 is held
        for i in HUNG:
            proxies[i].set(HEALTHY)
        await eventually(lambda: metric_is("serve_health_panic", 0), 30)
        await eventually(lambda: figures_are(2, 2, serving=6), 30)

        assert await metric('serve_health_would_be_writes_total{kind="label"}') > 0
        assert await metric('serve_health_would_be_writes_total{kind="event"}') > 0
        assert await metric('serve_health_would_be_writes_total{kind="lease"}') == 0
        assert await metric("serve_health_writes_pending") == 0
        await channel.close()
        assert [(c.method, c.path) for m in WRITES for c in kube.requests(m)] == []
        assert kube.requests("GET", resource="pods")  # it read: list, watch
        assert [kube.pod_labels("default", f"pod-{i}").get(LABEL) for i in (0, 4, 6, 8)] == [
            "true",
            "true",
            None,
            None,
        ]
    log = (tmp_path / "aggregator.log").read_text()
    assert log.count("SHADOW MODE") == 1
    assert "dry run: would write label 'false' on pod default/pod-0" in log
