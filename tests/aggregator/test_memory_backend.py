"""The memory backend (no cluster) keeps only pods someone speaks for (issue 13, point 6).

Nothing can watch or pull a pod there, so a pod whose agent's stream ended is forgotten at once,
and one whose open stream went silent is forgotten after ten heartbeat TTLs; a departed fleet
therefore never holds the aggregator in PANIC, and the in-memory label follows what the
aggregator decides. ``pods_in_pull_mode`` counts only pods that are really pulled: none here.
"""

from __future__ import annotations

import grpc

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.states import ServeState
from tests.conftest import FakeClock, StartAggregator, eventually
from testsupport.messages import batch, open_node_stream, open_stream, report

SERVING, NO_PROXY = pb.SERVE_STATE_SERVING, pb.SERVE_STATE_NO_PROXY


def key(name: str) -> PodKey:
    return PodKey("default", name)


async def summary(channel: grpc.aio.Channel) -> pb.Summary:
    return await pb_grpc.InspectionServiceStub(channel).GetSummary(pb.GetSummaryRequest())


async def test_agents_that_leave_are_forgotten_and_the_last_label_follows(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    """The trial: four agents, three stop; the aggregator showed PANIC with 3 SILENT for ever,
    and the fourth pod's label then stayed ``true`` though its proxy had failed."""
    streams = {}
    for number in range(4):
        name = f"pod-{number}"
        streams[name] = await open_stream(channel, name=name)
        await streams[name].write(report(SERVING, 1, "success", http_status=200))
        assert (await streams[name].read()).ack.sequence == 1
    await eventually(lambda: aggregator.core.counts()[ServeState.SERVING] == 4)

    for name in ("pod-0", "pod-1", "pod-2"):
        streams.pop(name).cancel()  # the agent stops: its stream ends
    await eventually(lambda: aggregator.core.tracked() == 1)
    fleet = await summary(channel)
    assert (fleet.pods, fleet.panic, fleet.agents_connected) == (1, False, 1)
    assert aggregator.registry.carried(key("pod-0"), WriteKind.LABEL) is None  # forgotten

    last = streams["pod-3"]
    await last.write(report(NO_PROXY, 2, "connection refused"))
    assert (await last.read()).ack.sequence == 2
    record = aggregator.core.pod(key("pod-3"))
    assert record is not None
    assert record.state is ServeState.NO_PROXY
    assert aggregator.registry.carried(key("pod-3"), WriteKind.LABEL) == "false"
    last.cancel()


async def test_a_silent_pod_is_forgotten_after_ten_ttls(
    start_aggregator: StartAggregator,
) -> None:
    clock = FakeClock()
    aggregator = await start_aggregator(clock=clock, heartbeat_ttl=3.0, expiry_interval=0.01)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, name="quiet")
        await call.write(report(SERVING, 1, "success", http_status=200))
        await call.read()
        clock.advance(3.5)  # past the TTL: SILENT, and nothing can pull it here
        await eventually(lambda: aggregator.core.counts()[ServeState.SILENT] == 1)
        fleet = await summary(channel)
        assert (fleet.pods, fleet.pods_in_pull_mode) == (1, 0)  # no pulls in memory mode
        clock.advance(29.0)  # SILENT for 29 s: still there (the bound is 10 TTLs, 30 s)
        await eventually(lambda: aggregator.core.counts()[ServeState.SILENT] == 1)
        assert aggregator.core.pod(key("quiet")) is not None
        clock.advance(1.5)
        await eventually(lambda: aggregator.core.pod(key("quiet")) is None)
        call.cancel()


async def test_a_daemonset_agents_pods_leave_with_it(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    node = await open_node_stream(channel)
    await node.write(batch([("default", "a", SERVING), ("default", "b", SERVING)], 1))
    assert (await node.read()).ack.sequence == 1
    assert aggregator.core.tracked() == 2
    node.cancel()
    await eventually(lambda: aggregator.core.tracked() == 0)
    assert not (await summary(channel)).panic
