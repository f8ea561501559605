"""The probe loop of one Serve proxy, the same in both modes (one per pod in DaemonSet mode)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from servehealth_common.backoff import jittered
from servehealth_common.probe import Prober, ProbeResult

log = logging.getLogger(__name__)

#: Called with every result, and whether its state differs from the one before.
OnResult = Callable[[ProbeResult, bool], None]


class PodProbe:
    """Probes the proxy at ``url`` every ``interval`` (jittered) and keeps the latest result.

    A failure that would change the state is confirmed by a second probe ``confirm_delay``
    later (the second answer counts). Every result goes to ``on_result``; a change is logged.
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
    ) -> None:
        self.url = url
        self.name = name
        self.latest: ProbeResult | None = None
        self._prober = prober
        self._interval = interval
        self._confirm_delay = confirm_delay
        self._on_result = on_result
        self._rng = rng

    async def probe_once(self) -> ProbeResult:
        """One probe (confirmed if it fails anew); does not update :attr:`latest`."""
        previous = self.latest.state if self.latest is not None else None
        return await self._prober.probe_confirmed(self.url, previous, self._confirm_delay)

    async def run(self) -> None:
        while True:
            try:
                result = await self.probe_once()
            except Exception:  # a probe's surprise must not end the agent: try again later
                log.exception("%s: probe failed", self.name)
                await asyncio.sleep(jittered(self._interval, self._rng))
                continue
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
            await asyncio.sleep(jittered(self._interval, self._rng))
