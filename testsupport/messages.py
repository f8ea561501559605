"""Building servehealth.v1 messages and raw Report streams in tests."""

from __future__ import annotations

from typing import Any

import grpc

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc


def hello(
    namespace: str = "default", name: str = "pod-a", uid: str | None = None, **fields: Any
) -> pb.AgentMessage:
    values: dict[str, Any] = {
        "mode": pb.AGENT_MODE_SIDECAR,
        "pod": pb.PodRef(namespace=namespace, name=name, uid=f"uid-{name}" if uid is None else uid),
        "node_name": "node-1",
        "agent_version": "test",
        **fields,
    }
    return pb.AgentMessage(hello=pb.Hello(**values))


def report(state: int, sequence: int, reason: str = "", **fields: Any) -> pb.AgentMessage:
    return pod_report(state=state, reason=reason, sequence=sequence, **fields)


def pod_report(**fields: Any) -> pb.AgentMessage:
    return pb.AgentMessage(reports=pb.ReportBatch(reports=[pb.PodReport(**fields)]))


class SidecarCall:
    """A sidecar's Report stream whose ``read`` passes over the PodView messages (kept in
    ``pod_views``) that an aggregator watching pods sends after the settings and whenever the
    pod changed: tests that read an ack after each report read acks. Everything else is the
    call's own. The views themselves: tests/kube/test_pod_view.py."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.pod_views: list[pb.PodView] = []

    async def read(self) -> Any:
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF or message.WhichOneof("kind") != "pod":
                return message
            self.pod_views.append(message.pod)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.call, name)


async def open_stream(
    channel: grpc.aio.Channel,
    name: str = "pod-a",
    namespace: str = "default",
    uid: str | None = None,
) -> SidecarCall:
    """A Report stream that has said hello and received its settings."""
    call = pb_grpc.ReportServiceStub(channel).Report()
    await call.write(hello(namespace, name, uid))
    first = await call.read()
    assert first.WhichOneof("kind") == "settings"
    return SidecarCall(call)


async def read_until_error(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """Read (settings, acks) until the server ends the stream with an error; return it."""
    while True:
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as error:
            return error
        if message is grpc.aio.EOF:
            raise AssertionError("stream ended without an error")


def node_hello(node_name: str = "node-1") -> pb.AgentMessage:
    """The hello of a DaemonSet agent: it reports for any pod on its node."""
    return pb.AgentMessage(
        hello=pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name=node_name, agent_version="test")
    )


def batch(reports: list[tuple[str, str, int]], sequence: int, reason: str = "") -> pb.AgentMessage:
    """One ReportBatch of (namespace, name, state) reports, all with ``sequence``."""
    return pb.AgentMessage(
        reports=pb.ReportBatch(
            reports=[
                pb.PodReport(
                    pod=pb.PodRef(namespace=namespace, name=name),
                    state=state,
                    reason=reason,
                    sequence=sequence,
                )
                for namespace, name, state in reports
            ]
        )
    )


async def open_node_stream(
    channel: grpc.aio.Channel, node_name: str = "node-1"
) -> grpc.aio.StreamStreamCall:
    """A DaemonSet-mode Report stream past its hello and settings."""
    call = pb_grpc.ReportServiceStub(channel).Report()
    await call.write(node_hello(node_name))
    first = await call.read()
    assert first.WhichOneof("kind") == "settings"
    return call
