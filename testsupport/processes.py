"""A child process (``python -m aggregator``, ``python -m node_agent``) whose stderr a test reads
line by line, for tests where the point is the real program's log."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any


class StderrLines:
    """Reads ``process``'s stderr as the test asks for lines; keeps what it read."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    async def line_where(self, check: Callable[[str], Any]) -> Any:
        """Read stderr until ``check(line)`` is truthy (30 s at most); returns that value."""
        assert self.process.stderr is not None
        async with asyncio.timeout(30):
            while True:
                raw = await self.process.stderr.readline()
                assert raw, f"exited ({self.process.returncode}):\n{''.join(self.lines)}"
                line = raw.decode()
                self.lines.append(line)
                if found := check(line):
                    return found

    async def stop(self) -> str:
        """SIGTERM, then wait for the exit; returns the rest of stderr (not read before)."""
        assert self.process.stderr is not None
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            rest = (await self.process.stderr.read()).decode()
            await self.process.wait()
        return rest
