"""Limits (streams per peer, pods per stream, reports per second): past one, that stream alone
ends with RESOURCE_EXHAUSTED; other agents keep reporting and the aggregator stays SERVING."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.ingest.admission import peer_host
from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator
from testsupport.messages import batch, open_node_stream, open_stream, read_until_error, report

SERVING = pb.SERVE_STATE_SERVING
DRAINING = pb.SERVE_STATE_DRAINING


async def assert_still_fine(
    aggregator: Aggregator, good: grpc.aio.StreamStreamCall, sequence: int
) -> None:
    """The good agent's next report is acked and counted; the server is SERVING."""
    await good.write(report(DRAINING if sequence % 2 else SERVING, sequence))
    assert (await good.read()).ack.sequence == sequence
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="servehealth.v1.ReportService"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        summary = await pb_grpc.InspectionServiceStub(channel).GetSummary(
            pb.GetSummaryRequest(), timeout=5
        )
    assert summary.pods_by_state["SERVE_STATE_DRAINING" if sequence % 2 else "SERVE_STATE_SERVING"]


def rejected(aggregator: Aggregator, code: str = "RESOURCE_EXHAUSTED") -> float:
    value = aggregator.metrics.registry.get_sample_value(
        "serve_health_streams_rejected_total", {"code": code}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5000", "10.1.2.3"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:[::ffff:127.0.0.1]:5000", "127.0.0.1"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
    ],
)
def test_peer_is_the_address_without_its_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


async def test_streams_past_the_per_peer_limit_are_refused_and_other_peers_unaffected(
    start_aggregator: StartAggregator,
) -> None:
    # Dual-stack listener: 127.0.0.1 and ::1 are two different peers of one server.
    aggregator = await start_aggregator(listen="[::]:0", max_streams_per_peer=3)
    async with (
        grpc.aio.insecure_channel(f"[::1]:{aggregator.port}") as good_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as crowd,
    ):
        good = await open_stream(good_channel, name="good-pod")
        await assert_still_fine(aggregator, good, 1)
        streams = [await open_stream(crowd, name=f"pod-{i}") for i in range(3)]

        extra = pb_grpc.ReportServiceStub(crowd).Report()
        error = await read_until_error(extra)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many report streams from 127.0.0.1" in (error.details() or "")
        assert "--max-streams-per-peer 3" in (error.details() or "")
        assert rejected(aggregator) == 1

        # The peer's three streams and the other peer are untouched.
        for sequence, stream in enumerate(streams, start=1):
            await stream.write(report(SERVING, sequence))
            assert (await stream.read()).ack.sequence == sequence
        await assert_still_fine(aggregator, good, 2)
        more_good = await open_stream(good_channel, name="good-pod-2")

        # A stream that ends frees its slot.
        streams[0].cancel()
        await asyncio.sleep(0.1)
        streams[0] = await open_stream(crowd, name="pod-0")
        for stream in (*streams, good, more_good):
            stream.cancel()


async def test_a_stream_reporting_for_too_many_pods_is_ended(
    start_aggregator: StartAggregator,
) -> None:
    aggregator = await start_aggregator(max_pods_per_stream=3)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        good = await open_stream(channel, name="good-pod")
        node = await open_node_stream(channel)
        pods = [("default", f"pod-{i}", SERVING) for i in range(3)]
        await node.write(batch(pods, 1))
        assert (await node.read()).ack.sequence == 1
        await node.write(batch(pods[:2], 2))  # the same pods again: fine
        assert (await node.read()).ack.sequence == 2

        await node.write(batch([("default", "pod-3", SERVING)], 3))
        error = await read_until_error(node)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 3 pods (--max-pods-per-stream)" in (error.details() or "")
        assert rejected(aggregator) == 1
        await assert_still_fine(aggregator, good, 1)
        inspection = pb_grpc.InspectionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as never_tracked:
            await inspection.GetPod(pb.GetPodRequest(namespace="default", name="pod-3"))
        assert never_tracked.value.code() is grpc.StatusCode.NOT_FOUND
        summary = await inspection.GetSummary(pb.GetSummaryRequest())
        # The ended stream's pods are forgotten too (memory backend: nothing can check them).
        assert summary.pods == 1
        good.cancel()


async def test_a_report_flood_ends_its_stream_only(start_aggregator: StartAggregator) -> None:
    rate = 20
    aggregator = await start_aggregator(max_reports_per_second=rate)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        good = await open_stream(channel, name="good-pod")
        loop = asyncio.get_running_loop()
        opened = loop.time()  # before the flooding stream (and its budget) exists
        flood = await open_stream(channel, name="flooding-pod")
        started = loop.time()
        sent = 0

        async def send_at_ten_times_the_rate() -> grpc.aio.AioRpcError:
            # Each write waits for its ack (ack_every=1), so the error comes from a read,
            # never from a write racing the server's close (the client would say INTERNAL).
            nonlocal sent
            while loop.time() - started < 30:  # only a limit that never cuts takes this long
                sent += 1
                await flood.write(report(SERVING, sent))
                try:
                    assert (await flood.read()).ack.sequence == sent
                except grpc.aio.AioRpcError as error:
                    return error
                await asyncio.sleep(1 / (10 * rate))
            raise AssertionError(f"{sent} reports in 30 s and the stream still open")

        sender = asyncio.create_task(send_at_ten_times_the_rate())
        sequence = 0
        while not sender.done():  # the good agent reports at 10 Hz meanwhile, all acked
            sequence += 1
            await good.write(report(SERVING, sequence))
            assert (await good.read()).ack.sequence == sequence
            await asyncio.sleep(0.1)
        error = await sender
        took = loop.time() - opened
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"more than {rate} report messages per second" in (error.details() or "")
        # The burst went through; the cut came once the bucket was empty: the reports let
        # through (all but the last sent) are at most the burst plus the rate for as long as
        # the stream was open, however fast this machine let the flood go.
        print(f"cut after {sent} reports, {took:.2f}s")
        assert sent - 1 >= rate, (sent, took)  # the whole burst
        assert sent - 1 <= rate + rate * took + 1, (sent, took)
        assert rejected(aggregator) == 1
        await assert_still_fine(aggregator, good, sequence + 1)
        good.cancel()


async def test_an_agent_at_the_rate_limit_is_not_cut(start_aggregator: StartAggregator) -> None:
    """A stream at 80 % of the rate for 2 s (after a full burst) keeps going."""
    rate = 20
    aggregator = await start_aggregator(max_reports_per_second=rate)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        stream = await open_stream(channel)
        sequence = 0
        for _ in range(rate - 1):  # the burst (the hello took no token)
            sequence += 1
            await stream.write(report(SERVING, sequence))
            assert (await stream.read()).ack.sequence == sequence
        for _ in range(int(2 * 0.8 * rate)):
            await asyncio.sleep(1 / (0.8 * rate))
            sequence += 1
            await stream.write(report(SERVING, sequence))
            assert (await stream.read()).ack.sequence == sequence
        assert rejected(aggregator) == 0
        stream.cancel()


async def test_a_stream_without_a_hello_is_ended_and_frees_its_place(
    start_aggregator: StartAggregator,
) -> None:
    aggregator = await start_aggregator(hello_timeout=0.3, max_streams_per_peer=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        good = await open_stream(channel, name="good")
        silent = pb_grpc.ReportServiceStub(channel).Report()  # opened, never says hello
        error = await read_until_error(silent)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no hello within 0.3s" in (error.details() or "")
        assert rejected(aggregator, "DEADLINE_EXCEEDED") == 1
        # Its place under --max-streams-per-peer is free again.
        again = await open_stream(channel, name="again")
        await assert_still_fine(aggregator, good, 1)
        good.cancel()
        again.cancel()
