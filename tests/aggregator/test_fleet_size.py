"""AgentSettings.fleet_size on the memory backend (issue 26): what agents that report on change
are told of the fleet (the pods tracked, or the agents connected if more: the size the resync
interval follows), never to agents that send heartbeats; and no PodView, since this backend
watches no pods. The Kubernetes side (PodView): tests/kube/test_pod_view.py."""

from __future__ import annotations

import grpc

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport.messages import hello, report


async def open_sidecar(
    channel: grpc.aio.Channel, name: str, *, on_change: bool = True
) -> tuple[grpc.aio.StreamStreamCall, pb.AgentSettings]:
    call = pb_grpc.ReportServiceStub(channel).Report()
    await call.write(hello(name=name, reports_on_change=on_change))
    first = await call.read()
    assert first.WhichOneof("kind") == "settings"
    return call, first.settings


async def rest_of(call: grpc.aio.StreamStreamCall) -> list[str]:
    """The kinds of what the aggregator sends until the end, once the agent is done."""
    await call.done_writing()
    kinds = []
    while (message := await call.read()) is not grpc.aio.EOF:
        kinds.append(message.WhichOneof("kind"))
    return kinds


async def test_fleet_size_follows_pods_and_agents(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    first, settings = await open_sidecar(channel, "pod-a")
    assert settings.fleet_size == 1 == aggregator.core.fleet_size()
    second, settings = await open_sidecar(channel, "pod-b")
    assert settings.fleet_size == 2
    # An agent that sends heartbeats is not told (it has no fallback to budget).
    heartbeats, settings = await open_sidecar(channel, "pod-c", on_change=False)
    assert settings.fleet_size == 0
    assert not settings.HasField("resync_interval")
    assert aggregator.core.fleet_size() == 3
    for call in (first, second, heartbeats):
        await call.write(report(pb.SERVE_STATE_SERVING, 1, "success"))
        assert (await call.read()).ack.sequence == 1
        await call.write(report(pb.SERVE_STATE_SERVING, 2, "success"))
        # No PodView: the memory backend watches no pods.
        assert await rest_of(call) == ["ack"]
