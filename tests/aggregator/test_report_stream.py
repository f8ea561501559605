"""The Report stream over a real grpc.aio server: hello, settings, reports, acks, heartbeat
expiry, agents coming and going, and a real agent reconnecting after an aggregator restart."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import duration_pb2

from aggregator.server import Aggregator
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.probe import Prober, make_session
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually, metrics_port
from testsupport.fakes import DRAINING, FakeServeProxy
from testsupport.messages import hello, open_stream, report


async def test_hello_gets_settings_then_reports_get_acks(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    call = pb_grpc.ReportServiceStub(channel).Report()
    await call.write(hello())
    settings = await call.read()
    assert settings.settings.heartbeat_interval.ToNanoseconds() == 1_000_000_000
    await call.write(
        report(
            pb.SERVE_STATE_SERVING,
            7,
            "success",
            http_status=200,
            probe_latency=duration_pb2.Duration(nanos=3_000_000),
        )
    )
    ack = await call.read()
    assert ack.ack.sequence == 7
    # The probe latency it reported: in the histogram's 5 ms bucket, not in the 2.5 ms one.
    sample = aggregator.metrics.registry.get_sample_value
    assert sample("serve_health_report_probe_seconds_bucket", {"le": "0.005"}) == 1
    assert sample("serve_health_report_probe_seconds_bucket", {"le": "0.0025"}) == 0
    record = aggregator.core.pod(PodKey("default", "pod-a"))
    assert record is not None
    assert (record.state, record.reason, record.http_status) == (ServeState.SERVING, "success", 200)
    assert record.agent is not None
    assert aggregator.core.agents_connected == 1
    assert aggregator.registry.carried(PodKey("default", "pod-a"), WriteKind.LABEL) == "true"
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    await eventually(lambda: aggregator.core.agents_connected == 0)
    # The memory backend can neither watch nor pull the pod: with its agent gone, it is
    # forgotten (tests/aggregator/test_memory_backend.py).
    assert aggregator.core.pod(PodKey("default", "pod-a")) is None


async def test_listpods_shows_source_age_and_desired_label(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    call = await open_stream(channel)
    await call.write(report(pb.SERVE_STATE_DRAINING, 1, "This node is being drained."))
    await call.read()
    inspection = pb_grpc.InspectionServiceStub(channel)
    listed = await inspection.ListPods(pb.ListPodsRequest(), timeout=5)
    assert [(p.namespace, p.name) for p in listed.pods] == [("default", "pod-a")]
    pod = listed.pods[0]
    assert pod.state == pb.SERVE_STATE_DRAINING
    assert pod.source == pb.SOURCE_PUSH
    assert pod.desired_label == "false"
    assert pod.agent_connected
    assert pod.HasField("last_report_age")
    assert pod.last_report_age.ToNanoseconds() < 5e9
    assert pod.reason == "This node is being drained."
    filtered = await inspection.ListPods(
        pb.ListPodsRequest(states=[pb.SERVE_STATE_SERVING]), timeout=5
    )
    assert not filtered.pods
    other_namespace = await inspection.ListPods(pb.ListPodsRequest(namespace="kube-system"))
    assert not other_namespace.pods
    got = await inspection.GetPod(pb.GetPodRequest(namespace="default", name="pod-a"), timeout=5)
    # The same pod as ListPods gave, but for the times derived from "now" (time went on, and
    # state_since is converted from the monotonic clock to the wall clock at each call).
    assert abs(got.state_since.ToNanoseconds() - pod.state_since.ToNanoseconds()) < 10_000_000
    for message in (got, pod):
        message.ClearField("last_report_age")
        message.ClearField("state_since")
    assert got == pod
    summary = await inspection.GetSummary(pb.GetSummaryRequest(), timeout=5)
    assert summary.pods == 1
    assert summary.agents_connected == 1
    assert summary.pods_by_state["SERVE_STATE_DRAINING"] == 1
    assert summary.pods_by_state["SERVE_STATE_SERVING"] == 0
    assert summary.label_key == "ray.io/serve"
    call.cancel()


async def test_getpod_unknown_is_not_found(channel: grpc.aio.Channel) -> None:
    inspection = pb_grpc.InspectionServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inspection.GetPod(pb.GetPodRequest(namespace="default", name="nope"), timeout=5)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inspection.GetPod(pb.GetPodRequest(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_silent_agent_expires_to_silent_while_stream_stays_open(
    start_aggregator: StartAggregator,
) -> None:
    aggregator = await start_aggregator(
        heartbeat_ttl=0.4, heartbeat_interval=0.1, expiry_interval=0.05
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel)
        await call.write(report(pb.SERVE_STATE_SERVING, 1))
        await call.read()
        key = PodKey("default", "pod-a")
        assert aggregator.core.pod(key).state is ServeState.SERVING  # type: ignore[union-attr]
        # The agent stops sending but keeps its stream open.
        record = await eventually(
            lambda: (r := aggregator.core.pod(key)) and r.state is ServeState.SILENT and r
        )
        assert record.agent is not None  # still connected, just silent
        assert aggregator.registry.carried(key, WriteKind.LABEL) == "false"
        await call.write(report(pb.SERVE_STATE_SERVING, 2))
        await call.read()
        assert aggregator.core.pod(key).state is ServeState.SERVING  # type: ignore[union-attr]
        call.cancel()


async def test_watch_transitions_streams_changes(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    inspection = pb_grpc.InspectionServiceStub(channel)
    watch = inspection.WatchTransitions(pb.WatchTransitionsRequest(namespace="default"))
    await eventually(lambda: aggregator.metrics.watchers._value.get() == 1)
    call = await open_stream(channel)
    await call.write(report(pb.SERVE_STATE_SERVING, 1, "success"))
    await call.write(report(pb.SERVE_STATE_NO_PROXY, 2, "Connection refused"))
    first = await asyncio.wait_for(watch.read(), 5)
    second = await asyncio.wait_for(watch.read(), 5)
    assert (first.from_state, first.to_state, first.desired_label) == (
        pb.SERVE_STATE_UNKNOWN,
        pb.SERVE_STATE_SERVING,
        "true",
    )
    assert (second.from_state, second.to_state, second.desired_label, second.reason) == (
        pb.SERVE_STATE_SERVING,
        pb.SERVE_STATE_NO_PROXY,
        "false",
        "Connection refused",
    )
    assert second.source == pb.SOURCE_PUSH
    assert second.time.seconds > 1_700_000_000  # wall clock
    watch.cancel()
    call.cancel()


async def test_metrics_endpoint_counts_pods_and_reports(
    aggregator: Aggregator, channel: grpc.aio.Channel
) -> None:
    from aiohttp import ClientSession, ClientTimeout

    call = await open_stream(channel)
    await call.write(report(pb.SERVE_STATE_SERVING, 1))
    await call.read()
    async with (
        ClientSession(timeout=ClientTimeout(total=5)) as session,
        session.get(f"http://127.0.0.1:{metrics_port(aggregator)}/metrics") as response,
    ):
        text = await response.text()
    assert response.status == 200
    assert 'serve_health_pods{state="SERVING"} 1.0' in text
    assert "serve_health_reports_total 1.0" in text
    assert "serve_health_agents_connected 1.0" in text
    assert (
        'serve_health_transitions_total{from_state="UNKNOWN",source="push",to_state="SERVING"} 1.0'
        in text
    )
    call.cancel()


async def test_real_agent_reconnects_after_aggregator_restart(
    start_aggregator: StartAggregator, fake_proxy: FakeServeProxy
) -> None:
    first = await start_aggregator()
    port = first.port
    identity = SidecarPod("default", "pod-a", "uid-a", "node-1")
    settings = AgentFlags(
        aggregator=f"127.0.0.1:{port}", proxy_url=fake_proxy.url, reconnect_max=0.5
    )
    key = PodKey("default", "pod-a")
    async with make_session() as session:
        agent = Agent(settings, identity, Prober(session, settings.probe_timeout))
        task = asyncio.create_task(agent.run())
        try:
            await eventually(lambda: (r := first.core.pod(key)) and r.state is ServeState.SERVING)
            await first.stop()
            fake_proxy.set(DRAINING)  # changes while the aggregator is away
            second = await start_aggregator(listen=f"127.0.0.1:{port}")
            record = await eventually(
                lambda: (r := second.core.pod(key)) and r.state is ServeState.DRAINING and r,
                timeout=10,
            )
            assert record.agent is not None
            assert second.core.agents_connected == 1
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
