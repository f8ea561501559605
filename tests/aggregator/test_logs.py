"""Logs (``servehealth_common.logs``, ``--log-format``): text lines for people, one JSON object
per line for log pipelines.

- The JSON formatter: time, level, logger, message; fields given with ``extra=``; tracebacks.
- ``python -m aggregator --log-format json`` as a real process: every stderr line is JSON, and
  a transition driven over gRPC is one line carrying pod, old, new, source, reason and label as
  fields of their own. The same process in text format keeps its one human line.
- Hostile reasons (issue 13): a raw client's reason with a line break, a CR and an escape
  sequence is one escaped line in the text log, never a record of its own; a 60 KB reason is
  logged cut to 256 bytes.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.logs import JsonFormatter, setup
from testsupport.messages import open_stream, report
from testsupport.processes import StderrLines

LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


# -- the formatter ------------------------------------------------------------------------


def record(message: str, *args: Any, **attributes: Any) -> logging.LogRecord:
    made = logging.LogRecord(
        "aggregator.decision.core", logging.INFO, __file__, 1, message, args, None
    )
    made.__dict__.update(attributes)
    return made


def test_json_line_has_time_level_logger_message_and_extra_fields() -> None:
    line = JsonFormatter().format(record("pod %s: %s", "ns/a", "up", pod="ns/a", new="SERVING"))
    assert "\n" not in line
    data = json.loads(line)
    assert data.pop("message") == "pod ns/a: up"
    assert data.pop("level") == "INFO"
    assert data.pop("logger") == "aggregator.decision.core"
    time = datetime.datetime.fromisoformat(data.pop("time"))
    assert time.utcoffset() == datetime.timedelta(0)
    assert data == {"pod": "ns/a", "new": "SERVING"}  # nothing else of the LogRecord


def test_json_line_carries_the_traceback_and_odd_values() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    made = record("failed", where=object(), path=None)
    made.exc_info = exc_info
    data = json.loads(JsonFormatter().format(made))
    assert data["message"] == "failed"
    assert data["exception"].startswith("Traceback")
    assert "ValueError: boom" in data["exception"]
    assert data["path"] is None
    assert data["where"].startswith("<object object")  # str() of what JSON cannot hold


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_setup_replaces_the_root_handler(log_format: str) -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        setup("warning", log_format, stream)
        assert len(root.handlers) == 1
        logging.getLogger("node_agent").info("hidden")
        logging.getLogger("node_agent").warning("shown %d", 1, extra={"pod": "ns/a"})
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    if log_format == "json":
        assert json.loads(line)["pod"] == "ns/a"
    else:
        assert line.endswith(" WARNING node_agent: shown 1")


def test_setup_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        setup("info", "yaml")


# -- the aggregator as a real process -------------------------------------------------------


@pytest.fixture
async def run_aggregator() -> AsyncIterator[Callable[..., Any]]:
    started: list[asyncio.subprocess.Process] = []

    async def start(*flags: str) -> tuple[StderrLines, int]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aggregator",
            "--kube-backend=memory",
            "--auth=none",
            "--listen=127.0.0.1:0",
            "--metrics-listen=",
            *flags,
            env=environ,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        started.append(process)
        wrapped = StderrLines(process)
        match = await wrapped.line_where(LISTENING.search)
        return wrapped, int(match.group(1))

    yield start
    for process in started:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def drive_one_transition(port: int) -> None:
    """A sidecar stream for default/pod-a reporting SERVING: UNKNOWN -> SERVING."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = await open_stream(channel, "pod-a")
        await call.write(report(pb.SERVE_STATE_SERVING, 1, "success"))
        ack = await asyncio.wait_for(call.read(), 10)
        assert ack.ack.sequence == 1
        call.cancel()


def transition_fields(line: str) -> dict[str, Any] | None:
    data = json.loads(line)  # every line must be JSON, this one included
    return data if data.get("pod") == "default/pod-a" and "new" in data else None


async def test_json_logs_carry_the_transition_as_fields(
    run_aggregator: Callable[..., Any],
) -> None:
    process, port = await run_aggregator("--log-format", "json")
    await drive_one_transition(port)
    found = await process.line_where(transition_fields)
    assert {key: found[key] for key in ("pod", "old", "new", "source", "reason", "label")} == {
        "pod": "default/pod-a",
        "old": "UNKNOWN",
        "new": "SERVING",
        "source": "push",
        "reason": "success",
        "label": "true",
    }
    assert found["level"] == "INFO"
    assert found["logger"] == "aggregator.decision.core"
    assert found["message"] == (
        "pod default/pod-a: UNKNOWN -> SERVING (source push, label true): success"
    )
    datetime.datetime.fromisoformat(found["time"])

    rest = await process.stop()
    assert process.process.returncode == 0, rest
    lines = process.lines + rest.splitlines()
    parsed = [json.loads(line) for line in lines]
    assert all({"time", "level", "logger", "message"} <= data.keys() for data in parsed)
    assert parsed[-1]["message"] == "aggregator stopped"


async def test_text_logs_keep_one_line_per_transition(run_aggregator: Callable[..., Any]) -> None:
    process, port = await run_aggregator()  # the default: --log-format text
    await drive_one_transition(port)
    line = await process.line_where(
        lambda line: "pod default/pod-a: UNKNOWN -> SERVING" in line and line
    )
    assert line.rstrip().endswith(
        "INFO aggregator.decision.core: pod default/pod-a: UNKNOWN -> SERVING "
        "(source push, label true): "
        "success"
    )
    rest = await process.stop()
    assert process.process.returncode == 0, rest


FORGED_TAIL = "\n2026-12-01 10:00:00,000 INFO aggregator.core: FORGED LINE \x1b[31m\rX"
#: How the text format begins every record.
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


async def test_a_hostile_reason_cannot_forge_a_text_line(
    run_aggregator: Callable[..., Any],
) -> None:
    """A raw Report stream (no agent in between: nothing cut or cleaned on the way) sends
    reasons an agent never would; the transition lines carry them escaped and cut."""
    process, port = await run_aggregator()  # --log-format text
    reasons = {
        pb.SERVE_STATE_SERVING: "success" + FORGED_TAIL,
        pb.SERVE_STATE_UNHEALTHY: "z" * 60_000,  # fits the 64 KiB message limit
        pb.SERVE_STATE_NOT_READY: "🙂" * 256,  # 256 characters, 1,024 bytes
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = await open_stream(channel, "pod-a")
        for sequence, (state, reason) in enumerate(reasons.items(), start=1):
            await call.write(report(state, sequence, reason))
            assert (await asyncio.wait_for(call.read(), 10)).ack.sequence == sequence
        call.cancel()
    last = await process.line_where(lambda line: "-> NOT_READY" in line and line)
    rest = await process.stop()
    assert process.process.returncode == 0, rest
    output = "".join(process.lines) + rest
    assert "\x1b" not in output
    assert "\r" not in output
    lines = output.split("\n")
    assert lines.pop() == ""
    for line in lines:  # every line is a record of its own: no forged one, no continuation
        assert RECORD_START.match(line), line
    forged = [line for line in lines if "FORGED LINE" in line]
    assert len(forged) == 1
    assert forged[0].endswith(
        "INFO aggregator.decision.core: pod default/pod-a: UNKNOWN -> SERVING "
        "(source push, label true): "
        "success\\n2026-12-01 10:00:00,000 INFO aggregator.core: FORGED LINE \\x1b[31m\\rX"
    )
    (huge,) = [line for line in lines if "-> UNHEALTHY" in line]
    logged = huge.split("(source push, label false): ", 1)[1]
    assert logged == "z" * 253 + "..."
    logged = last.rstrip("\n").split("(source push, label false): ", 1)[1]
    assert len(logged.encode()) <= 256
    assert logged == "🙂" * 63 + "..."
