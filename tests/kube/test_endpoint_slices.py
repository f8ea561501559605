"""The EndpointSlice emulation (testsupport/kube/endpoints.py) against the Kubernetes documentation:

- https://kubernetes.io/docs/concepts/services-networking/endpoint-slices/#conditions
  (``ready`` maps to the pod's Ready condition and is never true for a terminating pod;
  ``serving`` is the same without the terminating part; ``terminating``);
- https://kubernetes.io/docs/concepts/services-networking/service/ (a Service's selector picks
  its pods; ``publishNotReadyAddresses``; a named ``targetPort``);

and with the kubelet emulation, the question every traffic claim comes down to: "is this pod an
endpoint of ``<rayservice>-serve-svc``?"
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from testsupport.fakes import DRAINING, FakeServeProxy
from testsupport.kube.emulator import DEFAULT_POD_LABELS, PODS, KubeEmulator
from testsupport.kube.endpoints import (
    CONTROLLER_NAME,
    ENDPOINT_SLICES,
    EndpointSlices,
    serve_service_name,
)
from testsupport.kube.kubelet import FakeClock, Kubelet, kuberay_readiness_probe, probed_pod
from testsupport.kube.probe_targets import RAYLET_DEAD, FakeRayletAgent

pytestmark = pytest.mark.timeout(20)

SERVE_LABEL = "ray.io/serve"
SELECTOR = {"ray.io/cluster": "raycluster", SERVE_LABEL: "true"}
SERVICE = serve_service_name("rayservice")
NOT_READY = [{"type": "Ready", "status": "False"}]


def add_pod(kube: KubeEmulator, name: str, *, serve: str = "true", **settings: Any) -> None:
    settings.setdefault("pod_ip", "127.0.0.1")
    kube.add_pod("default", name, labels={**DEFAULT_POD_LABELS, SERVE_LABEL: serve}, **settings)


def terminating(kube: KubeEmulator, name: str) -> None:
    """What a graceful DELETE does first: set the deletionTimestamp."""
    now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.modify_pod(
        "default",
        name,
        patch={"metadata": {"deletionTimestamp": now, "deletionGracePeriodSeconds": 30}},
    )


@pytest.fixture
async def slices(kube_emulator: KubeEmulator) -> AsyncIterator[EndpointSlices]:
    async with EndpointSlices(kube_emulator) as controller:
        controller.add_service(SERVICE, SELECTOR)
        yield controller


async def test_the_pods_that_match_the_selector_and_are_ready(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    add_pod(kube, "b")
    add_pod(kube, "unready", conditions=NOT_READY)
    add_pod(kube, "unlabelled", serve="false")
    add_pod(kube, "c")
    kube.add_pod(
        "elsewhere", "x", labels={**DEFAULT_POD_LABELS, SERVE_LABEL: "true"}, pod_ip="127.0.0.1"
    )
    await slices.wait_endpoints(SERVICE, {"a", "b", "c"})
    assert slices.is_endpoint("a", SERVICE)
    assert not slices.is_endpoint("unready", SERVICE)
    assert slices.conditions(SERVICE)["unready"] == {
        "ready": False,
        "serving": False,
        "terminating": False,
    }
    assert "unlabelled" not in slices.conditions(SERVICE)
    (item,) = slices.slices(SERVICE)
    assert item["metadata"]["labels"] == {
        "kubernetes.io/service-name": SERVICE,
        "endpointslice.kubernetes.io/managed-by": CONTROLLER_NAME,
    }
    assert item["metadata"]["ownerReferences"][0]["kind"] == "Service"
    assert item["addressType"] == "IPv4"
    assert item["ports"] == [{"name": "serve", "port": 8000, "protocol": "TCP"}]  # "serve" -> 8000
    endpoint = next(e for e in item["endpoints"] if e["targetRef"]["name"] == "a")
    assert endpoint["addresses"] == ["127.0.0.1"]
    assert endpoint["nodeName"] == "node-1"
    assert endpoint["targetRef"]["uid"] == kube.pod("default", "a")["metadata"]["uid"]


async def test_every_pod_change_is_reflected(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    add_pod(kube, "b")
    await slices.wait_endpoints(SERVICE, {"a", "b"})
    kube.modify_pod("default", "a", labels={SERVE_LABEL: "false"})  # our label's write
    await slices.wait_endpoints(SERVICE, {"b"})
    kube.modify_pod("default", "a", labels={SERVE_LABEL: "true"})
    kube.modify_pod("default", "b", patch={"status": {"conditions": NOT_READY}})
    await slices.wait_endpoints(SERVICE, {"a"})
    kube.delete_pod("default", "a")
    await slices.wait_endpoints(SERVICE, set())
    assert slices.conditions(SERVICE) == {
        "b": {"ready": False, "serving": False, "terminating": False}
    }


async def test_a_terminating_pod_is_not_ready_but_may_be_serving(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    add_pod(kube, "b", conditions=NOT_READY)
    await slices.wait_endpoints(SERVICE, {"a"})
    terminating(kube, "a")
    terminating(kube, "b")
    await slices.wait_endpoints(SERVICE, set())
    assert slices.conditions(SERVICE) == {
        "a": {"ready": False, "serving": True, "terminating": True},
        "b": {"ready": False, "serving": False, "terminating": True},
    }


async def test_pods_without_an_ip_or_finished_are_left_out(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    kube.add_pod("default", "no-ip", labels={**DEFAULT_POD_LABELS, SERVE_LABEL: "true"})
    add_pod(kube, "done", phase="Succeeded")
    add_pod(kube, "failed", phase="Failed")
    await slices.wait_endpoints(SERVICE, {"a"})
    await slices.settle()
    assert set(slices.conditions(SERVICE)) == {"a"}


async def test_publish_not_ready_addresses(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    slices.add_service("headless", SELECTOR, publish_not_ready_addresses=True)
    add_pod(kube, "unready", conditions=NOT_READY)
    await slices.wait_endpoints("headless", {"unready"})
    assert slices.conditions("headless")["unready"]["serving"] is False
    assert slices.endpoints(SERVICE) == set()


async def test_slices_are_written_only_when_they_change(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    await slices.wait_endpoints(SERVICE, {"a"})
    await slices.settle()
    (before,) = slices.slices(SERVICE)
    writes = slices.writes
    kube.modify_pod("default", "a", patch={"metadata": {"annotations": {"x": "y"}}})
    kube.add_pod("default", "unrelated", labels={"app": "other"}, pod_ip="127.0.0.1")
    await slices.settle()
    (after,) = slices.slices(SERVICE)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert slices.writes == writes


async def test_ports_by_name_group_pods_and_a_service_goes_with_its_slices(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")  # "serve" is 8000
    add_pod(kube, "b", serve_port=8001)  # "serve" is 8001
    add_pod(kube, "none", serve_port=None)  # no port named "serve"
    await slices.wait_endpoints(SERVICE, {"a", "b", "none"})
    ports = sorted(
        (
            tuple(p["port"] for p in item["ports"]),
            [e["targetRef"]["name"] for e in item["endpoints"]],
        )
        for item in slices.slices(SERVICE)
    )
    assert ports == [((), ["none"]), ((8000,), ["a"]), ((8001,), ["b"])]
    slices.remove_service(SERVICE)
    await slices.settle()
    assert slices.slices(SERVICE) == []
    assert kube.list_objects(ENDPOINT_SLICES) == []


async def test_services_and_slices_over_http(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    kube = kube_emulator
    add_pod(kube, "a")
    base = str(kube.url).rstrip("/")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "made-over-http"},
        "spec": {"selector": SELECTOR, "ports": [{"name": "serve", "port": 8000}]},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/api/v1/namespaces/default/services", json=service) as r:
            assert r.status == 201
        await slices.wait_endpoints("made-over-http", {"a"})
        url = f"{base}/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
        params = {"labelSelector": f"kubernetes.io/service-name={SERVICE}"}
        async with session.get(url, params=params) as r:
            assert r.status == 200
            body = await r.json()
    assert body["kind"] == "EndpointSliceList"
    assert [e["targetRef"]["name"] for item in body["items"] for e in item["endpoints"]] == ["a"]


async def test_is_this_pod_an_endpoint_of_the_serve_service(
    kube_emulator: KubeEmulator, slices: EndpointSlices
) -> None:
    """End to end on the emulator: KubeRay's injected probe, the kubelet, the slices. A proxy
    that drains takes its worker out of the serve Service whatever our label says; a worker
    whose raylet dies too."""
    kube = kube_emulator
    proxies = [await FakeServeProxy().start() for _ in range(2)]
    agents = [await FakeRayletAgent().start() for _ in range(2)]
    try:
        clock = FakeClock()
        async with Kubelet(kube, node="node-1", clock=clock, timeout_scale=0.5) as kubelet:
            for i in range(2):
                pod = probed_pod(
                    "default",
                    f"w{i}",
                    readiness_probe=kuberay_readiness_probe("1.4"),
                    labels={**DEFAULT_POD_LABELS, SERVE_LABEL: "true"},
                )
                kube.put_object(PODS, pod)
                kubelet.map_ports(
                    "default", f"w{i}", {52365: agents[i].port, 8000: proxies[i].port}
                )
            await kubelet.advance(10)  # KubeRay's initialDelaySeconds
            await slices.wait_endpoints(SERVICE, {"w0", "w1"})
            proxies[0].set(DRAINING)  # our label still says true
            await kubelet.advance(5)
            await slices.wait_endpoints(SERVICE, {"w1"})
            assert kube.pod_labels("default", "w0")[SERVE_LABEL] == "true"
            agents[1].set(RAYLET_DEAD)
            await kubelet.advance(5)
            await slices.wait_endpoints(SERVICE, set())
    finally:
        for server in [*proxies, *agents]:
            await server.stop()
