"""What a sidecar's Report stream is told of its own pod (issue 26), against the API emulator:
the fleet's size in its settings, then a PodView of its pod, and a new one whenever the pod
changed (each resource_version once): at once, without waiting for the agent's next report,
so that the view after the aggregator's own write is the one an agent in fallback writes on.
A DaemonSet agent's stream gets none; a shadow aggregator still sends it (facts only). The
memory backend, which watches nothing: tests/aggregator/test_fleet_size.py. The facts
themselves: tests/unit/test_pod_view.py."""

from __future__ import annotations

import grpc

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.override import ANNOTATION
from servehealth_common.pod_identity import PodKey
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import KubeEmulator
from testsupport.messages import batch, hello, node_hello, report

GATE = "ray.io/serve-proxy-healthy"
KEY = PodKey("default", "pod-a")
SERVING = pb.SERVE_STATE_SERVING


def resource_version(kube: KubeEmulator) -> str:
    pod = kube.pod("default", "pod-a")
    assert pod is not None
    return str(pod["metadata"]["resourceVersion"])


async def seen_by_the_aggregator(kube: KubeEmulator, aggregator: Aggregator) -> str:
    """The pod's resourceVersion now, once the aggregator's watch has shown it too."""

    def caught_up() -> bool:
        view = aggregator.registry.view(KEY)
        return view is not None and view.resource_version == resource_version(kube)

    await eventually(caught_up, timeout=10)
    return resource_version(kube)


class Sidecar:
    """A raw sidecar stream that keeps every message it reads."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.received: list[pb.AggregatorMessage] = []

    async def read(self) -> pb.AggregatorMessage:
        message = await self.call.read()
        assert message is not grpc.aio.EOF
        self.received.append(message)
        return message

    async def view_of(self, version: str) -> pb.PodView:
        """Read (acks, views of versions in between) until the view of ``version``."""
        while True:
            message = await self.read()
            if message.WhichOneof("kind") == "pod" and message.pod.resource_version == version:
                return message.pod
            assert message.WhichOneof("kind") in ("ack", "pod"), message

    async def end(self) -> None:
        await self.call.done_writing()
        while (message := await self.call.read()) is not grpc.aio.EOF:
            self.received.append(message)

    def versions(self) -> list[str]:
        return [m.pod.resource_version for m in self.received if m.WhichOneof("kind") == "pod"]


async def test_a_sidecar_gets_its_pod_after_the_settings_and_again_when_it_changed(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a", readiness_gates=[GATE])
    uid = pod["metadata"]["uid"]
    aggregator = await start_kube(mode="label", condition_type=GATE, events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        sidecar = Sidecar(pb_grpc.ReportServiceStub(channel).Report())
        await sidecar.call.write(hello(uid=uid, reports_on_change=True))
        settings = (await sidecar.read()).settings
        assert settings.fleet_size == 1 == aggregator.core.fleet_size()
        assert settings.resync_interval.ToNanoseconds() > 0
        first = (await sidecar.read()).pod  # at once, before any report
        assert first == pb.PodView(
            pod=pb.PodRef(namespace="default", name="pod-a", uid=uid),
            resource_version=resource_version(kube_emulator),
            node_name="node-1",
            gated=True,
        )
        assert not first.HasField("label")
        assert not first.HasField("condition")

        # SERVING: the aggregator writes the label, a new version of the pod.
        await sidecar.call.write(report(SERVING, 1, "success"))
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "true"
        )
        labelled = await seen_by_the_aggregator(kube_emulator, aggregator)
        await sidecar.call.write(report(SERVING, 2, "success"))
        view = await sidecar.view_of(labelled)
        assert (view.label, view.overridden) == ("true", False)

        # An override: the annotation, then the aggregator's write of what it wants.
        kube_emulator.modify_pod(
            "default", "pod-a", patch={"metadata": {"annotations": {ANNOTATION: "out-of-service"}}}
        )
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "false"
        )
        overridden = await seen_by_the_aggregator(kube_emulator, aggregator)
        await sidecar.call.write(report(SERVING, 3, "success"))
        view = await sidecar.view_of(overridden)
        assert (view.label, view.overridden, view.gated) == ("false", True, True)
        assert int(overridden) > int(labelled) > int(first.resource_version)

        # Nothing changed since: reports get their acks, and no view again.
        await sidecar.call.write(report(SERVING, 4, "success"))
        await sidecar.end()
    kinds = [message.WhichOneof("kind") for message in sidecar.received]
    assert kinds[:2] == ["settings", "pod"]
    assert kinds.count("ack") == 4
    assert kinds[-1] == "ack"  # the last report's: no view after it
    versions = sidecar.versions()
    assert len(set(versions)) == len(versions)  # each version once
    assert [int(v) for v in versions] == sorted(int(v) for v in versions)


async def test_a_shadow_aggregator_tells_the_sidecar_its_pod_too(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a", annotations={ANNOTATION: "in-service"})
    aggregator = await start_kube(dry_run=True, events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = pb_grpc.ReportServiceStub(channel).Report()
        await call.write(hello(uid=pod["metadata"]["uid"], reports_on_change=True))
        assert (await call.read()).WhichOneof("kind") == "settings"
        view = (await call.read()).pod
        assert view.resource_version == pod["metadata"]["resourceVersion"]
        assert view.overridden
        assert not view.gated
        call.cancel()


async def test_a_daemonset_stream_gets_no_pod_view(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    kube_emulator.add_pod("default", "pod-a")
    kube_emulator.add_pod("default", "pod-b")
    aggregator = await start_kube(events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = pb_grpc.ReportServiceStub(channel).Report()
        hello_message = node_hello("node-1")
        hello_message.hello.reports_on_change = True
        await call.write(hello_message)
        settings = (await call.read()).settings
        assert settings.fleet_size == 2  # the pods tracked: more than the agents
        for sequence in (1, 2):
            await call.write(
                batch([("default", "pod-a", SERVING), ("default", "pod-b", SERVING)], sequence)
            )
            assert (await call.read()).ack.sequence == sequence
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "true"
        )
        await call.write(batch([("default", "pod-a", SERVING)], 3))
        await call.done_writing()
        rest = []
        while (message := await call.read()) is not grpc.aio.EOF:
            rest.append(message.WhichOneof("kind"))
    assert rest == ["ack"]


async def test_the_view_after_the_aggregators_own_write_comes_without_a_report(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a", readiness_gates=[GATE])
    uid = pod["metadata"]["uid"]
    aggregator = await start_kube(mode="label", condition_type=GATE, events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        sidecar = Sidecar(pb_grpc.ReportServiceStub(channel).Report())
        await sidecar.call.write(hello(uid=uid, reports_on_change=True))
        await sidecar.read()  # settings
        await sidecar.read()  # the first view
        await sidecar.call.write(report(SERVING, 1, "success"))  # the only report
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "true"
        )
        labelled = await seen_by_the_aggregator(kube_emulator, aggregator)
        view = await sidecar.view_of(labelled)  # no report since the one that moved it
        assert view.label == "true"
        await sidecar.end()
