"""Thousands of half-open connections against an aggregator *process* (bench/halfopen.py: TCP
connections that say nothing, half an HTTP/2 preface, half a SETTINGS frame, an HTTP/2
connection gone deaf, a Report stream gone deaf after its hello or half a message): health
stays SERVING, a well-behaved agent's reports are acked and its pod's transitions show through
InspectionService, the process's RSS stays bounded and does not keep growing flood after
flood, --max-streams-per-peer holds per source address, and the server's own deadlines
(--handshake-timeout, --keepalive-time/--keepalive-timeout, --max-connection-idle) close
every kind of stalled connection. Everything runs on 127.0.0.0/8."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import halfopen, procstat
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import eventually
from testsupport import harness
from testsupport.messages import hello, report

#: Connections of each kind in a flood: 6 kinds x 500 = 3,000 at once.
PER_KIND = 500
#: Source addresses (127.0.0.2 ...) of a flood: its 1,000 Report streams stay under
#: --max-streams-per-peer (64) per address, so each one is held.
FLOOD_ADDRESSES = halfopen.sources(40)
#: RSS the floods may add to the aggregator process. Measured (bench/flood.py, per
#: connection): silent 12.8, preface 17.0, settings 17.0, idle 16.5, hello 43-45, partial 42
#: KiB, so a flood of 500 of each adds ~73 MiB. Closed floods leave their memory to the
#: allocator, which reuses it but not perfectly: over 25 floods RSS peaked at +174 MiB (2.4 x
#: one flood; +94 to +132 MiB by the fourth), then fell back to +42. A flood that kept all of
#: its memory would pass this bound at the third flood (3 x 73 MiB).
RSS_BOUND = 192 * 2**20
FLOODS = 4
#: Deadlines that do not fire while a flood is held (the test of reaping shortens them).
PATIENT = ("--handshake-timeout", "60s", "--keepalive-time", "60s", "--keepalive-timeout", "60s")
SERVING = pb.SERVE_STATE_SERVING
NOT_READY = pb.SERVE_STATE_NOT_READY


@pytest.fixture(autouse=True)
def _enough_file_descriptors() -> None:
    # Not a skip: without thousands of descriptors the flood cannot be held, and the test
    # must say so rather than pass unrun.
    procstat.raise_fd_limit(len(halfopen.KINDS) * PER_KIND + 1_000)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., harness.AggregatorProcess]]:
    """``spawn(*flags)``: ``python -m aggregator`` (memory backend, --ack-every 1) on a free
    port; stopped at teardown."""
    started: list[harness.AggregatorProcess] = []

    def start(*flags: str) -> harness.AggregatorProcess:
        process = harness.start_aggregator(
            tmp_path / f"aggregator-{len(started)}", extra_args=["--ack-every", "1", *flags]
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@dataclass
class Agent:
    """A well-behaved sidecar agent (from 127.0.0.1) and an inspection client."""

    address: str
    call: grpc.aio.StreamStreamCall
    inspection: pb_grpc.InspectionServiceStub
    sequence: int = 0

    async def report(self, state: int) -> None:
        self.sequence += 1
        await self.call.write(report(state, self.sequence))
        reply = await asyncio.wait_for(self.call.read(), timeout=10)
        assert reply.ack.sequence == self.sequence, reply

    async def state(self) -> int:
        pod = await self.inspection.GetPod(
            pb.GetPodRequest(namespace="default", name="good-pod"), timeout=10
        )
        return pod.state

    async def check_reports(self) -> None:
        """Reports are acked and change the pod (NOT_READY, then SERVING after the success
        threshold of 2), as InspectionService shows."""
        await self.report(NOT_READY)
        assert await self.state() == NOT_READY
        await self.report(SERVING)
        await self.report(SERVING)
        assert await self.state() == SERVING

    async def check(self) -> None:
        """:meth:`check_reports`, and a new connection's health check answers SERVING."""
        await self.check_reports()
        assert (
            await health_on_new_connection(self.address) == health_pb2.HealthCheckResponse.SERVING
        )

    async def streams(self) -> int:
        summary = await self.inspection.GetSummary(pb.GetSummaryRequest(), timeout=10)
        return summary.agents_connected


async def health_on_new_connection(address: str, within: float = 10) -> int:
    # A channel of its own subchannel pool: a new TCP connection, not the agent's.
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.use_local_subchannel_pool", 1)]
    ) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="servehealth.v1.ReportService"),
            timeout=within,
        )
    return answer.status


async def serving_on_new_connection(address: str) -> bool:
    try:
        status = await health_on_new_connection(address, within=2)
    except grpc.aio.AioRpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


Connect = Callable[[harness.AggregatorProcess], Awaitable[Agent]]
Spawn = Callable[..., harness.AggregatorProcess]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """``await connect(aggregator)``: a good agent that passed its first :meth:`Agent.check`."""
    channels: list[grpc.aio.Channel] = []
    calls: list[grpc.aio.StreamStreamCall] = []

    async def open_agent(aggregator: harness.AggregatorProcess) -> Agent:
        channel = grpc.aio.insecure_channel(aggregator.address)
        channels.append(channel)
        call = pb_grpc.ReportServiceStub(channel).Report()
        calls.append(call)
        await call.write(hello(name="good-pod"))
        assert (await call.read()).WhichOneof("kind") == "settings"
        agent = Agent(aggregator.address, call, pb_grpc.InspectionServiceStub(channel))
        await agent.check()
        return agent

    yield open_agent
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()


def fds(aggregator: harness.AggregatorProcess) -> int:
    return procstat.open_fds(aggregator.pid)


async def flood_of_every_kind(
    aggregator: harness.AggregatorProcess, agent: Agent
) -> list[halfopen.Flood]:
    """PER_KIND connections of each kind, the agent checked after each kind."""
    floods = []
    for kind in halfopen.KINDS:
        flood = halfopen.Flood(harness.HOST, aggregator.port)
        floods.append(flood)
        await flood.open(kind, PER_KIND, FLOOD_ADDRESSES)
        assert not flood.failures, flood.failures[:3]
        await agent.check()
    return floods


async def test_floods_of_half_open_connections(spawn: Spawn, connect: Connect) -> None:
    """Floods of 3,000, each held while the agent works, then closed (FIN or RST): memory
    stays under RSS_BOUND flood after flood."""
    aggregator = spawn(*PATIENT)
    agent = await connect(aggregator)
    fds_before, rss_before = fds(aggregator), procstat.rss_bytes(aggregator.pid)
    peaks = []
    for round_ in range(FLOODS):
        floods = await flood_of_every_kind(aggregator, agent)
        total = sum(len(flood) for flood in floods)
        # Held, every one: the server accepted them and closed none (the slack: a health
        # check's connection may have been open when fds_before was counted).
        assert fds(aggregator) >= fds_before + total - 2
        assert sum(halfopen.count_closed(flood.sockets) for flood in floods) == 0
        # The good agent and every "hello" (the server may still be taking them in).
        await eventually(lambda: count_streams(agent, 1 + PER_KIND), timeout=20)
        peaks.append(procstat.rss_bytes(aggregator.pid) - rss_before)
        assert peaks[-1] < RSS_BOUND, f"flood {round_ + 1}: +{peaks[-1] / 2**20:.0f} MiB"
        for i, flood in enumerate(floods):  # half end with a FIN, half with an RST
            flood.close(reset=bool((i + round_) % 2))
        await eventually(lambda: fds(aggregator) <= fds_before, timeout=20)
        await eventually(lambda: count_streams(agent, 1), timeout=10)
        await agent.check()
    print(
        f"\nconnection flood ({len(halfopen.KINDS)} kinds x {PER_KIND}, aggregator process): "
        f"RSS {rss_before / 2**20:.0f} MiB before, peaks "
        + ", ".join(f"+{peak / 2**20:.0f}" for peak in peaks)
        + " MiB"
    )


async def test_per_peer_stream_limit_under_a_flood(spawn: Spawn, connect: Connect) -> None:
    """64 stalled streams from one address are held, 16 more are ended at once; another
    address and the good agent (127.0.0.1) are unaffected."""
    aggregator = spawn(*PATIENT)
    agent = await connect(aggregator)
    one, other = halfopen.sources(2, skip=100)
    crowd = halfopen.Flood(harness.HOST, aggregator.port)
    single = halfopen.Flood(harness.HOST, aggregator.port)
    try:
        await crowd.open("hello", 64 + 16, [one])
        assert not crowd.failures, crowd.failures[:3]
        await eventually(lambda: rejected(aggregator) == 16, timeout=10)
        assert await agent.streams() == 1 + 64
        await single.open("hello", 1, [other])
        await eventually(lambda: count_streams(agent, 1 + 64 + 1), timeout=10)
        assert rejected(aggregator) == 16
        await agent.check()
        # The rejected streams' connections stay open (an idle HTTP/2 connection each).
        assert halfopen.count_closed(crowd.sockets) == 0
    finally:
        crowd.close(reset=True)
        single.close(reset=True)
    await eventually(lambda: count_streams(agent, 1), timeout=10)


async def count_streams(agent: Agent, expected: int) -> bool:
    return await agent.streams() == expected


def rejected(aggregator: harness.AggregatorProcess) -> int:
    status, body = harness.http_get(f"http://{harness.HOST}:{aggregator.metrics_port}/metrics")
    assert status == 200, body
    sample = 'serve_health_streams_rejected_total{code="RESOURCE_EXHAUSTED"}'
    for line in body.splitlines():
        if line.startswith(sample):
            return int(float(line.split()[-1]))
    return 0


async def test_max_connections_caps_a_flood(spawn: Spawn, connect: Connect) -> None:
    """--max-connections 200: a flood gets the connections left and no more; the agent keeps
    reporting on its own; new connections are refused until the flood is gone."""
    aggregator = spawn(*PATIENT, "--max-connections", "200")
    agent = await connect(aggregator)
    flood = halfopen.Flood(harness.HOST, aggregator.port)
    try:
        await flood.open("silent", 600, FLOOD_ADDRESSES)
        assert not flood.failures, flood.failures[:3]  # accepted by the kernel, then closed
        await eventually(lambda: halfopen.count_closed(flood.sockets) >= 400, timeout=10)
        held = len(flood) - halfopen.count_closed(flood.sockets)
        assert 190 <= held < 200  # the agent holds one of the 200
        await agent.check_reports()
        assert not await serving_on_new_connection(aggregator.address)
    finally:
        flood.close(reset=True)
    await eventually(lambda: serving_on_new_connection(aggregator.address), timeout=10)
    await agent.check()


async def test_the_server_reaps_stalled_connections(spawn: Spawn, connect: Connect) -> None:
    """Short deadlines: every kind is closed by the server itself (handshake timeout; an
    unanswered ping), and idle but polite gRPC channels get a GOAWAY; the agent stays."""
    aggregator = spawn(
        "--handshake-timeout",
        "1s",
        "--keepalive-time",
        "1s",
        "--keepalive-timeout",
        "2s",
        "--max-connection-idle",
        "2s",
    )
    agent = await connect(aggregator)
    fds_before = fds(aggregator)
    floods = await flood_of_every_kind(aggregator, agent)
    polite = [
        grpc.aio.insecure_channel(
            aggregator.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(50)
    ]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(channel.channel_ready() for channel in polite)), timeout=10
        )
        for flood in floods:
            await eventually(
                lambda flood=flood: halfopen.count_closed(flood.sockets) == len(flood), timeout=15
            )
        # A GOAWAY for no call in --max-connection-idle: the channel goes back to IDLE.
        await eventually(
            lambda: all(channel.get_state() is grpc.ChannelConnectivity.IDLE for channel in polite),
            timeout=15,
        )
        await eventually(lambda: fds(aggregator) <= fds_before, timeout=15)
        assert await agent.streams() == 1
        await agent.check()  # pinged every second, and it answered: still connected
    finally:
        for flood in floods:
            flood.close()
        await asyncio.gather(*(channel.close() for channel in polite))
