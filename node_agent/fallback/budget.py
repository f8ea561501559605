"""An agent's share of the fleet's API budget while it falls back (issue 26): pure, with an
injected clock and random source.

When an aggregator dies, every agent loses its stream in the same second. What they then send
to the API server (the Lease read, a pod read, a write and its Event) must stay within a budget
for the whole fleet, ``--fallback-api-budget`` requests per second, whatever share of the
fleet needs to write: a whole Ray cluster failing at the moment its aggregator dies included.
Agents cannot talk to each other in an outage, so each spends a fixed share:

- the aggregator announces the fleet's size ``N`` (``AgentSettings.fleet_size``: the larger of
  its agents and its pods; ``--fallback-fleet-size`` until one did);
- each agent gets a *slot* every ``period = PER_SLOT * N / budget`` seconds, at a phase of its
  own drawn at random (so the fleet's slots are spread evenly over time), and sends at most
  ``PER_SLOT`` requests in a slot, within ``WINDOW`` seconds of its start;
- a slot not used is lost: an agent cannot save up requests while it has nothing to send, and
  so a fleet that fails all at once cannot send more than its slots allow.

The fleet then sends at most ``budget`` requests per second on average (``N`` agents, each
``PER_SLOT`` per ``period``), and in any one second about ``PER_SLOT`` times the number of
slots that start in it (a Poisson count with mean ``budget / PER_SLOT``). The price is latency
in a large fleet: a request waits for the agent's next slot, on average half a period (11,000
agents at 40 requests/s: a period of 550 s). Only agents that have something to send spend
anything: an agent whose pods carry what their probes say sends nothing at all.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

#: Requests an agent may send in one slot (a write and its Event; a Lease read and a pod read).
PER_SLOT = 2
#: A slot's requests go within this many seconds of its start (or within the period, if it is
#: shorter).
WINDOW = 1.0
#: --fallback-api-budget's default: requests per second for the whole fleet.
DEFAULT_FLEET_BUDGET = 40.0
#: --fallback-fleet-size's default: the fleet assumed until an aggregator announces one.
DEFAULT_FLEET_SIZE = 100


class ApiBudget:
    """When each of an agent's fallback requests may go (:meth:`reserve`)."""

    def __init__(
        self,
        *,
        fleet_budget: float = DEFAULT_FLEET_BUDGET,
        fleet_size: int = DEFAULT_FLEET_SIZE,
        clock: Callable[[], float],
        rng: random.Random | None = None,
    ) -> None:
        if fleet_budget <= 0:
            raise ValueError("the fleet's API budget must be positive")
        self.fleet_budget = fleet_budget
        self.fleet_size = max(1, fleet_size)
        self._clock = clock
        #: Where this agent's slots fall within each period (a fraction, drawn once).
        self._phase = (rng or random.Random()).random()
        self._slot = -1  # the latest slot reserved from
        self._used = 0  # requests reserved in it

    def announced(self, fleet_size: int) -> None:
        """An aggregator's ``AgentSettings.fleet_size`` (0: it did not say; kept as it was)."""
        if fleet_size > 0:
            self.fleet_size = fleet_size

    @property
    def period(self) -> float:
        """Seconds between two slots of this agent."""
        return PER_SLOT * self.fleet_size / self.fleet_budget

    def reserve(self) -> float:
        """Reserve one request: the clock time at which it may go (now, or the start of a later
        slot). Reservations are handed out in order, ``PER_SLOT`` per slot."""
        now, period = self._clock(), self.period
        offset = self._phase * period
        slot = math.floor((now - offset) / period)
        if now >= offset + slot * period + min(WINDOW, period):
            slot += 1  # the current slot's window is over
        if slot < self._slot or (slot == self._slot and self._used >= PER_SLOT):
            slot = self._slot + (self._used >= PER_SLOT)
        if slot != self._slot:
            self._slot, self._used = slot, 0
        self._used += 1
        return max(now, offset + slot * period)

    def try_reserve(self) -> bool:
        """Reserve one request for now, if the current slot is open and has room (an Event:
        sent now or not at all, never waiting for a slot of its own)."""
        now, period = self._clock(), self.period
        offset = self._phase * period
        slot = math.floor((now - offset) / period)
        if now >= offset + slot * period + min(WINDOW, period) or slot < self._slot:
            return False
        if slot == self._slot and self._used >= PER_SLOT:
            return False
        if slot != self._slot:
            self._slot, self._used = slot, 0
        self._used += 1
        return True

    def describe(self) -> str:
        return (
            f"{PER_SLOT} API requests every {self.period:.3g}s (the fleet's budget of "
            f"{self.fleet_budget:g}/s shared by {self.fleet_size} agents and pods)"
        )
