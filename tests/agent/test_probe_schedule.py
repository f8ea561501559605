"""When the agent's probe loop (``PodProbe.run``) starts its probes: start to start.

The loop runs on a fake clock and a fake sleep (both injected into ``PodProbe``): the sleep
records how long the loop asked to wait and moves the clock by that much, so no test waits for
real. Each probe is real (a ``Prober`` against a ``FakeServeProxy`` on 127.0.0.1); how long it
took on the fake clock is set by its ``on_result``, which the loop calls when the probe ends.
Checked: the next probe starts a jittered period after the previous one started, never later
than ``interval`` after it; a probe longer than its period is followed by the next one at once;
the period is only ever jittered shorter.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from node_agent.probing import PodProbe, next_tick
from node_agent.watchdog import Watchdog
from servehealth_common.backoff import jittered_below
from servehealth_common.http import HTTPClient
from servehealth_common.probe import Prober, ProbeResult, make_session
from servehealth_common.states import ServeState
from tests.conftest import FakeClock
from testsupport.fakes import FakeServeProxy

INTERVAL = 0.75
#: How long each probe takes on the fake clock, in turn: short ones, one as long as the
#: interval, one longer, one exactly a probe timeout.
DURATIONS = [0.0, 0.1, 0.75, 1.2, 0.5, 0.01]


class LoopEnded(Exception):
    """Raised by the fake sleep once every planned probe has run."""


class Schedule:
    """The fake clock, sleep and ``on_result`` of one probe loop, and what they saw."""

    def __init__(self, durations: list[float]) -> None:
        self.clock = FakeClock()
        self.durations = list(durations)
        self.results: list[ProbeResult] = []
        self.sleeps: list[float] = []

    def on_result(self, result: ProbeResult, changed: bool) -> None:
        self.results.append(result)
        self.clock.advance(self.durations[len(self.results) - 1])

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.clock.advance(delay)
        if len(self.sleeps) == len(self.durations):
            raise LoopEnded


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


async def run_loop(
    session: HTTPClient,
    proxy: FakeServeProxy,
    schedule: Schedule,
    rng: random.Random,
    grid_phase: float | None = None,
    watchdog: Watchdog | None = None,
) -> None:
    prober = Prober(session, 0.5)
    probe = PodProbe(
        proxy.url,
        prober,
        interval=INTERVAL,
        confirm_delay=0.1,
        on_result=schedule.on_result,
        rng=rng,
        name="test proxy",
        grid_phase=grid_phase,
        watchdog=watchdog,
        clock=schedule.clock,
        sleep=schedule.sleep,
    )
    with pytest.raises(LoopEnded):
        await probe.run()
    assert probe.latest is not None
    assert probe.latest.state is ServeState.SERVING


async def test_probes_are_scheduled_start_to_start(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    schedule = Schedule(DURATIONS)
    await run_loop(session, fake_proxy, schedule, random.Random(7))
    assert len(schedule.results) == len(DURATIONS)
    expected_rng = random.Random(7)  # the same draws as the loop's: one period per turn
    for duration, slept in zip(DURATIONS, schedule.sleeps, strict=True):
        period = jittered_below(INTERVAL, expected_rng)
        # The wait is what is left of the period after the probe (never negative): the next
        # probe starts ``period`` after this one started, or at once if it took longer.
        assert slept == pytest.approx(max(0.0, period - duration))


async def test_a_probe_starts_at_least_every_interval(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    """Start to start: a probe that took half the interval does not push the next one out."""
    schedule = Schedule([0.5] * 4)
    await run_loop(session, fake_proxy, schedule, random.Random(1))
    for slept in schedule.sleeps:
        gap = 0.5 + slept  # from one probe's start to the next one's
        assert 0.9 * INTERVAL - 1e-9 <= gap <= INTERVAL + 1e-9


async def test_a_probe_longer_than_the_interval_is_followed_at_once(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    schedule = Schedule([INTERVAL + 0.3, INTERVAL])
    await run_loop(session, fake_proxy, schedule, random.Random(3))
    assert schedule.sleeps == [0.0, 0.0]


@pytest.mark.parametrize("seed", range(20))
def test_the_period_is_only_jittered_shorter(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        assert 0.9 * INTERVAL <= jittered_below(INTERVAL, rng) <= INTERVAL


# -- DaemonSet agents: the pods of a node on one grid ---------------------------------------


@pytest.mark.parametrize("after", [0.0, 0.3, 0.75, 1.2, 1000.01, -5.0])
def test_next_tick_is_the_one_grid_tick_within_the_interval_after(after: float) -> None:
    phase = 0.2
    tick = next_tick(after, phase, INTERVAL)
    assert after < tick <= after + INTERVAL + 1e-9
    assert ((tick - phase) / INTERVAL) == pytest.approx(round((tick - phase) / INTERVAL))


async def test_on_a_grid_probes_start_on_its_ticks_and_at_least_every_interval(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    schedule = Schedule(DURATIONS)
    phase = schedule.clock() + 0.33
    await run_loop(session, fake_proxy, schedule, random.Random(5), grid_phase=phase)
    started = schedule.clock.now - sum(DURATIONS) - sum(schedule.sleeps)  # the first start
    for duration, slept in zip(DURATIONS, schedule.sleeps, strict=True):
        next_start = started + duration + slept
        assert next_start - started <= max(duration, INTERVAL) + 1e-9
        if slept > 0:  # waited for a tick: on the grid
            ticks = (next_start - phase) / INTERVAL
            assert ticks == pytest.approx(round(ticks))
        started = next_start


async def test_each_turn_of_the_probe_loop_beats_the_watchdog(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    schedule = Schedule([0.1, 0.1])
    watchdog = Watchdog(3.0, clock=schedule.clock)
    await run_loop(session, fake_proxy, schedule, random.Random(2), watchdog=watchdog)
    # The loop ended (by the fake sleep's exception): it no longer counts as a probe loop.
    schedule.clock.advance(10)
    assert watchdog.stall() is not None  # the event loop did not beat in 10 s
    watchdog.loop_beat()
    assert watchdog.stall() is None  # and no probe loop is left to stall


class ScriptedProber:
    """Answers each probe with the next of ``results``."""

    def __init__(self, results: list[ProbeResult]) -> None:
        self._results = iter(results)

    async def probe_confirmed(self, *_: object) -> ProbeResult:
        return next(self._results)


async def test_a_new_reason_is_a_change_even_in_the_same_state() -> None:
    """A pod with two proxies stays NO_PROXY while the other one moves: its new reason travels
    at once rather than at the next resync."""
    results = [
        ProbeResult(ServeState.NO_PROXY, "HTTP proxy: not populated | gRPC proxy: refused", 503, 0),
        ProbeResult(ServeState.NO_PROXY, "HTTP proxy: not populated | gRPC proxy: refused", 503, 0),
        ProbeResult(ServeState.NO_PROXY, "gRPC proxy: refused", 200, 0),
        ProbeResult(ServeState.NOT_READY, "gRPC proxy: not populated", 200, 0),
        ProbeResult(ServeState.NOT_READY, "gRPC proxy: not populated", 200, 0),
    ]
    seen: list[bool] = []
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        if len(slept) == len(results):
            raise LoopEnded

    probe = PodProbe(
        "http://127.0.0.1:1/-/healthz",
        ScriptedProber(results),  # type: ignore[arg-type]
        interval=INTERVAL,
        confirm_delay=0.1,
        on_result=lambda _, changed: seen.append(changed),
        rng=random.Random(1),
        name="test proxy",
        clock=FakeClock(),
        sleep=sleep,
    )
    with pytest.raises(LoopEnded):
        await probe.run()
    assert seen == [True, False, True, True, False]
