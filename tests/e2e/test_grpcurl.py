"""The real grpcurl binary against a live aggregator subprocess (reflection, health, JSON).

These tests need no Ray: the session's agent reports for its pod whatever the Serve proxy is
doing (NO_PROXY before Ray starts or after Serve shut down), so they pass in any order with
``test_ray_serve.py``.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from servehealth.v1 import servehealth_pb2 as pb
from tests import grpcurl as grpcurl_binary
from testsupport import harness

REPORT = pb.DESCRIPTOR.services_by_name["ReportService"].full_name
INSPECTION = pb.DESCRIPTOR.services_by_name["InspectionService"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@pytest.fixture(scope="module")
def grpcurl(aggregator_process: harness.AggregatorProcess) -> Any:
    """``grpcurl(*args, data=None)`` against the aggregator: the CompletedProcess."""

    def run(*args: str, data: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        flags = ["-plaintext", "-max-time", "10"]
        if data is not None:
            flags += ["-d", json.dumps(data)]
        result = grpcurl_binary.run([*flags, aggregator_process.address, *args])
        assert result.returncode == 0, (
            f"grpcurl {' '.join(args)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}\n{aggregator_process.tail()}"
        )
        return result

    return run


def json_field(message: dict[str, Any], name: str) -> Any:
    """A field of grpcurl's JSON by its proto name, whichever spelling grpcurl chose
    (1.8 prints ``desired_label``; protojson's default would be ``desiredLabel``)."""
    head, *rest = name.split("_")
    camel = head + "".join(word.title() for word in rest)
    return message.get(name, message.get(camel))


def test_list_shows_every_service(grpcurl: Any) -> None:
    listed = grpcurl("list").stdout.split()
    for service in (REPORT, INSPECTION, HEALTH):
        assert service in listed


def test_describe_inspection_service(grpcurl: Any) -> None:
    described = grpcurl("describe", INSPECTION).stdout
    assert f"{INSPECTION} is a service:" in described
    for method in pb.DESCRIPTOR.services_by_name["InspectionService"].methods:
        assert f"rpc {method.name} (" in described
    assert f"returns ( stream .{pb.Transition.DESCRIPTOR.full_name} )" in described


@pytest.mark.parametrize("service", ["", REPORT, INSPECTION])
def test_health_check_serving(grpcurl: Any, service: str) -> None:
    answer = json.loads(grpcurl(f"{HEALTH}/Check", data={"service": service}).stdout)
    assert answer == {"status": "SERVING"}


def test_list_pods_shows_the_agents_pod(
    grpcurl: Any, pod: harness.PodIdentity, tracked_pod: pb.Pod
) -> None:
    answer = json.loads(grpcurl(f"{INSPECTION}/ListPods").stdout)
    pods = {(item["namespace"], item["name"]): item for item in answer["pods"]}
    listed = pods[(pod.namespace, pod.name)]
    assert listed["uid"] == pod.uid
    assert json_field(listed, "node_name") == pod.node_name
    assert json_field(listed, "agent_connected") is True
    # Whatever the Serve proxy is doing now (this test may run before or after the Ray test),
    # the pod has been observed, so it has a state, and the label follows it. proto3 JSON
    # omits default values, but neither of these is one.
    state = listed["state"]
    assert state.startswith("SERVE_STATE_")
    assert state not in ("SERVE_STATE_UNSPECIFIED", "SERVE_STATE_UNKNOWN")
    assert json_field(listed, "desired_label") == (
        "true" if state == "SERVE_STATE_SERVING" else "false"
    )


def test_list_pods_filters_by_state(
    grpcurl: Any, pod: harness.PodIdentity, tracked_pod: pb.Pod
) -> None:
    # The agent heartbeats every second, far inside the 3 s TTL: its pod is never SILENT.
    answer = json.loads(
        grpcurl(
            f"{INSPECTION}/ListPods",
            data={"namespace": pod.namespace, "states": ["SERVE_STATE_SILENT"]},
        ).stdout
    )
    # An empty ListPodsResponse is all defaults: grpcurl prints {}.
    assert answer == {}
