"""An agent's share of the fleet's API budget (issue 26), with a fake clock: two requests per
slot, one slot per period at the agent's own phase, a slot not used is lost (no saving up), and
a fleet of agents with random phases stays within the budget in every window whatever share of
it wants to send at once."""

from __future__ import annotations

import random

import pytest

from node_agent.fallback.budget import PER_SLOT, WINDOW, ApiBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_two_requests_per_slot_then_the_next_slot() -> None:
    clock = Clock()
    budget = ApiBudget(fleet_budget=40, fleet_size=100, clock=clock, rng=random.Random(3))
    assert budget.period == pytest.approx(PER_SLOT * 100 / 40)  # 5 s
    first = budget.reserve()
    assert clock.now <= first < clock.now + budget.period
    assert budget.reserve() == first  # the slot's second request
    assert budget.reserve() == pytest.approx(first + budget.period)  # then the next slot


def test_a_slot_not_used_is_lost() -> None:
    clock = Clock()
    budget = ApiBudget(fleet_budget=40, fleet_size=100, clock=clock, rng=random.Random(3))
    first = budget.reserve()
    clock.now = first + 10 * budget.period + WINDOW  # idle for ten periods
    later = budget.reserve()
    assert later > clock.now  # nothing saved up: it waits for its next slot
    assert budget.reserve() == later
    assert budget.reserve() > later


def test_the_fleet_size_announced_sets_the_period() -> None:
    budget = ApiBudget(fleet_budget=40, fleet_size=100, clock=Clock(), rng=random.Random(1))
    budget.announced(11_000)
    assert budget.period == pytest.approx(550)
    budget.announced(0)  # not said: kept
    assert budget.period == pytest.approx(550)
    with pytest.raises(ValueError, match="positive"):
        ApiBudget(fleet_budget=0, clock=Clock())


@pytest.mark.parametrize("share", [1.0, 0.1])
def test_a_fleet_failing_at_once_stays_within_the_budget(share: float) -> None:
    """1,000 agents (40 requests/s): every one of them (or a tenth) wants to send at the same
    instant, and again as soon as it may, for three periods."""
    clock, rng = Clock(), random.Random(7)
    start = clock.now
    agents = [
        ApiBudget(fleet_budget=40, fleet_size=1000, clock=clock, rng=rng)
        for _ in range(int(1000 * share))
    ]
    period = agents[0].period
    times = [when for budget in agents for when in [budget.reserve() for _ in range(3 * PER_SLOT)]]
    per_second: dict[int, int] = {}
    for when in times:
        per_second[int(when - start)] = per_second.get(int(when - start), 0) + 1
    assert max(per_second.values()) <= 200
    whole = [per_second.get(second, 0) for second in range(int(3 * period))]
    for begin in range(len(whole) - 60):
        assert sum(whole[begin : begin + 60]) / 60 <= 50


def test_try_reserve_takes_room_in_the_current_slot_only() -> None:
    clock = Clock()
    budget = ApiBudget(fleet_budget=40, fleet_size=100, clock=clock, rng=random.Random(3))
    clock.now = budget.reserve()  # the write, at its slot
    assert budget.try_reserve()  # its Event: the slot has room
    assert not budget.try_reserve()  # no room left: not sent, and no wait
    clock.now += WINDOW  # the slot's window is over
    assert not budget.try_reserve()
    clock.now = budget.reserve()  # the next slot's first request
    assert budget.try_reserve()
