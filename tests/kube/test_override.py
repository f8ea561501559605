"""The manual override (``ray-serve-health/override``) on the API emulator, in process.

Pods are probed by the aggregator itself (no agents: pulls of fake Serve proxies on loopback);
the annotation is put on and taken off through the emulator, as ``kubectl annotate`` would.
Each value in each mode (label, condition, both), applied and removed: what is written, the
Events, ``GetPod`` (the probed state stays, the wanted value and the reason say override),
``GetSummary`` and the metric. A malformed value: ignored, one Warning Event however often the
watch shows it. PANIC does not hold ``out-of-service``; in shadow mode nothing is written but
the figures count it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.override import ANNOTATION
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.fakes import DRAINING, FakeServeProxy
from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator

GATE = "ray.io/serve-ready"
MODES = ["label", "condition", "both"]


@pytest.fixture
def start(start_kube: StartAggregator) -> StartAggregator:
    async def started(**overrides: Any) -> Aggregator:
        settings = {
            "startup_grace": 0.3,
            "pull_interval": 0.2,
            "pull_timeout": 0.5,
            "condition_type": GATE,
            **overrides,
        }
        return await start_kube(**settings)

    return started


@pytest.fixture
async def proxies() -> AsyncIterator[list[FakeServeProxy]]:
    started = [await FakeServeProxy().start() for _ in range(10)]
    yield started
    for proxy in started:
        await proxy.stop()


def add(kube: KubeEmulator, name: str, proxy: FakeServeProxy, mode: str = "label") -> None:
    gates = [GATE] if mode != "label" else []
    kube.add_pod("default", name, pod_ip="127.0.0.1", serve_port=proxy.port, readiness_gates=gates)


def annotate(kube: KubeEmulator, name: str, value: str | None) -> None:
    kube.modify_pod("default", name, patch={"metadata": {"annotations": {ANNOTATION: value}}})


def in_service(kube: KubeEmulator, name: str, mode: str) -> bool | None:
    """True or False when everything the mode writes agrees; None while it does not."""
    values = []
    if mode in ("label", "both"):
        values.append(kube.pod_labels("default", name).get("ray.io/serve") == "true")
    if mode in ("condition", "both"):
        condition = kube.pod_conditions("default", name).get(GATE)
        values.append(condition is not None and condition["status"] == "True")
    return values[0] if all(value == values[0] for value in values) else None


def override_events(kube: KubeEmulator) -> list[tuple[str, str, str]]:
    return [
        (event["reason"], event["type"], event["involvedObject"]["name"])
        for event in kube.events("default")
        if event["reason"].startswith("ServeOverride")
    ]


async def inspect(aggregator: Aggregator, name: str) -> tuple[pb.Pod, pb.Summary]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name=name))
        summary = await stub.GetSummary(pb.GetSummaryRequest())
    return pod, summary


def overridden(aggregator: Aggregator, value: str) -> float | None:
    return aggregator.metrics.registry.get_sample_value("serve_health_overrides", {"value": value})


@pytest.mark.parametrize("mode", MODES)
async def test_out_of_service_takes_a_healthy_pod_out_and_back(
    kube_emulator: KubeEmulator, start: StartAggregator, proxies: list[FakeServeProxy], mode: str
) -> None:
    add(kube_emulator, "pod-a", proxies[0], mode)
    aggregator = await start(mode=mode)
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", mode) is True)

    annotate(kube_emulator, "pod-a", "out-of-service")
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", mode) is False)
    await eventually(lambda: len(override_events(kube_emulator)) == 1)
    assert override_events(kube_emulator) == [("ServeOverrideApplied", "Normal", "pod-a")]
    if mode != "label":  # the condition says why, too
        condition = kube_emulator.pod_conditions("default", "pod-a")[GATE]
        assert condition["message"].startswith("override out-of-service (")
    # Writes are timed from their decision to landing: one sample per pending write (a newer
    # value wanted while one is in flight, as the override here may be, extends the same one).
    kind = "label" if mode != "condition" else "condition"
    await eventually(
        lambda: (
            (
                aggregator.metrics.registry.get_sample_value(
                    "serve_health_write_delay_seconds_count", {"kind": kind}
                )
                or 0
            )
            >= 1
        )
    )
    pod, summary = await inspect(aggregator, "pod-a")
    assert pod.state == pb.SERVE_STATE_SERVING  # the probed state stays visible
    assert pod.override == "out-of-service"
    assert pod.desired_label == "false"
    assert pod.reason == f"override out-of-service ({ANNOTATION}); probed: success"
    assert (summary.overridden_out_of_service, summary.overridden_in_service) == (1, 0)
    assert overridden(aggregator, "out-of-service") == 1
    assert overridden(aggregator, "in-service") == 0

    annotate(kube_emulator, "pod-a", None)
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", mode) is True)
    await eventually(lambda: len(override_events(kube_emulator)) == 2)
    assert override_events(kube_emulator)[1] == ("ServeOverrideRemoved", "Normal", "pod-a")
    pod, summary = await inspect(aggregator, "pod-a")
    assert (pod.override, pod.desired_label, pod.reason) == ("", "true", "success")
    assert summary.overridden_out_of_service == 0
    assert overridden(aggregator, "out-of-service") == 0


@pytest.mark.parametrize("mode", MODES)
async def test_in_service_keeps_a_failing_pod_in_until_it_is_removed(
    kube_emulator: KubeEmulator, start: StartAggregator, proxies: list[FakeServeProxy], mode: str
) -> None:
    add(kube_emulator, "pod-a", proxies[0], mode)
    aggregator = await start(mode=mode)
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", mode) is True)
    annotate(kube_emulator, "pod-a", "in-service")
    await eventually(lambda: len(override_events(kube_emulator)) == 1)
    writes = kube_emulator.checkpoint()

    proxies[0].set(DRAINING)
    key = PodKey("default", "pod-a")
    await eventually(lambda: aggregator.core.pod(key).state is ServeState.DRAINING)
    pod, summary = await inspect(aggregator, "pod-a")
    assert (pod.state, pod.override, pod.desired_label) == (
        pb.SERVE_STATE_DRAINING,
        "in-service",
        "true",
    )
    assert pod.reason.startswith("override in-service (")
    assert summary.overridden_in_service == 1
    assert in_service(kube_emulator, "pod-a", mode) is True
    assert kube_emulator.requests("PATCH", since=writes) == []  # nothing to write: it stays in

    annotate(kube_emulator, "pod-a", None)  # the health decides again: out
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", mode) is False)
    await eventually(lambda: len(override_events(kube_emulator)) == 2)  # Events are sent apart
    assert [reason for reason, _, _ in override_events(kube_emulator)] == [
        "ServeOverrideApplied",
        "ServeOverrideRemoved",
    ]


async def test_a_malformed_value_is_ignored_with_one_warning_event(
    kube_emulator: KubeEmulator,
    start: StartAggregator,
    proxies: list[FakeServeProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    add(kube_emulator, "pod-a", proxies[0])
    aggregator = await start()
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", "label") is True)
    annotate(kube_emulator, "pod-a", "maintenance")
    await eventually(lambda: len(override_events(kube_emulator)) == 1)
    assert override_events(kube_emulator) == [("ServeOverrideIgnored", "Warning", "pod-a")]
    assert f"{ANNOTATION}='maintenance' ignored" in caplog.text
    # The watch shows the pod again (another label changes): the same value, no second Event.
    kube_emulator.modify_pod("default", "pod-a", labels={"team": "serving"})
    proxies[0].set(DRAINING)  # and its health still decides
    await kube_emulator.wait_until(lambda: in_service(kube_emulator, "pod-a", "label") is False)
    assert len(override_events(kube_emulator)) == 1
    assert caplog.text.count("'maintenance' ignored") == 1
    pod, _ = await inspect(aggregator, "pod-a")
    assert pod.override == ""


async def test_out_of_service_is_not_held_by_panic(
    kube_emulator: KubeEmulator, start: StartAggregator, proxies: list[FakeServeProxy]
) -> None:
    for i, proxy in enumerate(proxies):
        add(kube_emulator, f"pod-{i}", proxy)
    aggregator = await start(pull_interval=0.5)
    await kube_emulator.wait_until(
        lambda: all(in_service(kube_emulator, f"pod-{i}", "label") for i in range(10)), within=10
    )
    for proxy in proxies[:8]:  # 80 % hang: PANIC holds their removals
        proxy.hang = True
    await eventually(lambda: aggregator.core.summary().panic_held_writes == 8, timeout=10)
    annotate(kube_emulator, "pod-9", "out-of-service")  # a healthy one, for maintenance
    annotate(kube_emulator, "pod-0", "out-of-service")  # a hung one, held until now
    await kube_emulator.wait_until(
        lambda: (
            not in_service(kube_emulator, "pod-9", "label")
            and not in_service(kube_emulator, "pod-0", "label")
        )
    )
    assert aggregator.core.panic
    assert all(in_service(kube_emulator, f"pod-{i}", "label") for i in range(1, 9))


async def test_an_override_in_shadow_mode_is_counted_not_written(
    kube_emulator: KubeEmulator, start: StartAggregator, proxies: list[FakeServeProxy]
) -> None:
    labels = {**DEFAULT_POD_LABELS, "ray.io/serve": "true"}
    kube_emulator.add_pod(
        "default", "pod-a", pod_ip="127.0.0.1", serve_port=proxies[0].port, labels=labels
    )
    aggregator = await start(dry_run=True)
    key = PodKey("default", "pod-a")
    await eventually(lambda: aggregator.core.pod(key).state is ServeState.SERVING)
    annotate(kube_emulator, "pod-a", "out-of-service")
    would_be = aggregator.metrics.would_be_writes.labels("label")
    await eventually(lambda: would_be._value.get() == 1)
    pod, summary = await inspect(aggregator, "pod-a")
    assert (pod.carried, pod.desired_label, pod.override) == ("true", "false", "out-of-service")
    assert (summary.dry_run, summary.would_leave, summary.overridden_out_of_service) == (
        True,
        1,
        1,
    )
    writes = [call for call in kube_emulator.requests() if call.method in ("POST", "PUT", "PATCH")]
    assert writes == []
    assert override_events(kube_emulator) == []  # a would-be Event, counted
    assert aggregator.metrics.would_be_writes.labels("event")._value.get() >= 1
