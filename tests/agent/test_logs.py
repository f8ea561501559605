"""Hostile proxy answers in the text logs (issue 13, point 5), with real processes.

A Serve proxy (a :class:`FakeServeProxy`) answers 503 with ``This node is being drained.``
followed by a line that looks like a log record of its own, with an ANSI escape. The agent
(``python -m node_agent``) logs the probe's reason and reports it to an aggregator
(``python -m aggregator``), which logs it in its transition line. In both programs' stderr the
forged text stays inside its one escaped record, and the pod is DRAINING (the body's first line
decides), not NOT_READY.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from testsupport.fakes import FakeServeProxy
from testsupport.processes import StderrLines

DRAINED = "This node is being drained."
FORGED_TAIL = "\n2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \x1b[31m"
ESCAPED_TAIL = "\\n2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \\x1b[31m"
#: How the text format begins every record.
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
IDENTITY_ENV = {"POD_NAMESPACE": "ns", "POD_NAME": "pod-a", "POD_UID": "uid-1", "NODE_NAME": "n"}


class Program(StderrLines):
    async def stop(self) -> str:
        """SIGTERM; the exit must be 0. Returns the whole of stderr."""
        rest = await super().stop()
        output = "".join(self.lines) + rest
        assert self.process.returncode == 0, output
        return output


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[..., Any]]:
    started: list[asyncio.subprocess.Process] = []

    async def start(module: str, *flags: str, env: dict[str, str] | None = None) -> Program:
        environ = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("SERVE_HEALTH_") and key not in IDENTITY_ENV
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *flags,
            env={**environ, **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        started.append(process)
        return Program(process)

    yield start
    for process in started:
        if process.returncode is None:
            process.kill()
            await process.wait()


def records(output: str) -> list[str]:
    """The lines of a text log, each checked to begin a record of its own."""
    assert "\x1b" not in output
    lines = output.split("\n")
    assert lines.pop() == ""
    assert output.splitlines() == lines  # no \r, \x85, \u2028 ... either
    for line in lines:
        assert RECORD_START.match(line), line
    return lines


async def test_a_forged_503_body_stays_in_one_record_in_both_logs(
    spawn: Callable[..., Any], fake_proxy: FakeServeProxy
) -> None:
    fake_proxy.set((503, DRAINED + FORGED_TAIL))
    aggregator = await spawn(
        "aggregator",
        "--kube-backend=memory",
        "--auth=none",
        "--listen=127.0.0.1:0",
        "--metrics-listen=",
    )
    port = int((await aggregator.line_where(LISTENING.search)).group(1))
    agent = await spawn(
        "node_agent",
        f"--aggregator=127.0.0.1:{port}",
        f"--proxy-url={fake_proxy.url}",
        "--interval=500ms",
        "--probe-timeout=400ms",
        env=IDENTITY_ENV,
    )
    probed = await agent.line_where(lambda line: "(HTTP 503, " in line and line)
    transition = await aggregator.line_where(lambda line: "pod ns/pod-a: " in line and line)

    assert probed.rstrip("\n").endswith(
        f"INFO node_agent.probing: proxy {fake_proxy.url}: DRAINING (HTTP 503, {DRAINED}"
        f"{ESCAPED_TAIL})"
    )
    assert transition.rstrip("\n").endswith(
        "INFO aggregator.decision.core: pod ns/pod-a: UNKNOWN -> DRAINING "
        "(source push, label false): "
        f"{DRAINED}{ESCAPED_TAIL}"
    )
    for output, expected in ((await agent.stop(), probed), (await aggregator.stop(), transition)):
        forged = [line for line in records(output) if "FORGED LINE" in line]
        assert forged == [expected.rstrip("\n")]
