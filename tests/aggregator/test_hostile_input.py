"""Hostile input, property-based: random and truncated frames, huge strings, unknown fields and
enum values, a flood of idle connections. Each bad stream gets an error status of its own; the
aggregator stays SERVING, a good agent's reports keep flowing, and memory stays bounded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator
from testsupport.messages import batch, hello, node_hello, open_stream, pod_report, report

SERVING = pb.SERVE_STATE_SERVING
# Every example shares one aggregator and one good agent (that is the point: nothing a bad
# stream does may reach them), so hypothesis' per-example fixture warning does not apply.
EXAMPLES = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# Errors the aggregator chooses on purpose; INTERNAL or UNKNOWN would be a crash.
DELIBERATE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
HELLO = hello().SerializeToString()
REPORT = report(SERVING, 1).SerializeToString()
NODE_BATCH = batch([("default", "pod-b", SERVING), ("other", "pod-c", 2)], 7).SerializeToString()


@pytest.fixture
async def aggregator(start_aggregator: StartAggregator) -> Aggregator:
    # Examples come fast: lift the per-stream rate limit off the good agent.
    return await start_aggregator(max_reports_per_second=1_000_000)


@dataclass
class Good:
    """A well-behaved agent; ``check()`` proves it is still heard and the server SERVING."""

    call: grpc.aio.StreamStreamCall
    channel: grpc.aio.Channel
    sequence: int = 0

    async def check(self) -> None:
        self.sequence += 1
        await self.call.write(report(SERVING, self.sequence))
        assert (await self.call.read()).ack.sequence == self.sequence
        health = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="servehealth.v1.ReportService"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def good(channel: grpc.aio.Channel) -> AsyncIterator[Good]:
    agent = Good(await open_stream(channel, name="good-pod"), channel)
    yield agent
    agent.call.cancel()


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list[pb.AggregatorMessage]


async def send_raw(channel: grpc.aio.Channel, frames: Sequence[bytes]) -> Outcome:
    """Send ``frames`` as they are (no serialization) on a Report stream, half-close, and
    read everything the server answers until the status.

    Lockstep: the aggregator (ack_every=1) answers every message it accepts (settings or an
    ack), so the next frame is written only after that answer. A write racing the server's
    close would fail on the client, which then reports INTERNAL itself.
    """
    call = channel.stream_stream(
        "/servehealth.v1.ReportService/Report",
        request_serializer=lambda frame: frame,
        response_deserializer=pb.AggregatorMessage.FromString,
    )()
    replies: list[pb.AggregatorMessage] = []
    with contextlib.suppress(grpc.aio.AioRpcError):
        for frame in frames:
            await call.write(frame)
            reply = await call.read()
            if reply is grpc.aio.EOF:
                break
            replies.append(reply)
        else:
            await call.done_writing()
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
    return Outcome(await call.code(), await call.details() or "", replies)


def decodes(frame: bytes) -> bool:
    try:
        pb.AgentMessage.FromString(frame)
    except DecodeError:
        return False
    return True


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def unknown_field(draw: st.DrawFn) -> bytes:
    """One well-formed field whose number AgentMessage does not declare (1 and 2 it does)."""
    number = draw(st.integers(min_value=3, max_value=2**29 - 1))
    wire_type = draw(st.sampled_from([0, 1, 2, 5]))
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + varint(draw(st.integers(min_value=0, max_value=2**64 - 1)))
    if wire_type == 1:
        return key + draw(st.binary(min_size=8, max_size=8))
    if wire_type == 5:
        return key + draw(st.binary(min_size=4, max_size=4))
    payload = draw(st.binary(max_size=256))
    return key + varint(len(payload)) + payload


def huge(max_size: int = 30_000) -> st.SearchStrategy[str]:
    """A long ASCII string, built without drawing every character; ``max_size`` keeps a hello
    under the 64 KiB message limit even where the name is sent twice (the uid repeats it)."""
    return st.builds(
        lambda char, count: char * count,
        st.characters(codec="utf-8", max_codepoint=0x7F),
        st.integers(min_value=1_000, max_value=max_size),
    )


async def check_bad_stream(channel: grpc.aio.Channel, good: Good, frames: list[bytes]) -> None:
    outcome = await send_raw(channel, frames)
    assert outcome.code in DELIBERATE, outcome
    first_bad = next((i for i, frame in enumerate(frames) if not decodes(frame)), None)
    if first_bad is not None and all(
        pb.AgentMessage.FromString(f).WhichOneof("kind") == ("hello" if i == 0 else "reports")
        for i, f in enumerate(frames[:first_bad])
    ):  # a clean prefix, then bytes that are no AgentMessage
        assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert "could not be decoded as an AgentMessage" in outcome.details
    await good.check()


@EXAMPLES
@given(
    after_hello=st.booleans(),
    frames=st.lists(st.binary(max_size=2048), min_size=1, max_size=3),
)
async def test_random_bytes(
    channel: grpc.aio.Channel, good: Good, after_hello: bool, frames: list[bytes]
) -> None:
    await check_bad_stream(channel, good, [HELLO, *frames] if after_hello else frames)


@EXAMPLES
@given(data=st.data(), message=st.sampled_from(["hello", "report", "node-batch"]))
async def test_truncated_messages(
    channel: grpc.aio.Channel, good: Good, data: st.DataObject, message: str
) -> None:
    whole = {"hello": HELLO, "report": REPORT, "node-batch": NODE_BATCH}[message]
    cut = whole[: data.draw(st.integers(min_value=1, max_value=len(whole) - 1), label="cut")]
    if message == "hello":
        frames = [cut]
    elif message == "report":
        frames = [HELLO, cut]
    else:
        frames = [node_hello().SerializeToString(), cut]
    await check_bad_stream(channel, good, frames)


@EXAMPLES
@given(text=huge(), where=st.sampled_from(["name", "node", "version", "uid", "reason"]))
async def test_huge_strings(channel: grpc.aio.Channel, good: Good, text: str, where: str) -> None:
    fields = {"name": "name", "node": "node_name", "version": "agent_version", "uid": "uid"}
    if where == "reason":
        messages = [hello(name="huge-reason"), report(SERVING, 1, reason=text)]
    else:
        messages = [hello(**{fields[where]: text})]
    outcome = await send_raw(channel, [m.SerializeToString() for m in messages])
    if where == "name":  # not a valid pod name
        assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert "is not a valid pod name" in outcome.details
    else:  # accepted, and the stream ends when the agent half-closes
        assert outcome.code is grpc.StatusCode.OK, outcome
    assert len(outcome.details) < 1_000  # an error never echoes the whole string back
    await good.check()


@pytest.mark.parametrize(
    ("reason", "stored"),
    [
        pytest.param("z" * 60_000, "z" * 253 + "...", id="60KB-ascii"),
        # Few characters, many bytes: the cap is 256 bytes of UTF-8, not 256 characters.
        pytest.param("🙂" * 256, "🙂" * 63 + "...", id="256-chars-1024-bytes"),
        pytest.param("é" * 129, "é" * 126 + "...", id="129-chars-258-bytes"),
        pytest.param("a" * 256, "a" * 256, id="exactly-256-bytes"),
    ],
)
async def test_a_long_reason_is_stored_cut(
    aggregator: Aggregator, channel: grpc.aio.Channel, good: Good, reason: str, stored: str
) -> None:
    """A raw client's reason is cut to 256 bytes (as the agent cuts its own) before the core
    stores or logs it (issue 13)."""
    call = await open_stream(channel, name="long-reason")
    try:
        await call.write(report(SERVING, 1, reason=reason))
        assert (await call.read()).ack.sequence == 1
        pod = await pb_grpc.InspectionServiceStub(channel).GetPod(
            pb.GetPodRequest(namespace="default", name="long-reason"), timeout=5
        )
    finally:
        call.cancel()
    assert pod.reason == stored
    assert len(pod.reason.encode()) <= 256
    await good.check()


@EXAMPLES
@given(
    extra=st.lists(unknown_field(), min_size=1, max_size=4),
    state=st.sampled_from([1, 2, 3, 4, 5]),
)
async def test_unknown_fields_are_ignored(
    channel: grpc.aio.Channel, good: Good, extra: list[bytes], state: int
) -> None:
    tail = b"".join(extra)
    frames = [
        hello(name="unknown-fields").SerializeToString() + tail,
        report(state, 5).SerializeToString() + tail,
    ]
    outcome = await send_raw(channel, frames)
    assert outcome.code is grpc.StatusCode.OK, outcome
    kinds = [reply.WhichOneof("kind") for reply in outcome.replies]
    assert kinds == ["settings", "ack"]
    assert outcome.replies[1].ack.sequence == 5
    await good.check()


@EXAMPLES
@given(
    value=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    field=st.sampled_from(["mode", "state"]),
)
async def test_unknown_enum_values(
    channel: grpc.aio.Channel, good: Good, value: int, field: str
) -> None:
    if field == "mode":
        if value in pb.AgentMode.values():
            value = 2**31 - 1
        messages = [pb.AgentMessage(hello=pb.Hello(mode=value, node_name="n"))]
        detail = "hello.mode must be"
    else:
        if value in pb.ServeState.values():
            value = -1
        messages = [hello(name="odd-enum"), pod_report(state=value, sequence=1)]
        detail = "is not a state an agent may report"
    outcome = await send_raw(channel, [m.SerializeToString() for m in messages])
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert detail in outcome.details
    await good.check()


def rss_kib() -> int:
    """VmRSS of this process (the aggregator runs in it), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_a_connection_flood_does_not_stop_reports(
    aggregator: Aggregator, good: Good, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 idle gRPC channels (each its own connection) and 300 TCP connections that never
    say a word, held open while the good agent keeps reporting. (Thousands, of every kind of
    half-open connection, against an aggregator process: test_connection_flood.py.)"""
    address = f"127.0.0.1:{aggregator.port}"
    before = rss_kib()
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(300)
    ]
    sockets: list[asyncio.StreamWriter] = []
    try:
        await asyncio.wait_for(
            asyncio.gather(*(channel.channel_ready() for channel in channels)), timeout=20
        )
        for _ in range(300):
            sockets.append((await asyncio.open_connection("127.0.0.1", aggregator.port))[1])
        for _ in range(20):
            await good.check()
            await asyncio.sleep(0.05)
        during = rss_kib()
    finally:
        for writer in sockets:
            writer.close()
        await asyncio.gather(*(channel.close() for channel in channels))
    await good.check()
    with capsys.disabled():
        print(
            f"\nconnection flood (300 gRPC channels + 300 silent TCP, in-process): "
            f"RSS {before / 1024:.1f} MiB before, {during / 1024:.1f} MiB during "
            f"(+{(during - before) / 1024:.1f} MiB)"
        )
    assert during - before < 256 * 1024  # bounded: well under 1 MiB a connection
