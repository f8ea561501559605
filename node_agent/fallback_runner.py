"""The agent's fallback, between the pure decider (:mod:`node_agent.fallback`) and the API
(:mod:`node_agent.fallback_writer`).

:class:`FallbackRunner` is told everything the decider needs: the Report stream's ups and downs
and the aggregator's write settings (it is the stream's
:class:`~node_agent.stream.StreamListener`), every probe result, and each pod as the agent sees
it (a DaemonSet agent's watch; a sidecar watches its own pod while fallback lasts, so that a
manual override added or taken off meanwhile counts). Its loop
begins fallback when it is due, logs it ("no aggregator for 10s: writing for my 3 pods
myself") and its end, and hands the decider's writes to the writer.

The writer, and with it the Kubernetes client, is made only when fallback first begins
(``open_writer``): a sidecar that never falls back never loads the client (~30 MiB of RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from node_agent.fallback import Fallback, FallbackChange, FallbackPhase
from node_agent.fallback_rules import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_SUCCESS_THRESHOLD,
    PodFacts,
    Write,
    WriteRules,
)
from node_agent.lease_gate import Judged, LeaseName, LeaseSeen
from node_agent.sink import MetricsSink
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.fallback_marks import WHY
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import ProbeResult

log = logging.getLogger(__name__)

FALLBACK = FallbackPhase.FALLBACK


def rules_from(writes: pb.WriteSettings) -> WriteRules | None:
    """The rules of an aggregator's ``WriteSettings``; None if it allows no fallback."""
    if not writes.fallback:
        return None
    return WriteRules(
        label_key=writes.label_key if writes.label else "",
        condition_type=writes.condition_type if writes.condition else "",
        failure_threshold=writes.failure_threshold or DEFAULT_FAILURE_THRESHOLD,
        success_threshold=writes.success_threshold or DEFAULT_SUCCESS_THRESHOLD,
    )


class WriterLike(Protocol):
    """What the runner needs of :class:`~node_agent.fallback_writer.FallbackWriter`."""

    def submit(self, write: Write) -> None: ...

    async def run(self) -> None: ...

    async def follow_pod(
        self, key: PodKey, seen: Callable[[PodFacts], None], gone: Callable[[PodKey], None]
    ) -> None: ...

    async def follow_lease(self, name: LeaseName, to: LeaseListener) -> None: ...


class LeaseListener(Protocol):
    """Who is told what the Lease shows (:class:`FallbackRunner`)."""

    def lease_seen(self, name: LeaseName, record: LeaseSeen | None) -> None: ...

    def lease_unreadable(self, name: LeaseName) -> None: ...


#: Makes the writer when fallback first begins; None if it cannot (it logged why).
OpenWriter = Callable[[Fallback], Awaitable["WriterLike | None"]]


class FallbackRunner:
    """``await run()`` until cancelled. ``own_pod``: a sidecar's pod, watched while fallback
    lasts (a DaemonSet agent's pods come from its own watch: :meth:`pod_seen`)."""

    def __init__(
        self,
        core: Fallback,
        open_writer: OpenWriter,
        *,
        metrics: MetricsSink,
        own_pod: PodKey | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self._open_writer = open_writer
        self._own_pod = own_pod
        self._clock = clock
        self._wake = asyncio.Event()
        self._writer: WriterLike | None = None
        self._writer_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None  # a sidecar's watch of its pod
        self._lease_task: asyncio.Task[None] | None = None  # the Lease's watch, without stream
        self._leased: LeaseName | None = None  # the Lease it watches
        self._said: set[str] = set()  # refusals already logged
        self._told_rules: object = ()  # the rules last logged
        metrics.fallback_clock(core.seconds_in_fallback)

    # -- StreamListener ------------------------------------------------------------------

    def settings(self, writes: pb.WriteSettings | None) -> None:
        if writes is None:
            return  # an aggregator before 0.3.0: the flags decide
        self._learn_lease(writes.lease)
        rules = rules_from(writes)
        why = self.core.learned(rules)
        if why is not None:
            self._say_once(
                logging.ERROR,
                f"refusing the aggregator's write settings for fallback: {why}; this agent "
                "will not write for its pods when no aggregator answers",
            )
        elif rules != self._told_rules:
            self._told_rules = rules
            if rules is None:
                log.info("the aggregator allows no fallback writes by agents")
            else:
                log.info("when no aggregator answers, this agent will write %s", rules)

    def _learn_lease(self, text: str) -> None:
        try:
            name = LeaseName.parse(text)
        except ValueError as error:
            self._say_once(logging.ERROR, f"ignoring the aggregator's Lease {text!r}: {error}")
            name = None
        self.core.learned_lease(name)

    def accepted(self) -> None:
        self._log(self.core.stream_up())
        self._stop_following()
        self._stop_lease()
        self._wake.set()

    # -- LeaseListener ---------------------------------------------------------------------

    def lease_seen(self, name: LeaseName, record: LeaseSeen | None) -> None:
        gate = self.core.lease
        if gate is None or gate.name != name:
            return
        if record is None:
            gate.absent()
        else:
            gate.seen(record)
        self._wake.set()

    def lease_unreadable(self, name: LeaseName) -> None:
        gate = self.core.lease
        if gate is not None and gate.name == name:
            gate.unreadable()
            self._wake.set()

    def ended(self) -> None:
        self.core.stream_down()
        self._wake.set()

    # -- what the agent sees ---------------------------------------------------------------

    def observe(self, key: PodKey, result: ProbeResult) -> None:
        self.core.observe(key, result.state, result.reason)
        if self.core.phase is FallbackPhase.FALLBACK:
            self._wake.set()

    def pod_seen(self, facts: PodFacts) -> None:
        why = self.core.pod_seen(facts)
        if why is not None:
            log.debug("%s: not writing: %s", WHY, why)
        elif self.core.phase is FallbackPhase.FALLBACK:
            self._wake.set()

    def pod_gone(self, key: PodKey) -> None:
        self.core.pod_gone(key)

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                due = self.core.due()
                timeout = None if due is None else max(0.0, due - self._clock())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                self._wake.clear()
                change = self.core.tick()
                if change is not None and change.new is FALLBACK:
                    await self._begin(change)
                elif change is not None:  # the Lease is renewed again: an aggregator is back
                    self._log(change)
                    self._stop_following()
                await self._read_lease()
                if self._writer is not None:
                    for write in self.core.decide():
                        self._writer.submit(write)
        finally:
            following, leasing = self._follow_task, self._lease_task
            self._stop_following()
            self._stop_lease()
            for task in (following, leasing, self._writer_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _writer_now(self) -> WriterLike | None:
        """The writer (and its client), made the first time it is needed."""
        if self._writer is None:
            self._writer = await self._open_writer(self.core)
            if self._writer is None:
                return None
            self._writer_task = asyncio.create_task(self._writer.run(), name="fallback writer")
        return self._writer

    async def _read_lease(self) -> None:
        """Watch the Lease while the decider wants it read (no stream, fallback due but for
        it, or under way); stop when it no longer does, or names another Lease."""
        gate = self.core.lease
        if self._lease_task is not None and (
            gate is None or gate.name != self._leased or not self.core.lease_wanted()
        ):
            self._stop_lease()
        if gate is None or self._lease_task is not None or not self.core.lease_wanted():
            return
        if gate.judged is Judged.OPEN and self._writer is None:
            return  # no client to read it with (said once)
        writer = await self._writer_now()
        if writer is None:
            self.lease_unreadable(gate.name)  # no client: as before the gate
            return
        if self.core.lease_wanted() and self._lease_task is None:
            self._leased = gate.name
            self._lease_task = asyncio.create_task(
                writer.follow_lease(gate.name, self), name="fallback lease"
            )

    def _stop_lease(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            self._lease_task = None

    async def _begin(self, began: FallbackChange) -> None:
        self._log(began)
        writer = await self._writer_now()
        if writer is None:
            return
        own = self._own_pod
        # (Fallback may have ended while the writer was made.)
        if own is not None and self._follow_task is None and self.core.phase is FALLBACK:
            self._follow_task = asyncio.create_task(self._follow(writer, own), name="own pod")

    async def _follow(self, writer: WriterLike, key: PodKey) -> None:
        """A sidecar's pod while fallback lasts (cancelled when it ends)."""
        try:
            await writer.follow_pod(key, self._own_pod_seen, self.pod_gone)
        except Exception:  # a surprise: fallback goes on with what was seen
            log.exception("%s: following pod %s failed", WHY, key)

    def _own_pod_seen(self, facts: PodFacts) -> None:
        why = self.core.pod_seen(facts)
        if why is not None:
            self._say_once(logging.ERROR, f"{WHY}: not writing: {why}")
        elif self.core.phase is FallbackPhase.FALLBACK:
            self._wake.set()

    def _stop_following(self) -> None:
        """Fallback is over: stop watching the sidecar's pod, and forget what it carried (the
        next fallback writes only once it has seen the pod afresh)."""
        if self._follow_task is None:
            return
        self._follow_task.cancel()
        self._follow_task = None
        if self._own_pod is not None:
            self.core.unseen(self._own_pod)

    def _log(self, transition: FallbackChange | None) -> None:
        if transition is None:
            return
        if transition.new is FallbackPhase.FALLBACK:
            pods = 1 if self._own_pod is not None else self.core.own_pods()
            log.warning(
                "%s for %.0fs: writing for my %d pod%s myself (%s) until one accepts this "
                "agent's stream",
                WHY,
                transition.seconds,
                pods,
                "" if pods == 1 else "s",
                self.core.rules,
            )
        elif (
            transition.old is FallbackPhase.FALLBACK
            and self.core.lease is not None
            and (transition.new is FallbackPhase.WAITING)
        ):
            log.warning(
                "%s is renewed again after %.1fs of fallback: an aggregator is back, no longer "
                "writing for my pods",
                self.core.lease.describe(),
                transition.seconds,
            )
        elif transition.old is FallbackPhase.FALLBACK:
            log.warning(
                "an aggregator accepted the stream after %.1fs of fallback: no longer writing "
                "for my pods",
                transition.seconds,
            )

    def _say_once(self, level: int, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.log(level, message)
