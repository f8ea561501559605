"""Running the programs' event loop: uvloop where it is installed (about a quarter less CPU
per gRPC message here), the standard loop otherwise; and stopping the tasks it runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def cancel_and_wait(
    *tasks: asyncio.Task[Any] | None, ignore: tuple[type[Exception], ...] = ()
) -> None:
    """Cancel each task (None: no task) and wait until each has ended. Its cancel is not
    raised here, nor an error of a type in ``ignore``; another error it ended with is."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError, *ignore):
            await task


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard one, as Go's runtime does at start: a
    server that holds one socket per agent must not stop at the usual soft default (1,024).
    Returns the (soft, hard) limits in force after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep what we have; the caller warns if it is too little
    return soft, hard
