"""``servehealth_common.first_ends``: tasks that run until the first ends, and a cancel of the
caller that is never lost (issue 26, bug 1).

On Python 3.11 an ``asyncio.TaskGroup`` raises a task's error instead of a cancel of its caller
when both come in the same loop iteration (CPython gh-116720): the race is made here on purpose,
with futures the test completes and a cancel in one callback, on uvloop, without sleeping.
"""

from __future__ import annotations

import asyncio

import pytest

from servehealth_common.first_ends import (
    ChildCancelled,
    cancels,
    reraise_cancel,
    until_first_ends,
)


class Child:
    """A task's coroutine that waits for ``end`` (completed by the test) and records that it
    started and how it ended."""

    def __init__(self) -> None:
        self.end: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.started = asyncio.Event()
        self.outcome = "running"

    async def __call__(self) -> None:
        self.started.set()
        try:
            await self.end
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        except Exception:
            self.outcome = "failed"
            raise
        self.outcome = "returned"


async def started(*children: Child) -> asyncio.Task[None]:
    """``until_first_ends`` of ``children`` in a task of its own, once every child runs."""
    task = asyncio.create_task(until_first_ends(*(child() for child in children)))
    for child in children:
        await child.started.wait()
    return task


@pytest.mark.parametrize("cancel_first", [False, True], ids=["failure-first", "cancel-first"])
async def test_a_cancel_in_the_same_iteration_as_a_failure_wins(cancel_first: bool) -> None:
    failing, other = Child(), Child()
    task = await started(failing, other)
    # One callback: the child's failure and the caller's cancel reach the loop together (the
    # aggregator's UNAVAILABLE ~1 ms after SIGTERM).
    if cancel_first:
        task.cancel()
    failing.end.set_exception(ConnectionResetError("stream ended"))
    if not cancel_first:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert other.outcome == "cancelled"  # and ended: nothing left running


async def test_the_first_error_is_raised_and_the_others_are_cancelled() -> None:
    first, second, third = Child(), Child(), Child()
    task = await started(first, second, third)
    third.end.set_exception(ValueError("third"))
    second.end.set_exception(KeyError("second"))  # same iteration: the coroutines' order wins
    with pytest.raises(KeyError, match="second"):
        await task
    assert first.outcome == "cancelled"


async def test_no_cancel_request_is_left_on_the_caller() -> None:
    """A TaskGroup on 3.11 cancels its caller when a task fails and never takes it back: one
    stray request per stream end on the agent's stream task."""
    failing, other = Child(), Child()
    caught: list[int] = []

    async def caller() -> None:
        with pytest.raises(OSError, match="gone"):
            await until_first_ends(failing(), other())
        caught.append(cancels())

    task = asyncio.create_task(caller())
    await failing.started.wait()
    failing.end.set_exception(OSError("gone"))
    await task
    assert caught == [0]


async def test_a_task_cancelled_by_someone_else_is_an_end_not_a_cancel() -> None:
    """gRPC cancels a call's reader when it cancels the call: the caller goes on."""
    reader, writer = Child(), Child()
    task = await started(reader, writer)
    reader.end.cancel()  # the reader's await raises CancelledError: nobody cancelled the task
    with pytest.raises(ChildCancelled):
        await task
    assert (reader.outcome, writer.outcome) == ("cancelled", "cancelled")


async def test_a_task_that_returns_ends_the_others() -> None:
    done, other = Child(), Child()
    task = await started(done, other)
    done.end.set_result(None)
    assert await task is None
    assert other.outcome == "cancelled"


async def test_a_cancel_while_the_others_stop_waits_for_them() -> None:
    """A task that takes its time to end once cancelled is waited for, even when the caller
    is cancelled meanwhile: then the caller ends cancelled, with nothing left running."""
    failing = Child()
    stopping, release = asyncio.Event(), asyncio.Event()
    outcome: list[str] = []

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()
            outcome.append("stopped")
            raise

    task = asyncio.create_task(until_first_ends(failing(), slow_to_stop()))
    await failing.started.wait()
    failing.end.set_exception(OSError("gone"))
    await stopping.wait()
    task.cancel()  # while the helper waits for slow_to_stop
    await asyncio.sleep(0)  # one turn: the cancel reaches the helper, which keeps waiting
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outcome == ["stopped"]


async def test_reraise_cancel_turns_an_error_that_came_with_a_cancel_back_into_one() -> None:
    async def swallows() -> str:
        since = cancels()
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        try:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError as cancel:  # a library that reports it as an error
                raise OSError("connection closed") from cancel
        except OSError as error:
            reraise_cancel(since, error)
            return "carried on"
        return "not reached"

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(swallows())

    async def fails() -> str:
        since = cancels()
        try:
            raise OSError("connection closed")
        except OSError as error:
            reraise_cancel(since, error)  # no cancel: nothing raised
            return "carried on"

    assert await asyncio.create_task(fails()) == "carried on"
