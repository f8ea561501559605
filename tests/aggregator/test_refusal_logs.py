"""The aggregator logs a refused Report stream once per client address and kind of refusal,
later ones at debug level (issue 13, point 7): an agent refused at every reconnection (a bad
pod name, say) must not fill the log. ``aggregator.guard`` does the same for token refusals.

- ``LoggedOnce``, the LRU of what was logged (pure);
- an in-process aggregator: refusals of one kind from one client, then of another kind;
- the real ``python -m aggregator``: one WARNING line for any number of refused streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys

import grpc
import pytest

from aggregator.ingest.call_bookkeeping import LoggedOnce
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator
from testsupport.messages import hello, read_until_error

LOGGER = "aggregator.ingest.report_service"
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


async def refused(channel: grpc.aio.Channel, *messages: object) -> grpc.aio.AioRpcError:
    """A Report stream that sends ``messages`` and is ended by the aggregator; its error."""
    call = pb_grpc.ReportServiceStub(channel).Report()
    for message in messages:
        await call.write(message)
    return await asyncio.wait_for(read_until_error(call), 10)


def rejections(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == level and "rejecting report stream" in r.getMessage()
    ]


def test_logged_once_remembers_the_most_recent_keys() -> None:
    logged = LoggedOnce(size=2)
    assert logged.first("a")
    assert not logged.first("a")
    assert logged.first("b")
    assert not logged.first("a")  # "a" is now the most recent, "b" the oldest
    assert logged.first("c")  # evicts "b"
    assert not logged.first("a")
    assert logged.first("b")


async def test_refusals_are_logged_once_per_client_and_kind(
    start_aggregator: StartAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    aggregator = await start_aggregator(hello_timeout=0.05)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        for _ in range(5):
            error = await refused(channel, hello(name="p-sigINT"))
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(3):  # another kind: no hello within --hello-timeout
            error = await refused(channel)
            assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    warnings = rejections(caplog, logging.WARNING)
    assert len(warnings) == 2, warnings
    assert "INVALID_ARGUMENT: hello.pod.name 'p-sigINT' is not a valid pod name" in warnings[0]
    assert "logged once per client address and kind" in warnings[0]
    assert "DEADLINE_EXCEEDED: no hello within" in warnings[1]
    assert len(rejections(caplog, logging.DEBUG)) == 4 + 2
    # Counted every time all the same.
    for code, count in (("INVALID_ARGUMENT", 5), ("DEADLINE_EXCEEDED", 3)):
        sample = aggregator.metrics.registry.get_sample_value(
            "serve_health_streams_rejected_total", {"code": code}
        )
        assert sample == count


async def test_an_aggregator_process_logs_one_warning_for_a_refused_agent() -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aggregator",
        "--kube-backend=memory",
        "--auth=none",
        "--listen=127.0.0.1:0",
        "--metrics-listen=",
        "--log-level=debug",
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[str] = []

    async def line_where(pattern: str) -> str:
        assert process.stderr is not None
        async with asyncio.timeout(15):
            while True:
                line = (await process.stderr.readline()).decode()
                assert line, f"aggregator exited:\n{''.join(lines)}"
                lines.append(line)
                if re.search(pattern, line):
                    return line

    try:
        match = LISTENING.search(await line_where(LISTENING.pattern))
        assert match is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{match.group(1)}") as channel:
            for attempt in range(10):
                error = await refused(channel, hello(name="p-sigINT"))
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
                # Each refusal is a line (the first a warning, then debug): wait for it.
                await line_where(rf"(WARNING|DEBUG) {LOGGER}: rejecting report stream")
                assert attempt or " WARNING " in lines[-1]
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            rest = (await process.stderr.read()).decode()
            await process.wait()
        lines.extend(rest.splitlines(keepends=True))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, "".join(lines)
    mine = [line for line in lines if f" {LOGGER}: " in line]
    loud = [line for line in mine if " DEBUG " not in line]
    assert len(loud) == 1, "".join(loud)
    assert "INVALID_ARGUMENT: hello.pod.name 'p-sigINT' is not a valid pod name" in loud[0]
    assert sum("rejecting report stream" in line for line in mine) == 10
