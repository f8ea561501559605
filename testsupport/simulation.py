"""A discrete-event simulation of a fleet around the real :class:`aggregator.decision.core.Core`.

Everything but the core is simulated, on one simulated clock: agents that probe their proxy on
a start-to-start schedule with a random phase and report each result, agentless pods pulled
every pull interval at a random phase, pulls of pods that go SILENT, looks at pods in service
(:mod:`aggregator.decision.fleet_look`), and the expiry loop. A hung proxy's probe (and its hedged
confirmation) answers UNHEALTHY after the probe timeout, a healthy one after a millisecond.
The settings are the programs' defaults, taken from their flags and the aggregator's wiring.

Used by the randomized trials (tests/unit/test_panic_trials.py) and ``bench.panic_trials``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from aggregator.decision.core import Core
from aggregator.decision.fleet_look import SUSPECT_BAD, OnLooked
from aggregator.decision.tracker import Observation, StateChange, Tracker
from aggregator.flags import AggregatorFlags
from aggregator.metrics import Metrics
from aggregator.registry import PodRegistry
from aggregator.wiring import core_settings, tracker_settings
from node_agent.flags import AgentFlags
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.rule import WriteKind, write_needed
from servehealth_common.states import ServeState, Source

_AGGREGATOR = AggregatorFlags()
_AGENT = AgentFlags(aggregator="127.0.0.1:1")
PROBE_INTERVAL = _AGENT.interval
PROBE_TIMEOUT = _AGENT.probe_timeout
PULL_INTERVAL = _AGGREGATOR.pull_interval
PULL_TIMEOUT = _AGGREGATOR.pull_timeout
EXPIRY_INTERVAL = _AGGREGATOR.expiry_interval
DEFAULTS = core_settings(_AGGREGATOR).protection
ANSWER = 0.001  # a healthy proxy's answer
WARM_UP = 12.0  # every pod seen, pulled and settled before anything fails


@dataclass
class Write:
    at: float
    key: PodKey
    value: str


class RecordingRegistry(PodRegistry):
    """A registry that keeps labels in a dict and records every write."""

    name = "simulated"
    seeds_from_cluster = True

    def __init__(self, clock: Callable[[], float]) -> None:
        self.labels: dict[PodKey, str] = {}
        self.writes: list[Write] = []
        self._clock = clock

    def admit(self, pod: PodInfo) -> bool:
        return True

    def desire(self, key: PodKey, value: str, transition: StateChange | None = None) -> None:
        if write_needed(WriteKind.LABEL, self.carried(key, WriteKind.LABEL), value):
            self.labels[key] = value
            self.writes.append(Write(self._clock(), key, value))

    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        return self.labels.get(key)


@dataclass(order=True)
class Event:
    at: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Simulation:
    """One fleet on one simulated clock; also the core's puller (PullTrigger)."""

    def __init__(self, rng: random.Random, pods: int, agentless: float) -> None:
        self.rng = rng
        self.now = 0.0
        self._queue: list[Event] = []
        self._seq = itertools.count()
        self.keys = [PodKey("default", f"pod-{i}") for i in range(pods)]
        self.pushed = {key for key in self.keys if rng.random() >= agentless}
        self.hung_from: dict[PodKey, float] = {}
        self.healed_at: dict[PodKey, float] = {}
        self.registry = RecordingRegistry(lambda: self.now)
        self.core = Core(
            Tracker(tracker_settings(_AGGREGATOR), lambda: self.now),
            self.registry,
            Metrics("trial"),
            self,
            core_settings(_AGGREGATOR),
        )
        self.streams: dict[PodKey, int] = {}
        self.out_for_suspect_max = 0

    # -- the simulated clock -------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, Event(when, next(self._seq), action))

    def run_until(self, end: float) -> None:
        while self._queue and self._queue[0].at <= end:
            event = heapq.heappop(self._queue)
            self.now = event.at
            event.action()
            self._check_cap()
        self.now = end

    def _check_cap(self) -> None:
        out = sum(
            1
            for key, value in self.registry.labels.items()
            if value == "false" and self.state(key) in SUSPECT_BAD
        )
        self.out_for_suspect_max = max(self.out_for_suspect_max, out)

    # -- the fleet -----------------------------------------------------------------------

    def hung(self, key: PodKey, at: float) -> bool:
        onset = self.hung_from.get(key)
        return onset is not None and onset <= at < self.healed_at.get(key, math.inf)

    def answer(
        self, key: PodKey, started: float, timeout: float = PULL_TIMEOUT
    ) -> tuple[float, ServeState]:
        """When a probe started at ``started`` ends, and what it says (a hung probe and its
        hedged confirmation both time out: the failure counts at the first timeout)."""
        if self.hung(key, started + ANSWER):
            return started + timeout, ServeState.UNHEALTHY
        return started + ANSWER, ServeState.SERVING

    def state(self, key: PodKey) -> ServeState | None:
        record = self.core.pod(key)
        return record.state if record is not None else None

    def start(self) -> None:
        for key in self.keys:
            self.core.pod_seen(PodInfo(key, node_name="node-1"), "true")
            self.registry.labels[key] = "true"
            if key in self.pushed:
                self.streams[key] = self.core.hello([PodInfo(key)])
                self.at(self.rng.uniform(0, PROBE_INTERVAL), lambda key=key: self._probe(key))
            else:
                self.at(self.rng.uniform(0, PULL_INTERVAL), lambda key=key: self._pull(key))
        self.at(self.rng.uniform(0, EXPIRY_INTERVAL), self._expire)

    def _probe(self, key: PodKey) -> None:
        started = self.now
        ends, state = self.answer(key, started, PROBE_TIMEOUT)
        self.at(ends, lambda: self.core.report(self.streams[key], key, Observation(state)))
        period = PROBE_INTERVAL * self.rng.uniform(0.9, 1.0)
        self.at(max(started + period, ends), lambda: self._probe(key))

    def _pull(self, key: PodKey, again: bool = True) -> None:
        started = self.now
        ends, state = self.answer(key, started)
        self.at(
            ends, lambda: self.core.pulled(key, Observation(state, source=Source.PULL), started)
        )
        if again:
            self.at(started + PULL_INTERVAL, lambda: self._pull(key))

    def _expire(self) -> None:
        self.core.expire()
        self.at(self.now + EXPIRY_INTERVAL, self._expire)

    # -- PullTrigger -------------------------------------------------------------------

    def can_pull(self, key: PodKey) -> bool:
        return True

    def pull_now(self, keys: Iterable[PodKey]) -> object:
        for key in keys:
            self._pull(key, again=False)
        return None

    def look(self, keys: Sequence[PodKey], on_looked: OnLooked) -> Callable[[], None]:
        cancelled = False
        started = self.now

        def answered(key: PodKey, state: ServeState) -> None:
            if cancelled:
                return
            if key not in self.pushed:  # a look at an agentless pod is a pull too
                self.core.pulled(key, Observation(state, source=Source.PULL), started)
            on_looked(key, state)

        for key in keys:
            ends, state = self.answer(key, started)
            self.at(ends, lambda key=key, state=state: answered(key, state))

        def cancel() -> None:
            nonlocal cancelled
            cancelled = True

        return cancel

    # -- what happened ------------------------------------------------------------------

    def removals(self, since: float) -> list[Write]:
        return [w for w in self.registry.writes if w.value == "false" and w.at >= since]

    def out_of_service(self) -> set[PodKey]:
        return {key for key, value in self.registry.labels.items() if value == "false"}


def fleet(seed: int) -> tuple[random.Random, Simulation]:
    """A healthy fleet drawn from ``seed``, warmed up."""
    rng = random.Random(seed)
    pods = rng.randint(6, 60)
    agentless = rng.choice([0.0, 1.0, rng.random()])
    sim = Simulation(rng, pods, agentless)
    sim.start()
    sim.run_until(WARM_UP)
    assert sim.out_of_service() == set(), "a healthy fleet lost pods while settling"
    return rng, sim


@dataclass
class Trial:
    sim: Simulation
    failing: list[PodKey]
    onset: float  # the first failure
    removals: list[Write]  # label writes of "false" from the first failure on


def mass(rng: random.Random, sim: Simulation) -> list[PodKey]:
    """A random subset at or above the threshold (and at least the PANIC minimum)."""
    pods = len(sim.keys)
    count = rng.randint(max(DEFAULTS.min_pods, math.ceil(DEFAULTS.threshold * pods)), pods)
    return rng.sample(sim.keys, count)


def _run(seed: int, choose: Callable[[random.Random, Simulation], dict[PodKey, float]]) -> Trial:
    rng, sim = fleet(seed)
    onsets = choose(rng, sim)
    sim.hung_from.update(onsets)
    first = min(onsets.values())
    sim.run_until(first + 5 * PULL_INTERVAL)
    return Trial(sim, list(onsets), first, sim.removals(since=first))


def mass_at_once(seed: int) -> Trial:
    """A mass hang, every failing proxy at the same moment."""

    def choose(rng: random.Random, sim: Simulation) -> dict[PodKey, float]:
        onset = WARM_UP + rng.uniform(0, PULL_INTERVAL)
        return dict.fromkeys(mass(rng, sim), onset)

    return _run(seed, choose)


def mass_developing(seed: int) -> Trial:
    """A mass hang whose proxies fail at random moments within one pull interval."""

    def choose(rng: random.Random, sim: Simulation) -> dict[PodKey, float]:
        start = WARM_UP + rng.uniform(0, PULL_INTERVAL)
        return {key: start + rng.uniform(0, PULL_INTERVAL) for key in mass(rng, sim)}

    return _run(seed, choose)


def one_hang(seed: int) -> Trial:
    """One proxy hangs."""

    def choose(rng: random.Random, sim: Simulation) -> dict[PodKey, float]:
        return {rng.choice(sim.keys): WARM_UP + rng.uniform(0, PULL_INTERVAL)}

    return _run(seed, choose)


def lone_bound(trial: Trial) -> float:
    """How soon a lone hang must be out: its detection (an agent's probe interval and
    timeout, or a pull interval and timeout) plus the look (healthy answers: milliseconds)."""
    (key,) = trial.failing
    if key in trial.sim.pushed:
        return PROBE_INTERVAL + PROBE_TIMEOUT
    return PULL_INTERVAL + PULL_TIMEOUT
