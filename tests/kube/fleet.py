"""A whole program on the API emulator: a real ``serve-health-aggregator`` process and one real
``serve-health-agent`` process per pod that has an agent (the tests that need the whole
program: tests/kube/test_*_processes.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testsupport import harness
from testsupport.fakes import FakeServeProxy


@dataclass
class Fleet:
    aggregator: harness.AggregatorProcess
    #: The aggregator first, then the agents.
    processes: list[harness.Process] = field(default_factory=list)

    async def metric(self, name: str) -> float:
        """The value of ``name`` (with its labels) on the aggregator's /metrics (0 if none)."""
        port = self.aggregator.metrics_port
        return await asyncio.to_thread(harness.metric_value, port, name) or 0.0

    async def metric_is(self, name: str, value: float) -> bool:
        return await self.metric(name) == value


@contextlib.asynccontextmanager
async def fleet(
    tmp_path: Path,
    aggregator_args: Sequence[str],
    proxies: Sequence[FakeServeProxy],
    uids: Sequence[str],
    agents: int,
    agent_args: Sequence[str] = (),
) -> AsyncIterator[Fleet]:
    """The aggregator (``aggregator_args``; logs in ``tmp_path``), then an agent for each of
    pods ``pod-0`` .. ``pod-{agents - 1}`` (namespace default, node node-1) probing its proxy
    (``agent_args`` after the harness's own flags: they win); every process stopped on exit,
    the agents first."""
    processes: list[harness.Process] = []
    try:
        aggregator = await asyncio.to_thread(
            harness.start_aggregator, tmp_path, None, list(aggregator_args)
        )
        processes.append(aggregator)
        for i in range(agents):
            identity = harness.PodIdentity("default", f"pod-{i}", uids[i], "node-1")
            processes.append(
                await asyncio.to_thread(
                    harness.start_agent,
                    tmp_path,
                    aggregator.address,
                    proxies[i].port,
                    identity,
                    name=f"agent-{i}",
                    extra_args=list(agent_args),
                )
            )
        yield Fleet(aggregator, processes)
    finally:
        for process in reversed(processes):
            await asyncio.to_thread(process.stop)
