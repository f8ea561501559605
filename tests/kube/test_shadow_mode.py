"""Shadow mode (``--dry-run``, issue 16) in process, against the Kubernetes API emulator over
real HTTP: in each mode (label, condition, both), pods that carry every kind of value are
reported on; the disagreement figures (metrics, GetSummary), ``Pod.carried`` and the would-be
writes are exact, and the API receives no write request at all. Then a normal aggregator on the
same emulator writes exactly what the dry run said it would (the registry seeds from what pods
carry). The whole programs, with PANIC and pods coming and going: test_shadow_mode_processes.py.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import KubeEmulator
from testsupport.messages import open_stream, report

GATE = "ray.io/serve-proxy-healthy"
LABEL = "ray.io/serve"
SERVING, NOT_READY = pb.SERVE_STATE_SERVING, pb.SERVE_STATE_NOT_READY
WRITES = ("POST", "PUT", "PATCH", "DELETE")

#: name: (label and condition it carries ("" none), the state its agent reports)
PODS: dict[str, tuple[str, int]] = {
    "p-in": ("false", SERVING),  # would enter
    "p-out": ("true", NOT_READY),  # would leave
    "p-agree-true": ("true", SERVING),
    "p-agree-false": ("", NOT_READY),  # nothing carried: out of service either way
    "p-ungated": ("", SERVING),  # no readiness gate: nothing to write in condition mode
}
#: mode: (would_enter, would_leave), would-be writes by kind, Pod.carried of each pod
EXPECTED: dict[str, tuple[tuple[int, int], dict[str, int], dict[str, str]]] = {
    "label": (
        (2, 1),
        {"label": 3, "condition": 0, "event": 3, "lease": 0},
        {"p-in": "false", "p-out": "true", "p-agree-true": "true"},
    ),
    "condition": (
        (1, 1),
        # p-agree-false's absent condition would be written False (not a disagreement).
        {"label": 0, "condition": 3, "event": 2, "lease": 0},
        {"p-in": "False", "p-out": "True", "p-agree-true": "True"},
    ),
    "both": (
        (2, 1),
        {"label": 3, "condition": 3, "event": 3, "lease": 0},
        {"p-in": "false", "p-out": "true", "p-agree-true": "true"},
    ),
}


def add_pods(kube: KubeEmulator) -> dict[str, str]:
    uids = {}
    for name, (carried, _) in PODS.items():
        labels = {"ray.io/node-type": "worker"} | ({LABEL: carried} if carried else {})
        gated = name != "p-ungated"
        conditions: list[dict[str, Any]] = []
        if carried and gated:
            status = "True" if carried == "true" else "False"
            conditions = [{"type": GATE, "status": status, "reason": "Set"}]
        pod = kube.add_pod(
            "default",
            name,
            labels=labels,
            readiness_gates=[GATE] if gated else [],
            conditions=conditions or None,
        )
        uids[name] = pod["metadata"]["uid"]
    return uids


def writes(kube: KubeEmulator, since: int = 0) -> list[tuple[str, str, str | None]]:
    return [
        (call.method, call.path, call.name)
        for method in WRITES
        for call in kube.requests(method, since=since)
    ]


def sample(aggregator: Aggregator, name: str, **labels: str) -> float | None:
    return aggregator.metrics.registry.get_sample_value(name, labels)


async def report_all(aggregator: Aggregator, uids: dict[str, str]) -> list[Any]:
    """Every pod's report, on its own stream (acked: handled); returns the open streams."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}")
    calls = []
    for name, (_, state) in PODS.items():
        call = await open_stream(channel, name, uid=uids[name])
        for sequence in (1, 2):  # two SERVING reports put a pod in (--success-threshold 2)
            await call.write(report(state, sequence, "success" if state == SERVING else "x"))
            assert (await call.read()).WhichOneof("kind") == "ack"
        calls.append(call)
    return [channel, *calls]


async def close(opened: list[Any]) -> None:
    channel, *calls = opened
    for call in calls:
        call.cancel()
    await channel.close()


@pytest.mark.parametrize("mode", ["label", "condition", "both"])
async def test_dry_run_counts_exactly_and_writes_nothing_then_a_normal_run_writes_the_rest(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, mode: str
) -> None:
    kube = kube_emulator
    uids = add_pods(kube)
    (enter, leave), would_be, carried = EXPECTED[mode]
    shadow = await start_kube(mode=mode, dry_run=True, heartbeat_ttl=60)
    assert sample(shadow, "serve_health_dry_run") == 1
    opened = await report_all(shadow, uids)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shadow.port}") as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        summary = await stub.GetSummary(pb.GetSummaryRequest())
        assert (summary.dry_run, summary.would_enter, summary.would_leave) == (True, enter, leave)
        for name in PODS:
            pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name=name))
            assert pod.carried == carried.get(name, ""), name
            assert pod.desired_label == ("true" if PODS[name][1] == SERVING else "false")
    for direction, count in (("in", enter), ("out", leave)):
        assert sample(shadow, "serve_health_shadow_disagreements", direction=direction) == count
    for kind, count in would_be.items():
        assert sample(shadow, "serve_health_would_be_writes_total", kind=kind) == count, kind
    assert sample(shadow, "serve_health_writes_pending") == 0
    await close(opened)
    await shadow.stop()
    assert writes(kube) == []
    assert kube.requests("GET", resource="pods")  # it did read: list and watch

    # Without --dry-run: the registry seeds from what pods carry, and only what differs is
    # written, which is exactly what the dry run counted.
    mark = kube.checkpoint()
    normal = await start_kube(mode=mode, heartbeat_ttl=60)
    assert sample(normal, "serve_health_dry_run") == 0
    opened = await report_all(normal, uids)
    await eventually(lambda: sample(normal, "serve_health_writes_pending") == 0, timeout=10)
    await eventually(
        lambda: len(kube.requests("POST", resource="events", since=mark)) == would_be["event"]
    )
    labels = kube.requests("PATCH", resource="pods", subresource=None, since=mark)
    conditions = kube.requests("PATCH", resource="pods", subresource="status", since=mark)
    assert (len(labels), len(conditions)) == (would_be["label"], would_be["condition"])
    disagreeing = {"p-in", "p-out"} | ({"p-ungated"} if mode != "condition" else set())
    assert {call.name for call in labels + conditions} >= disagreeing
    if mode == "label":
        assert {call.name for call in labels} == disagreeing
    assert sample(normal, "serve_health_would_be_writes_total", kind="label") == 0
    for direction in ("in", "out"):  # a drift measure too: zero once written
        assert sample(normal, "serve_health_shadow_disagreements", direction=direction) == 0
    await close(opened)


async def test_memory_backend_dry_run_keeps_no_label(start_aggregator: StartAggregator) -> None:
    """No API to spare there: the labels are simply not kept, and the figures say so."""
    aggregator = await start_aggregator(dry_run=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "pod-a")
        for sequence in (1, 2):
            await call.write(report(SERVING, sequence, "success"))
            assert (await call.read()).WhichOneof("kind") == "ack"
        stub = pb_grpc.InspectionServiceStub(channel)
        summary = await stub.GetSummary(pb.GetSummaryRequest())
        assert (summary.dry_run, summary.would_enter, summary.would_leave) == (True, 1, 0)
        pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name="pod-a"))
        assert (pod.carried, pod.desired_label) == ("", "true")
        call.cancel()
    assert sample(aggregator, "serve_health_would_be_writes_total", kind="label") == 1
