"""What the fallback's runner needs of its writer, and who is told what the Lease shows: the
seams between :mod:`node_agent.fallback.runner`, :mod:`node_agent.fallback.writer` and
:mod:`node_agent.fallback.lease_watch`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from node_agent.fallback.decider import Fallback
from node_agent.fallback.lease_gate import LeaseName, LeaseSeen
from node_agent.fallback.rules import PodFacts, Write
from servehealth_common.pod_identity import PodKey


class WriterLike(Protocol):
    """What the runner needs of :class:`~node_agent.fallback.writer.FallbackWriter`."""

    def submit(self, write: Write) -> None: ...

    async def run(self) -> None: ...

    async def follow_pod(
        self, key: PodKey, seen: Callable[[PodFacts], None], gone: Callable[[PodKey], None]
    ) -> None: ...

    async def follow_lease(self, name: LeaseName, to: LeaseListener) -> None: ...

    async def read_pod(self, key: PodKey) -> PodFacts | None: ...


class LeaseListener(Protocol):
    """Who is told what the Lease shows (:class:`~node_agent.fallback.runner.FallbackRunner`)."""

    def lease_seen(self, name: LeaseName, record: LeaseSeen | None) -> None: ...

    def lease_unreadable(self, name: LeaseName) -> None: ...

    def lease_gap(self, name: LeaseName) -> None: ...


#: Makes the writer (once, when a request is due or ahead of it); None if it cannot (logged).
OpenWriter = Callable[[Fallback], Awaitable["WriterLike | None"]]
