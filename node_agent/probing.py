"""The probe loop of one Serve proxy, the same in both modes (one per pod in DaemonSet mode)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from node_agent.watchdog import Watchdog
from servehealth_common.backoff import jittered_below
from servehealth_common.first_ends import cancels, reraise_cancel
from servehealth_common.probe import Prober, ProbeResult
from servehealth_common.states import ServeState

log = logging.getLogger(__name__)

#: Past a grid tick by this much (float rounding of ``phase + k * interval``), a time is after it.
TICK_EPSILON = 1e-6

#: Called with every result, and whether its state (or reason) differs from the one before.
OnResult = Callable[[ProbeResult, bool], None]
#: Called at the end of each probe turn with its result's state and how long the turn took.
OnTurn = Callable[[ServeState, float], None]


def next_tick(after: float, phase: float, interval: float) -> float:
    """The tick of the grid ``phase + k * interval`` in ``(after, after + interval]``."""
    return phase + (math.floor((after - phase) / interval) + 1) * interval


@dataclass(eq=False)
class PodProbe:
    """Probes the proxy at ``url`` (and the gRPC proxy at ``grpc_address``, if any: the pod is
    SERVING when both are) and keeps the latest result: at least one probe starts every
    ``interval``.

    Probes are scheduled start to start: the next one starts a period after the previous one
    started, the period jittered only downward (90-100 % of ``interval``, so that thousands of
    agents do not beat in step). A probe that took longer than its period (a failure and its
    confirmation can) is followed by the next one at once. A failure that would change the
    state is confirmed by a second probe within the same turn
    (:meth:`~servehealth_common.probe.Prober.probe_confirmed`). Every result goes to
    ``on_result``; a change is logged. Each finished turn beats ``watchdog`` and goes to
    ``on_turn`` with its duration (the agent's metrics).

    With ``grid_phase`` (a DaemonSet agent, whose pods share one), probes start on a grid of
    ticks ``grid_phase + k * interval`` instead: the next start is the one tick in the interval
    after the last start, so the pods of a node are probed in rounds and their changes travel
    in one message, and still at least once every interval each. A wait for a tick may end a
    little before it by ``clock`` (uvloop's timers count from a millisecond clock read at the
    start of a loop iteration): that turn is still the tick's, and the next one waits for the
    tick after it rather than starting at once for the same tick again.

    ``clock`` and ``sleep`` are the time the schedule is kept by and the wait between probes
    (replaced in tests, which drive the loop without real waits).
    """

    url: str
    prober: Prober
    _: KW_ONLY
    interval: float
    confirm_delay: float
    on_result: OnResult
    rng: random.Random
    name: str
    grid_phase: float | None = None
    grpc_address: str | None = None
    watchdog: Watchdog | None = None
    on_turn: OnTurn = lambda state, seconds: None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    latest: ProbeResult | None = field(default=None, init=False)
    _tick: float | None = field(default=None, init=False)  # the grid tick last waited for

    async def probe_once(self) -> ProbeResult:
        """One probe (confirmed if it fails anew); does not update :attr:`latest`."""
        previous = self.latest.state if self.latest is not None else None
        return await self.prober.probe_confirmed(
            self.url, previous, self.confirm_delay, self.grpc_address
        )

    async def run(self) -> None:
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.probe_loop_started()
        try:
            while True:
                started = self.clock()
                result = await self._probe_and_publish()
                if watchdog is not None:
                    watchdog.probed()
                if result is not None:
                    self.on_turn(result.state, max(0.0, self.clock() - started))
                await self.sleep(max(0.0, self._next_start(started) - self.clock()))
        finally:
            if watchdog is not None:
                watchdog.probe_loop_ended()

    def _next_start(self, started: float) -> float:
        if self.grid_phase is None:
            return started + jittered_below(self.interval, self.rng)
        after = started if self._tick is None else max(started, self._tick)
        self._tick = next_tick(after + TICK_EPSILON, self.grid_phase, self.interval)
        return self._tick

    async def _probe_and_publish(self) -> ProbeResult | None:
        """One probe; its result becomes :attr:`latest`, goes to ``on_result`` and is returned
        (None if the probe failed unexpectedly)."""
        since = cancels()
        try:
            result = await self.probe_once()
        except Exception as error:  # a probe's surprise must not end the agent: next turn
            # ... but a cancel must: on 3.11 asyncio.gather (HTTP and gRPC halves) hands a
            # half's error to a task cancelled in the same iteration, the cancel spent.
            reraise_cancel(since, error)
            log.exception("%s: probe failed", self.name)
            return None
        previous, self.latest = self.latest, result
        # A new reason is news too (a pod with two proxies stays NO_PROXY while the other one
        # moves): without it, the aggregator would show the old reason until the next resync.
        changed = (
            previous is None
            or previous.state is not result.state
            or previous.reason != result.reason
        )
        if changed:
            log.info(
                "%s: %s (HTTP %s, %s)",
                self.name,
                result.state.name,
                result.http_status or "-",
                result.reason,
            )
        self.on_result(result, changed)
        return result
