"""Run coroutines together until the first ends, and never lose a cancel of the caller.

Why not ``asyncio.TaskGroup``: on Python 3.11, when a task of the group fails in the same loop
iteration as a cancel of the task around the group, the group raises the task's error instead
of the cancel (CPython gh-116720); a caller that catches ``Exception`` to reconnect then
reconnects for ever, and SIGTERM no longer stops the program. A group whose task failed also
leaves a cancel request of its own on the caller's task (``Task.cancelling()``), one per failure.

:func:`until_first_ends` waits with ``asyncio.wait(FIRST_COMPLETED)`` instead, cancels the
tasks left and waits for them, and raises ``CancelledError`` whenever the caller was cancelled,
whatever its tasks did meanwhile. A loop that catches ``Exception`` to carry on checks
:func:`reraise_cancel` first: something below it may have turned a cancel into an error (on
3.11 ``asyncio.gather`` too hands a task cancelled in the same iteration as a child's failure
the child's error, the cancel spent).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine, Sequence
from typing import Any


class ChildCancelled(Exception):
    """A task of :func:`until_first_ends` ended cancelled though nobody here cancelled it nor
    the caller (gRPC cancels a call's reader when it cancels the call): an end, not a cancel."""


def cancels() -> int:
    """The cancel requests pending on the current task (``Task.cancelling()``; 0 outside one)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def reraise_cancel(since: int, error: BaseException) -> None:
    """Raise ``CancelledError`` (from ``error``) if the current task was cancelled since it had
    ``since`` cancel requests (:func:`cancels`): a loop that catches ``Exception`` to carry on
    calls this first, so that an error that came with a cancel does not keep it running."""
    if cancels() > since:
        raise asyncio.CancelledError from error


async def until_first_ends(
    *coroutines: Coroutine[Any, Any, object], names: Sequence[str] = ()
) -> None:
    """Run ``coroutines`` as tasks (named after ``names``) until the first ends; then cancel
    the others and wait for them to end.

    A cancel of the caller's task always wins: ``CancelledError``, even if a task failed in the
    same loop iteration. Otherwise this ends as the tasks did: the first error (in the order of
    ``coroutines``) of a task that failed by itself, else of one that failed while being
    cancelled; else :class:`ChildCancelled` if a task ended cancelled by someone else; else None
    (a task returned).
    """
    since = cancels()
    named = itertools.zip_longest(coroutines, names[: len(coroutines)])
    tasks = [asyncio.create_task(coroutine, name=name) for coroutine, name in named]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended: list[asyncio.Task[object]] = [task for task in tasks if task.done()]
        await _stop(tasks)
    if cancels() > since:  # cancelled while the tasks were stopping
        raise asyncio.CancelledError
    _raise_outcome(tasks, ended)


async def _stop(tasks: list[asyncio.Task[object]]) -> None:
    """Cancel the tasks not done and wait until every one has ended, even if the caller is
    cancelled meanwhile (then ``CancelledError`` once they have: none is left running)."""
    left = [task for task in tasks if not task.done()]
    for task in left:
        task.cancel()
    cancelled = False
    while left:
        try:
            await asyncio.wait(left)
        except asyncio.CancelledError:
            cancelled = True
        left = [task for task in left if not task.done()]
    for task in tasks:  # retrieved: no "exception was never retrieved" at collection
        if not task.cancelled():
            task.exception()
    if cancelled:
        raise asyncio.CancelledError


def _raise_outcome(tasks: list[asyncio.Task[object]], ended: list[asyncio.Task[object]]) -> None:
    """Raise what the tasks ended with (:func:`until_first_ends`), ``ended`` the tasks that
    ended by themselves; return if none failed or was cancelled by someone else (one returned)."""
    failed = [task for task in tasks if not task.cancelled() and task.exception() is not None]
    failed.sort(key=lambda task: task not in ended)  # stable: the order of the coroutines
    if failed:
        error = failed[0].exception()
        assert error is not None
        raise error
    cancelled = [task.get_name() for task in ended if task.cancelled()]
    if cancelled:
        raise ChildCancelled(f"{', '.join(cancelled)} ended cancelled")
