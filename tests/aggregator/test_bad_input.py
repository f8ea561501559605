"""Malformed reports end their own stream with a clear status; nothing else is affected."""

from __future__ import annotations

import grpc
import pytest

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport.messages import hello, open_stream, pod_report, read_until_error, report

CASES = [
    pytest.param(
        [report(pb.SERVE_STATE_SERVING, 1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "first message on a Report stream must be a hello",
        id="report-before-hello",
    ),
    pytest.param(
        [hello(name="")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "hello.pod.name is empty",
        id="empty-pod-name",
    ),
    pytest.param(
        [hello(namespace="")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "hello.pod.namespace is empty",
        id="empty-namespace",
    ),
    pytest.param(
        [hello(name="Not_A_Pod")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "is not a valid pod name",
        id="invalid-pod-name",
    ),
    pytest.param(
        [pb.AgentMessage(hello=pb.Hello(node_name="n"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "hello.mode must be",
        id="no-mode",
    ),
    pytest.param(
        [hello(), report(42, 1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "report.state 42 (unknown) is not a state an agent may report",
        id="unknown-enum-value",
    ),
    pytest.param(
        [hello(), report(pb.SERVE_STATE_SILENT, 1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SERVE_STATE_SILENT is not a state an agent may report",
        id="aggregator-only-state",
    ),
    pytest.param(
        [hello(), report(pb.SERVE_STATE_UNSPECIFIED, 1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SERVE_STATE_UNSPECIFIED is not a state an agent may report",
        id="unspecified-state",
    ),
    pytest.param(
        [hello(), hello()],
        grpc.StatusCode.INVALID_ARGUMENT,
        "hello may be sent only once",
        id="second-hello",
    ),
    pytest.param(
        [
            hello(),
            pod_report(
                pod=pb.PodRef(namespace="default", name="someone-else"),
                state=pb.SERVE_STATE_SERVING,
            ),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "may not report for pod default/someone-else",
        id="sidecar-reports-for-another-pod",
    ),
    pytest.param(
        [hello(agent_version="x" * (100 * 1024))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
        id="message-over-64KiB",
    ),
]


@pytest.mark.parametrize(("messages", "code", "detail"), CASES)
async def test_bad_stream_is_closed_with_a_clear_status_and_others_keep_working(
    aggregator: Aggregator,
    channel: grpc.aio.Channel,
    messages: list[pb.AgentMessage],
    code: grpc.StatusCode,
    detail: str,
) -> None:
    good = await open_stream(channel, name="good-pod")
    await good.write(report(pb.SERVE_STATE_SERVING, 1))
    assert (await good.read()).ack.sequence == 1

    bad = pb_grpc.ReportServiceStub(channel).Report()
    for message in messages:
        try:
            await bad.write(message)
        except grpc.aio.AioRpcError:
            break  # the server may already have ended the stream
    error = await read_until_error(bad)  # settings may come first; the error after it
    assert error.code() is code
    assert detail in (error.details() or "")

    # The good stream is untouched, and the server is still SERVING.
    await good.write(report(pb.SERVE_STATE_DRAINING, 2))
    assert (await good.read()).ack.sequence == 2
    summary = await pb_grpc.InspectionServiceStub(channel).GetSummary(
        pb.GetSummaryRequest(), timeout=5
    )
    assert summary.pods_by_state["SERVE_STATE_DRAINING"] == 1
    assert summary.agents_connected == 1
    good.cancel()
