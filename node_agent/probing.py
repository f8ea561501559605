"""The probe loop of one Serve proxy, the same in both modes (one per pod in DaemonSet mode)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from servehealth_common.backoff import jittered_below
from servehealth_common.probe import Prober, ProbeResult

log = logging.getLogger(__name__)

#: Called with every result, and whether its state differs from the one before.
OnResult = Callable[[ProbeResult, bool], None]


class PodProbe:
    """Probes the proxy at ``url`` and keeps the latest result: at least one probe starts
    every ``interval``.

    Probes are scheduled start to start: the next one starts a period after the previous one
    started, the period jittered only downward (90-100 % of ``interval``, so that thousands of
    agents do not beat in step). A probe that took longer than its period (a failure and its
    confirmation can) is followed by the next one at once. A failure that would change the
    state is confirmed by a second probe within the same turn
    (:meth:`~servehealth_common.probe.Prober.probe_confirmed`). Every result goes to
    ``on_result``; a change is logged.

    ``clock`` and ``sleep`` are the time the schedule is kept by and the wait between probes
    (replaced in tests, which drive the loop without real waits).
    """

    def __init__(
        self,
        url: str,
        prober: Prober,
        *,
        interval: float,
        confirm_delay: float,
        on_result: OnResult,
        rng: random.Random,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.url = url
        self.name = name
        self.latest: ProbeResult | None = None
        self._prober = prober
        self._interval = interval
        self._confirm_delay = confirm_delay
        self._on_result = on_result
        self._rng = rng
        self._clock = clock
        self._sleep = sleep

    async def probe_once(self) -> ProbeResult:
        """One probe (confirmed if it fails anew); does not update :attr:`latest`."""
        previous = self.latest.state if self.latest is not None else None
        return await self._prober.probe_confirmed(self.url, previous, self._confirm_delay)

    async def run(self) -> None:
        while True:
            started = self._clock()
            await self._probe_and_publish()
            period = jittered_below(self._interval, self._rng)
            await self._sleep(max(0.0, started + period - self._clock()))

    async def _probe_and_publish(self) -> None:
        """One probe; its result becomes :attr:`latest` and goes to ``on_result``."""
        try:
            result = await self.probe_once()
        except Exception:  # a probe's surprise must not end the agent: try again next turn
            log.exception("%s: probe failed", self.name)
            return
        previous, self.latest = self.latest, result
        changed = previous is None or previous.state is not result.state
        if changed:
            log.info(
                "%s: %s (HTTP %s, %s)",
                self.name,
                result.state.name,
                result.http_status or "-",
                result.reason,
            )
        self._on_result(result, changed)
