"""Building servehealth.v1 messages and raw Report streams in tests."""

from __future__ import annotations

from typing import Any

import grpc

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc


def hello(namespace: str = "default", name: str = "pod-a", **fields: Any) -> pb.AgentMessage:
    values: dict[str, Any] = {
        "mode": pb.AGENT_MODE_SIDECAR,
        "pod": pb.PodRef(namespace=namespace, name=name, uid=f"uid-{name}"),
        "node_name": "node-1",
        "agent_version": "test",
        **fields,
    }
    return pb.AgentMessage(hello=pb.Hello(**values))


def report(state: int, sequence: int, reason: str = "", **fields: Any) -> pb.AgentMessage:
    return pod_report(state=state, reason=reason, sequence=sequence, **fields)


def pod_report(**fields: Any) -> pb.AgentMessage:
    return pb.AgentMessage(reports=pb.ReportBatch(reports=[pb.PodReport(**fields)]))


async def open_stream(channel: grpc.aio.Channel, name: str = "pod-a") -> grpc.aio.StreamStreamCall:
    """A Report stream that has said hello and received its settings."""
    call = pb_grpc.ReportServiceStub(channel).Report()
    await call.write(hello(name=name))
    first = await call.read()
    assert first.WhichOneof("kind") == "settings"
    return call


async def read_until_error(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """Read (settings, acks) until the server ends the stream with an error; return it."""
    while True:
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as error:
            return error
        if message is grpc.aio.EOF:
            raise AssertionError("stream ended without an error")
