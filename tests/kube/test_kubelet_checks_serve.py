"""The aggregator tells users when the decision that routes traffic is not only ours (issue
27), against the API emulator: pods whose readiness probe also checks the Serve proxy
(KubeRay's injected exec chain, and an httpGet variant) and pods with the documented probe (the
raylet only): ``Pod.kubelet_checks_serve`` and ``Pod.kubelet_ready`` in GetPod and ListPods,
``Summary.pods_kubelet_checks_serve``, the gauge, and one warning per Ray cluster."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import DEFAULT_POD_LABELS, PODS, KubeEmulator, make_pod

RAYLET = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
PROXY = "wget -T 2 -q -O- http://localhost:8000/-/healthz | grep success"
PROBES: dict[str, dict[str, Any]] = {
    "kuberay-exec": {"exec": {"command": ["bash", "-c", f"{RAYLET} && {PROXY}"]}},
    "kuberay-http": {"httpGet": {"path": "/-/healthz", "port": 8000}},
    "ours": {"exec": {"command": ["bash", "-c", RAYLET]}},
}


def add(kube: KubeEmulator, name: str, probe: str, cluster: str, ready: str) -> None:
    pod = make_pod(
        "default",
        name,
        labels={**DEFAULT_POD_LABELS, "ray.io/cluster": cluster},
        pod_ip="127.0.0.1",
        conditions=[{"type": "Ready", "status": ready}],
    )
    pod["spec"]["containers"][0]["readinessProbe"] = PROBES[probe]
    kube.put_object(PODS, pod)


async def test_pods_whose_kubelet_checks_the_proxy_are_shown_and_warned_of(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    add(kube_emulator, "exec-a", "kuberay-exec", "rs-1", "True")
    add(kube_emulator, "exec-b", "kuberay-exec", "rs-1", "False")
    add(kube_emulator, "http-c", "kuberay-http", "rs-2", "True")
    add(kube_emulator, "ours-d", "ours", "rs-3", "True")
    with caplog.at_level(logging.WARNING, logger="aggregator.kube.kubelet_probe"):
        aggregator = await start_kube(
            mode="label", pull_interval=0.2, pull_timeout=0.5, startup_grace=0.1
        )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        inspection = pb_grpc.InspectionServiceStub(channel)

        async def all_tracked() -> pb.ListPodsResponse | None:
            answer = await inspection.ListPods(pb.ListPodsRequest(), timeout=5)
            return answer if len(answer.pods) == 4 else None

        listed = await eventually(all_tracked, timeout=30)
        seen = {pod.name: (pod.kubelet_checks_serve, pod.kubelet_ready) for pod in listed.pods}
        assert seen == {
            "exec-a": (True, "True"),
            "exec-b": (True, "False"),
            "http-c": (True, "True"),
            "ours-d": (False, "True"),
        }
        one = await inspection.GetPod(pb.GetPodRequest(namespace="default", name="exec-b"))
        assert (one.kubelet_checks_serve, one.kubelet_ready) == (True, "False")
        summary = await inspection.GetSummary(pb.GetSummaryRequest())
        assert summary.pods_kubelet_checks_serve == 3
    gauge = aggregator.metrics.registry.get_sample_value("serve_health_pods_kubelet_checks_serve")
    assert gauge == 3
    warned = [r.getMessage() for r in caplog.records if "also checks the Serve proxy" in r.message]
    assert sorted(line.split(":")[0] for line in warned) == [
        "Ray cluster default/rs-1",
        "Ray cluster default/rs-2",
    ]
