"""The agent's reconnection loop is quiet and knows a permanent refusal (issue 13, point 7):

- ``AttemptLog`` (pure, fake clock): a failure condition is logged when it starts, when it
  changes and when it ends (with the number of attempts and how long), every attempt in between
  at debug level only (client-go's klog style), per aggregator address;
- a real ``ReportClient`` against a standby that refuses every stream, and against a port that
  refuses connections: one warning for any number of attempts;
- the stream that finally connects says how many attempts it took;
- an aggregator that refuses the hello with INVALID_ARGUMENT: one ERROR line, then a slow
  backoff (at least 10 s, up to minutes) instead of one attempt every 2 s for ever;
- the real ``python -m node_agent`` with no aggregator: one warning line, however many attempts.

Nothing here sleeps to show that something did not happen: each test waits for a number of
attempts to have been made (counted by the server, or by the agent's debug lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from aggregator.ingest.report_service import STANDBY_MESSAGE
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import REQUIRED, SidecarPod
from node_agent.stream import AttemptLog
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.probe import Prober, make_session
from tests.conftest import FakeClock, StartAggregator, eventually, running
from testsupport.fakes import FakeServeProxy, free_port, refused_port

IDENTITY = SidecarPod("ns", "pod-a", "uid-1", "node-1")
STREAM_LOGGER = "node_agent.stream"


class Standby(pb_grpc.ReportServiceServicer):
    """Refuses every Report stream as a standby aggregator does, and counts them."""

    def __init__(self) -> None:
        self.streams = 0

    async def Report(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.streams += 1
        # As the aggregator does (ReportService._hello_sent): the refusal after the hello has
        # arrived. A status sent while the client still writes its hello ends its call
        # INTERNAL "Internal error from Core" in gRPC's client, one time in hundreds.
        await context.read()
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


class Greatest(random.Random):
    """Every jitter at its upper bound: a backoff's delay is its ceiling (deterministic)."""

    def uniform(self, a: float, b: float) -> float:
        return b


@contextlib.asynccontextmanager
async def agent_for(
    proxy: FakeServeProxy,
    aggregator: str,
    identity: SidecarPod = IDENTITY,
    rng: random.Random | None = None,
    **overrides: float,
) -> AsyncIterator[Agent]:
    async with make_session() as session:
        settings = AgentFlags(
            aggregator=aggregator,
            proxy_url=proxy.url,
            token_file="",
            **{"reconnect_max": 0.01, "connect_timeout": 2.0, **overrides},
        )
        agent = Agent(settings, identity, Prober(session, settings.probe_timeout), rng=rng)
        async with running(agent):
            yield agent


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == STREAM_LOGGER and r.levelno == level
    ]


def delays(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The backoffs the agent chose, from its debug lines."""
    return [
        float(r.args[0])  # type: ignore[index]
        for r in caplog.records
        if r.name == STREAM_LOGGER and r.msg.startswith("reconnecting in")
    ]


# -- AttemptLog -----------------------------------------------------------------------------


def test_a_condition_is_logged_when_it_starts_changes_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="test.attempts")
    clock = FakeClock()
    attempts = AttemptLog(logging.getLogger("test.attempts"), clock)
    for _ in range(5):
        attempts.failed("agg:1", "could not connect")
        clock.advance(2)
    attempts.failed("agg:1", "UNAVAILABLE: a standby")
    clock.advance(1)
    attempts.failed("agg:1", "UNAVAILABLE: a standby")
    ended = attempts.connected("agg:1")

    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    warnings = [message for level, message in logged if level == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith("aggregator agg:1: could not connect; retrying with backoff")
    assert warnings[1].startswith(
        "aggregator agg:1: UNAVAILABLE: a standby (was: could not connect, 5 attempts in 10s)"
    )
    debug = [message for level, message in logged if level == logging.DEBUG]
    assert len(debug) == 5  # attempts 2-5 of the first condition, 2 of the second
    assert "attempt 5" in debug[3]
    assert ended == " after 7 failed attempts in 11s (last: UNAVAILABLE: a standby)"
    # Over: the next failure is a new condition again, and a clean connection says nothing.
    assert attempts.connected("agg:1") == ""
    attempts.failed("agg:1", "could not connect")
    assert caplog.records[-1].levelno == logging.WARNING


def test_each_address_has_its_own_condition(caplog: pytest.LogCaptureFixture) -> None:
    """Rounds over a dead address and a standby alternate two conditions: still one line each,
    not a change at every attempt."""
    caplog.set_level(logging.DEBUG, logger="test.attempts")
    attempts = AttemptLog(logging.getLogger("test.attempts"), FakeClock())
    for _ in range(10):
        attempts.failed("a:1", "could not connect")
        attempts.failed("b:1", "UNAVAILABLE: a standby")
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 2
    assert attempts.connected("a:1").startswith(" after 10 failed attempts")


def test_the_level_of_a_condition_is_its_own(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.attempts")
    attempts = AttemptLog(logging.getLogger("test.attempts"), FakeClock())
    attempts.failed("a:1", "refused", level=logging.ERROR, then="retrying in minutes")
    attempts.failed("a:1", "refused", level=logging.ERROR, then="retrying in minutes")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.DEBUG]
    assert "; retrying in minutes" in caplog.records[0].getMessage()


# -- a real ReportClient ---------------------------------------------------------------------


async def test_a_standby_refusing_every_attempt_is_one_warning(
    fake_proxy: FakeServeProxy,
    standby: tuple[Standby, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent")
    servicer, port = standby
    # A connect that takes over --connect-timeout on a loaded machine would be another
    # condition (a second warning): give it all the time a refusal needs.
    async with agent_for(fake_proxy, f"127.0.0.1:{port}", connect_timeout=30.0):
        await eventually(lambda: servicer.streams >= 10, timeout=30)
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert f"aggregator 127.0.0.1:{port}: UNAVAILABLE: {STANDBY_MESSAGE}" in warnings[0]
    assert not records(caplog, logging.INFO)  # no "reconnecting in" line per attempt
    assert len(records(caplog, logging.DEBUG)) >= 9


async def test_a_dead_address_is_one_warning(
    fake_proxy: FakeServeProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent")
    async with agent_for(fake_proxy, f"127.0.0.1:{refused_port()}"):
        await eventually(lambda: len(delays(caplog)) >= 10, timeout=20)
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "could not connect" in warnings[0]


async def test_the_stream_that_connects_says_how_many_attempts_it_took(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent")
    port = free_port()
    async with agent_for(fake_proxy, f"127.0.0.1:{port}") as agent:
        await eventually(lambda: len(delays(caplog)) >= 3, timeout=20)
        await start_aggregator(listen=f"127.0.0.1:{port}")
        await asyncio.wait_for(agent.stream.connected.wait(), 10)
    (connected,) = [m for m in records(caplog, logging.INFO) if m.startswith("connected to")]
    assert connected.startswith(f"connected to aggregator 127.0.0.1:{port} as ns/pod-a after ")
    assert "failed attempts in" in connected
    assert connected.endswith("(last: could not connect)")


async def test_an_invalid_hello_is_one_error_then_a_slow_backoff(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trial's agent with POD_NAME=p-sigINT (the agent now refuses that name at start, so
    the identity is built by hand here: an aggregator with rules of its own would do the same).
    """
    caplog.set_level(logging.DEBUG, logger="node_agent")
    aggregator = await start_aggregator()
    invalid = SidecarPod("ns", "p-sigINT", "uid-1", "node-1")
    async with agent_for(
        fake_proxy, f"127.0.0.1:{aggregator.port}", invalid, Greatest(), reconnect_max=2.0
    ):
        await eventually(lambda: delays(caplog), timeout=20)
    errors = records(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    assert "INVALID_ARGUMENT: hello.pod.name 'p-sigINT' is not a valid pod name" in errors[0]
    assert "minutes" in errors[0]
    assert not records(caplog, logging.WARNING)
    # The normal backoff's ceiling would be 0.2 s (then 0.4 s, ..., 2 s at most).
    assert delays(caplog) == [10.0]


# -- the agent as a real process -------------------------------------------------------------


async def test_a_process_without_its_aggregator_logs_one_warning(
    fake_proxy: FakeServeProxy,
) -> None:
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in REQUIRED and not key.startswith("SERVE_HEALTH_")
    }
    environ.update(POD_NAMESPACE="ns", POD_NAME="pod-a", POD_UID="uid-1", NODE_NAME="node-1")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_agent",
        "--aggregator",
        f"127.0.0.1:{refused_port()}",
        "--proxy-url",
        fake_proxy.url,
        "--token-file",
        "",
        "--reconnect-max",
        "20ms",
        "--log-level",
        "debug",
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        attempts = 0
        async with asyncio.timeout(30):
            while attempts < 15:
                line = (await process.stderr.readline()).decode()
                assert line, f"agent exited ({process.returncode}):\n{''.join(lines)}"
                lines.append(line)
                attempts += f"DEBUG {STREAM_LOGGER}: reconnecting in" in line
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, rest = await process.communicate()
        lines.extend(rest.decode().splitlines(keepends=True))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, "".join(lines)
    stream_lines = [line for line in lines if f" {STREAM_LOGGER}: " in line]
    loud = [line for line in stream_lines if " DEBUG " not in line]
    assert len(loud) == 1, "".join(loud)
    assert " WARNING " in loud[0]
    assert "could not connect" in loud[0]
