"""An agent given several aggregator addresses (``--aggregator A,B``: replicas without a Service
in front): it tries them in turn, moves on at once from a dead address or a standby (which
refuses streams with UNAVAILABLE), backs off only after a whole round failed, and follows the
leader when it goes away. Real gRPC servers on 127.0.0.1, a real fake proxy, real time but no
waiting for backoffs. "At once" is read from what the agent did, not from a stopwatch: no
backoff was logged ("reconnecting in"), and a standby was asked once; a wait for the dead
address's connect timeout (made longer than any wait here) would fail the test."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from aggregator.ingest.report_service import STANDBY_MESSAGE
from aggregator.server import Aggregator
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, make_session
from tests.conftest import StartAggregator, eventually, running
from testsupport.fakes import FakeServeProxy, refused_port

IDENTITY = SidecarPod("ns", "pod-a", "uid-1", "node-1")
KEY = PodKey("ns", "pod-a")
#: How long a test waits for the agent: only a hang (or a wait for CONNECT_TIMEOUT) takes this.
WAIT = 30.0
#: Longer than WAIT: an agent that waited for a dead address's connect timeout fails the test.
CONNECT_TIMEOUT = 60.0
#: What the stream logs (debug) before each backoff.
BACKOFF = "reconnecting in"


class Standby(pb_grpc.ReportServiceServicer):
    """Refuses every Report stream as a standby aggregator does, and counts them."""

    def __init__(self) -> None:
        self.streams = 0

    async def Report(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.streams += 1
        await context.read()  # the hello first, as the aggregator does (ReportService._hello_sent)
        await context.abort(grpc.StatusCode.UNAVAILABLE, STANDBY_MESSAGE)


@pytest.fixture
async def standby() -> AsyncIterator[tuple[Standby, int]]:
    servicer = Standby()
    server = grpc.aio.server()
    pb_grpc.add_ReportServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, port
    await server.stop(0)


@contextlib.asynccontextmanager
async def agent_for(proxy: FakeServeProxy, aggregator: str) -> AsyncIterator[Agent]:
    async with make_session() as session:
        settings = AgentFlags(
            aggregator=aggregator,
            proxy_url=proxy.url,
            token_file="",
            connect_timeout=CONNECT_TIMEOUT,
            reconnect_max=30.0,
        )
        agent = Agent(settings, IDENTITY, Prober(session, settings.probe_timeout))
        async with running(agent):
            yield agent


def test_the_addresses_are_split_at_commas() -> None:
    settings = AgentFlags(aggregator="127.0.0.1:1, 127.0.0.2:2")
    assert settings.aggregators == ("127.0.0.1:1", "127.0.0.2:2")
    assert AgentFlags(aggregator="agg:50051").aggregators == ("agg:50051",)
    with pytest.raises(ValueError, match="empty address"):
        AgentFlags(aggregator="127.0.0.1:1,,127.0.0.2:2")


def backoffs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The backoffs the agent's stream logged ("reconnecting in 0.13s")."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "node_agent.stream" and record.getMessage().startswith(BACKOFF)
    ]


async def test_a_dead_address_and_a_standby_are_skipped_at_once(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    standby: tuple[Standby, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent.stream")
    servicer, standby_port = standby
    leader = await start_aggregator()
    addresses = f"127.0.0.1:{refused_port()},127.0.0.1:{standby_port},127.0.0.1:{leader.port}"
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with agent_for(fake_proxy, addresses) as agent:
        # Not the dead address's connect timeout (longer than this wait).
        await asyncio.wait_for(agent.stream.connected.wait(), WAIT)
        took = loop.time() - started
        assert agent.stream.address == f"127.0.0.1:{leader.port}"
        # One round: the standby was asked once, and no backoff came before the leader.
        assert servicer.streams == 1
        assert backoffs(caplog) == []
        print(f"connected to the third address {took:.3f}s after the start")
        await eventually(lambda: leader.core.pod(KEY) is not None, WAIT)


async def test_the_agent_follows_the_leader_to_the_other_address(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent.stream")
    first: Aggregator = await start_aggregator()
    second: Aggregator = await start_aggregator()
    addresses = f"127.0.0.1:{first.port},127.0.0.1:{second.port}"
    async with agent_for(fake_proxy, addresses) as agent:
        await asyncio.wait_for(agent.stream.connected.wait(), WAIT)
        assert agent.stream.address == f"127.0.0.1:{first.port}"
        await eventually(lambda: first.core.agents_connected == 1, WAIT)
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await first.stop()  # drains: the stream ends with UNAVAILABLE
        await eventually(lambda: second.core.agents_connected == 1, WAIT)
        print(f"on the second address {loop.time() - stopped:.3f}s after the first stopped")
        # The next address at once: no backoff in between.
        assert backoffs(caplog) == []
        assert agent.stream.address == f"127.0.0.1:{second.port}"
        record = await eventually(lambda: second.core.pod(KEY), WAIT)
        assert record.agent is not None


async def test_a_whole_round_of_refusals_backs_off_then_retries(
    fake_proxy: FakeServeProxy, standby: tuple[Standby, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent.stream")
    servicer, port = standby
    addresses = f"127.0.0.1:{refused_port()},127.0.0.1:{port}"
    async with agent_for(fake_proxy, addresses) as agent:
        # Rounds keep coming (backoffs of at most 0.2 s, then 0.4 s, ...).
        await eventually(lambda: servicer.streams >= 3, WAIT)
        assert not agent.stream.connected.is_set()
        rounds, waits = servicer.streams, len(backoffs(caplog))  # read together: no await
    # Not in a busy loop: one backoff after each whole round (the dead address, then the
    # standby), none in between (the one after the last round may be logged already).
    assert rounds - 1 <= waits <= rounds
