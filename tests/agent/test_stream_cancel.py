"""A cancel (SIGTERM) always stops the agent's Report stream (issue 26, bug 1).

A real ``ReportClient`` against a real in-process aggregator; once the aggregator accepted the
stream, the reader is a stand-in whose end the test decides. The race that kept an agent
running after SIGTERM is made on purpose: the stream's task is cancelled in the same loop
iteration as its reader fails with the aggregator's UNAVAILABLE. On Python 3.11 the TaskGroup
the stream used raised the reader's error instead of the cancel (CPython gh-116720), and
``run()`` reconnected for ever. Nothing here sleeps: each test waits for the task to end or for
the aggregator to accept the stream again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from node_agent.flags import AgentFlags
from node_agent.outbox import Outbox
from node_agent.stream import ReportClient
from node_agent.stream_listener import StreamListener
from servehealth.v1 import servehealth_pb2 as pb
from tests.conftest import StartAggregator

GUARD = 10.0  # seconds; only a test that fails waits this long


class Accepts(StreamListener):
    """A ``StreamListener`` that keeps, for each accepted stream, the cancel requests then
    pending on the stream's task (``Task.cancelling()``)."""

    def __init__(self) -> None:
        self.cancelling: list[int] = []
        self.again = asyncio.Event()  # a second stream was accepted

    def accepted(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.cancelling.append(task.cancelling())
        if len(self.cancelling) > 1:
            self.again.set()


class Reader:
    """Stands in for ``ReportClient._read_forever``: each stream's reader waits for a future
    the test completes (an error, or a cancel as gRPC's when it cancels the call)."""

    def __init__(self) -> None:
        self.ends: list[asyncio.Future[None]] = []
        self.reading = asyncio.Event()

    async def __call__(self, call: object) -> None:
        end: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ends.append(end)
        self.reading.set()
        await end


def unavailable() -> grpc.aio.AioRpcError:
    """What the reader of a stream gets from an aggregator that stops."""
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, empty, empty, "shutting down")


@contextlib.asynccontextmanager
async def streaming(
    start_aggregator: StartAggregator, accepts: Accepts, reader: Reader
) -> AsyncIterator[asyncio.Task[None]]:
    """A ``ReportClient.run()`` task whose first stream is accepted and being read."""
    aggregator = await start_aggregator()
    address = f"127.0.0.1:{aggregator.port}"
    settings = AgentFlags(aggregator=address, mode="daemonset", reconnect_max=0.2)
    hello = pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name="node-1", agent_version="test")
    client = ReportClient(
        settings, hello, Outbox(), who="node node-1", rng=random.Random(1), listener=accepts
    )
    client._read_forever = reader  # type: ignore[method-assign]
    task = asyncio.create_task(client.run(), name="stream")
    try:
        async with asyncio.timeout(GUARD):
            await reader.reading.wait()
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def ended_or_accepted_again(task: asyncio.Task[None], accepts: Accepts) -> None:
    """Wait until the stream's task ends or a second stream is accepted (a reconnect)."""
    again = asyncio.create_task(accepts.again.wait())
    try:
        await asyncio.wait((task, again), timeout=GUARD, return_when=asyncio.FIRST_COMPLETED)
    finally:
        again.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await again


@pytest.mark.parametrize("cancel_first", [False, True], ids=["failure-first", "cancel-first"])
async def test_a_cancel_with_the_stream_s_end_in_the_same_iteration_stops_the_client(
    start_aggregator: StartAggregator, cancel_first: bool
) -> None:
    accepts, reader = Accepts(), Reader()
    async with streaming(start_aggregator, accepts, reader) as task:
        # One callback: the agent is cancelled and its reader fails with the aggregator's
        # UNAVAILABLE before the loop runs either (the aggregator stopped ~1 ms after SIGTERM).
        if cancel_first:
            task.cancel()
        reader.ends[0].set_exception(unavailable())
        if not cancel_first:
            task.cancel()
        await ended_or_accepted_again(task, accepts)
        assert task.cancelled(), "the client went on after its task was cancelled"
        assert len(accepts.cancelling) == 1  # it did not reconnect


@pytest.mark.parametrize("how", ["unavailable", "cancelled-by-grpc"])
async def test_a_stream_that_ends_by_itself_reconnects_with_no_cancel_left(
    start_aggregator: StartAggregator, how: str
) -> None:
    """Without a cancel of the agent, a stream's end is a reconnect, also when gRPC cancelled
    the reader under it (a TaskGroup ignored that reader and waited for the writer for ever);
    and no stream's end leaves a cancel request on the stream's task (a TaskGroup left one)."""
    accepts, reader = Accepts(), Reader()
    async with streaming(start_aggregator, accepts, reader) as task:
        if how == "unavailable":
            reader.ends[0].set_exception(unavailable())
        else:
            reader.ends[0].cancel()  # read() raises CancelledError; nobody cancelled the task
        await ended_or_accepted_again(task, accepts)
        assert not task.done()
        assert accepts.cancelling == [0, 0]


async def test_run_never_carries_on_after_a_cancel_turned_into_an_error() -> None:
    """Whatever a stream raises, ``run()`` does not reconnect once its task was cancelled (a
    library below may report a cancel as an error of its own)."""
    settings = AgentFlags(aggregator="127.0.0.1:1", mode="daemonset", token_file="")
    hello = pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name="node-1", agent_version="test")
    client = ReportClient(settings, hello, Outbox(), who="node node-1", rng=random.Random(1))
    attempts = 0

    async def cancelled_into_an_error() -> None:
        nonlocal attempts
        attempts += 1
        # The first time: cancelled, raised as an error. Again (it carried on): cancelled,
        # to end at the loop's next sleep.
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        if attempts > 1:
            return
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError as cancel:
            raise OSError("the channel was closed") from cancel

    client._stream_once = cancelled_into_an_error  # type: ignore[method-assign]
    task = asyncio.create_task(client.run())
    await asyncio.wait((task,), timeout=GUARD)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert attempts == 1
