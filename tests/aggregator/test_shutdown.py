"""Shutdown and inspection corners found by the hostile-input trial (issue 13, point 8):

- SIGTERM with a raw Report stream that never said hello (a client that also never answers the
  server's PINGs): the stream ends at once with UNAVAILABLE and the process exits at once, not
  after --shutdown-grace (a real process; the grace is a minute, longer than the test waits
  for the exit, so that only waiting it out fails, not a slow machine);
- WatchTransitions ends with UNAVAILABLE on shutdown, not OK, so that a client can tell a
  shutdown from the end of a feed;
- ListPods with a state number that is no pod state answers INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.server import Aggregator
from bench import halfopen
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from tests.conftest import StartAggregator, eventually

LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
_HEADERS, _RST_STREAM, _PING = 0x1, 0x3, 0x6
_END_STREAM, _ACK = 0x1, 0x1
PING_DATA = b"hostile!"
#: The aggregator's --shutdown-grace in the SIGTERM test: longer than the test waits for the
#: exit (EXIT_WAIT), so that an exit that waited for the grace fails the test.
SHUTDOWN_GRACE = 60.0
EXIT_WAIT = 30.0


class RawFrames:
    """HTTP/2 frames read from a raw socket (never answered: no PING is acked)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.closed = False

    async def next(self) -> tuple[int, int, int, bytes] | None:
        """(type, flags, stream, payload) of the next frame; None once the server closed."""
        loop = asyncio.get_running_loop()
        while len(self.buffer) < 9 or len(self.buffer) < 9 + int.from_bytes(self.buffer[:3]):
            chunk = await loop.sock_recv(self.sock, 65536)
            if not chunk:
                self.closed = True
                return None
            self.buffer += chunk
        length = int.from_bytes(self.buffer[:3])
        kind, flags = self.buffer[3], self.buffer[4]
        stream = int.from_bytes(self.buffer[5:9]) & 0x7FFFFFFF
        payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
        return kind, flags, stream, payload


async def start_process(*flags: str) -> tuple[asyncio.subprocess.Process, int]:
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
    assert process.stderr is not None
    async with asyncio.timeout(30):
        while not (match := LISTENING.search((await process.stderr.readline()).decode())):
            assert process.returncode is None
    port = int(match.group(1))
    # An answer from a servicer (Python, on the event loop) means the loop ran past startup, so
    # the SIGTERM handler is set (gRPC's own threads answer a PING before that).
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return process, port


async def refused_stream(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    call = pb_grpc.ReportServiceStub(channel).Report()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), 10)
    return caught.value


@pytest.mark.parametrize("sent", ["nothing", "half a hello"])
async def test_sigterm_with_a_hello_less_raw_stream_exits_at_once(sent: str) -> None:
    process, port = await start_process(
        f"--shutdown-grace={SHUTDOWN_GRACE:g}s", "--max-streams-per-peer=1"
    )
    loop = asyncio.get_running_loop()
    sock = await halfopen.open_one("idle", "127.0.0.1", port, "127.0.0.1")
    try:
        # Open a Report stream and say no hello (or half of one); then a PING: its ack comes
        # after the server has read everything before it, the stream included.
        opening = halfopen.report_headers(f"127.0.0.1:{port}")
        if sent == "half a hello":
            message = halfopen.grpc_message(halfopen.node_hello("raw"))
            opening += halfopen.frame(0x0, 0, 1, message[: len(message) // 2])
        await loop.sock_sendall(sock, opening + halfopen.frame(_PING, 0, 0, PING_DATA))
        frames = RawFrames(sock)
        async with asyncio.timeout(10):
            while (frame := await frames.next()) != (_PING, _ACK, 0, PING_DATA):
                assert frame is not None, "the server closed the connection"
        # The aggregator serves the raw stream (not just gRPC's core, which answered the PING):
        # it holds the one stream this address may have, so the next one is refused.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            error = await refused_stream(channel)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

        sent_at = loop.time()
        process.send_signal(signal.SIGTERM)
        exit_code = await asyncio.wait_for(process.wait(), EXIT_WAIT)
        took = loop.time() - sent_at
        ends = []
        async with asyncio.timeout(10):
            while (frame := await frames.next()) is not None:
                kind, flags, stream, payload = frame
                if stream == 1 and kind == _HEADERS and flags & _END_STREAM:
                    ends.append(payload)
    finally:
        sock.close()
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert exit_code == 0
    # --shutdown-grace is for inspection calls in flight; there are none, and a client that
    # never acks the server's GOAWAY PING must not hold the exit for the whole grace (then the
    # wait above would have failed: the grace is longer). How long it took is a figure.
    print(f"SIGTERM to exit: {took:.2f}s")
    assert took < SHUTDOWN_GRACE
    (trailers,) = ends
    assert b"grpc-status\x0214" in trailers  # UNAVAILABLE
    assert b"aggregator is shutting down; reconnect" in trailers


async def drain(call: grpc.aio.UnaryStreamCall) -> None:
    """Read ``call`` to its end (an error raises)."""
    async for _ in call:
        pass


async def test_watch_transitions_ends_with_unavailable_on_shutdown(
    start_aggregator: StartAggregator,
) -> None:
    aggregator: Aggregator = await start_aggregator()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        watch = pb_grpc.InspectionServiceStub(channel).WatchTransitions(
            pb.WatchTransitionsRequest()
        )
        await eventually(
            lambda: (
                aggregator.metrics.registry.get_sample_value("serve_health_transition_watchers")
                == 1
            )
        )
        await aggregator.stop()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(drain(watch), 10)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert caught.value.details() == "aggregator is shutting down; reconnect"


@pytest.mark.parametrize(
    ("state", "named"), [(99, "99"), (-1, "-1"), (0, "SERVE_STATE_UNSPECIFIED")]
)
async def test_list_pods_with_an_unknown_state_is_invalid_argument(
    inspection: pb_grpc.InspectionServiceStub, state: int, named: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inspection.ListPods(
            pb.ListPodsRequest(states=[pb.SERVE_STATE_SERVING, state]), timeout=5
        )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert f"states: {named} is not a pod state" in details
    assert "SERVE_STATE_SERVING" in details  # the states there are
    # Known states still filter.
    answer = await inspection.ListPods(
        pb.ListPodsRequest(states=[pb.SERVE_STATE_SERVING, pb.SERVE_STATE_UNKNOWN]), timeout=5
    )
    assert list(answer.pods) == []
