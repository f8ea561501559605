"""The agent's fallback, between the pure decider (:mod:`node_agent.fallback.decider`) and the API
(:mod:`node_agent.fallback.writer`).

:class:`FallbackRunner` is told everything the decider needs: the Report stream's ups and downs,
the aggregator's write settings and fleet size, and what a sidecar's pod carries (it is the
stream's :class:`~node_agent.stream_listener.StreamListener`), every probe result, and each pod
as the agent sees it (a DaemonSet agent's watch). Its loop begins fallback when it is due, logs it
("no aggregator for 10s: writing for my 3 pods myself") and its end, and hands the decider's
writes to the writer.

An agent that has nothing to write sends nothing (issue 26): the Lease is read only once a
write is wanted; a sidecar reads its pod only if no aggregator told it what the pod carries,
or the pod changed since (a conditional write answered 409), and watches it only while a manual
override decides for it (to see the override go). Every request waits for the agent's share
of the fleet's API budget (:mod:`node_agent.fallback.budget`).

The writer, and with it the Kubernetes client, is made only when the first request is due
(``open_writer``): a sidecar that never needs one never loads the client (~30 MiB of RSS, a
second of CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from node_agent.fallback.decider import Fallback, FallbackChange, FallbackPhase
from node_agent.fallback.lease_gate import Judged, LeaseName, LeaseSeen
from node_agent.fallback.ports import OpenWriter, WriterLike
from node_agent.fallback.rules import (
    PodFacts,
)
from node_agent.fallback.wire import facts_from_view, rules_from
from node_agent.sink import MetricsSink
from node_agent.stream_listener import StreamListener
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.fallback_marks import WHY
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import ProbeResult
from servehealth_common.runtime import cancel_and_wait

log = logging.getLogger(__name__)

FALLBACK = FallbackPhase.FALLBACK


class FallbackRunner(StreamListener):
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
        self._opening: asyncio.Task[None] | None = None  # the writer being made
        self._prepared = False  # whether the writer was made ahead of fallback once
        self._follow_task: asyncio.Task[None] | None = None  # a sidecar's watch of its pod
        self._read_task: asyncio.Task[None] | None = None  # a sidecar's read of its pod
        self._writes = pb.WriteSettings()  # the last aggregator's (names in its PodViews)
        self._lease_task: asyncio.Task[None] | None = None  # the Lease's watch, without stream
        self._leased: LeaseName | None = None  # the Lease it watches
        self._said: set[str] = set()  # refusals already logged
        self._told_rules: object = ()  # the rules last logged
        metrics.fallback_clock(core.seconds_in_fallback)
        metrics.fallback_gauges(self._lease_renewed, self._slot_seconds)

    def _lease_renewed(self) -> float:
        lease = self.core.lease
        return 1.0 if lease is not None and lease.renewed() else 0.0

    def _slot_seconds(self) -> float:
        budget = self.core.budget
        return budget.period if budget is not None else 0.0

    # -- StreamListener ------------------------------------------------------------------

    def settings(self, writes: pb.WriteSettings | None) -> None:
        if writes is None:
            return  # an aggregator before 0.3.0: the flags decide
        self._writes = writes
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

    def fleet(self, size: int) -> None:
        budget = self.core.budget
        if budget is not None and size > 0 and size != budget.fleet_size:
            budget.announced(size)
            log.info("in fallback, this agent sends at most %s", budget.describe())

    def pod_view(self, view: pb.PodView) -> None:
        """What the aggregator last saw of a sidecar's pod: no need to read it in fallback."""
        facts = facts_from_view(view, self._writes)
        if facts is not None:
            self._own_pod_seen(facts)

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

    def lease_gap(self, name: LeaseName) -> None:
        """The Lease's watch ended: not observed until the next read (nothing is written)."""
        gate = self.core.lease
        if gate is not None and gate.name == name:
            gate.gap()

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
        if self.core.phase is not FallbackPhase.CONNECTED:
            self._wake.set()

    def pod_seen(self, facts: PodFacts) -> None:
        why = self.core.pod_seen(facts)
        if why is not None:
            log.debug("%s: not writing: %s", WHY, why)
        elif self.core.phase is not FallbackPhase.CONNECTED:
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
                self._log(change)
                if change is not None and change.old is FALLBACK:
                    self._stop_following()  # the Lease is renewed again: an aggregator is back
                self._prepare_writer()
                await self._read_lease()
                await self._act()
        finally:
            tasks = (
                self._follow_task,
                self._read_task,
                self._lease_task,
                self._writer_task,
                self._opening,
            )
            self._stop_following()
            self._stop_lease()
            await cancel_and_wait(*tasks)

    async def _act(self) -> None:
        """In fallback, with something to do: read or follow a sidecar's pod if it must, and
        hand the decider's writes to the writer."""
        own = self._own_pod
        if self.core.phase is not FALLBACK or not (self.core.has_work() or self._held(own)):
            return
        writer = await self._writer_now()
        if writer is None or self.core.phase is not FALLBACK:  # (it may end meanwhile)
            return
        if own is not None and self.core.needs_facts(own) and self._read_task is None:
            self._read_task = asyncio.create_task(self._read(writer, own), name="read own pod")
        if own is not None and self._held(own) and self._follow_task is None:
            self._follow_task = asyncio.create_task(self._follow(writer, own), name="own pod")
        for write in self.core.decide():
            writer.submit(write)

    def _held(self, key: PodKey | None) -> bool:
        return key is not None and self.core.held(key)

    async def _writer_now(self) -> WriterLike | None:
        """The writer (and its client), made once: when the first request is due, or ahead of
        fallback (:meth:`_prepare_writer`); None if it cannot be made (logged)."""
        if self._writer is None:
            await (self._opening or self._start_opening())
        return self._writer

    def _prepare_writer(self) -> None:
        """Make the writer (load the client: about a second of CPU) as soon as the agent has
        something to write while no stream is up, so that it is ready when fallback begins
        (it sends nothing). Once: an agent that cannot make it says so once."""
        if self._prepared or self._writer is not None or self._opening is not None:
            return
        if self.core.phase is FallbackPhase.WAITING and self.core.has_work():
            self._prepared = True
            self._start_opening()

    def _start_opening(self) -> asyncio.Task[None]:
        self._opening = asyncio.create_task(self._make_writer(), name="open fallback writer")
        return self._opening

    async def _make_writer(self) -> None:
        try:
            writer = await self._open_writer(self.core)
        finally:
            self._opening = None
        if writer is not None and self._writer is None:
            self._writer = writer
            self._writer_task = asyncio.create_task(writer.run(), name="fallback writer")

    async def _read_lease(self) -> None:
        """Watch the Lease while the decider wants it read (a write wanted, fallback due but
        for it, or under way); stop when it no longer does, or names another Lease."""
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

    async def _read(self, writer: WriterLike, key: PodKey) -> None:
        """A sidecar's pod, read once (within the budget) when a write waits on it."""
        try:
            facts = await writer.read_pod(key)
            if facts is not None:
                self._own_pod_seen(facts)
        except Exception:  # a surprise: the next wanted write tries again
            log.exception("%s: reading pod %s failed", WHY, key)
        finally:
            self._read_task = None
            self._wake.set()

    async def _follow(self, writer: WriterLike, key: PodKey) -> None:
        """A sidecar's pod while an override decides for it (cancelled when fallback ends)."""
        try:
            await writer.follow_pod(key, self._own_pod_seen, self.pod_gone)
        except Exception:  # a surprise: fallback goes on with what was seen
            log.exception("%s: following pod %s failed", WHY, key)

    def _own_pod_seen(self, facts: PodFacts) -> None:
        why = self.core.pod_seen(facts)
        if why is not None:
            self._say_once(logging.ERROR, f"{WHY}: not writing: {why}")
        elif self.core.phase is not FallbackPhase.CONNECTED:
            self._wake.set()

    def _stop_following(self) -> None:
        """Fallback is over: stop watching (or reading) the sidecar's pod, and forget what a
        watch showed of it (it is not followed any more: the aggregator's next view, or a read,
        tells it afresh)."""
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
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
                "%s for %.0fs: writing for my %d pod%s myself (%s; a pod is written only "
                "where it does not carry what it should) until one accepts this agent's stream",
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
