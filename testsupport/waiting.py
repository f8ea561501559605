"""Waiting for a condition, in the tests and the benchmarks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def eventually(
    check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02
) -> Any:
    """Poll ``check`` (sync or async) until it returns a truthy value or ``timeout`` passes.

    The default is generous on purpose: a wait ends as soon as its condition holds, so only a
    hang meets the timeout, also on two loaded cores with four workers. Never use it to prove
    that something does not happen (use an event or a fake clock)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {check}")
        await asyncio.sleep(interval)
