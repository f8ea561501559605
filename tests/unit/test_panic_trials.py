"""Randomized trials of self-protection, on a simulated clock (issue 12).

The real :class:`aggregator.decision.core.Core` runs in the discrete-event simulation of
:mod:`testsupport.simulation` with both programs' default settings. What each seed draws: the fleet
size, the share that fails (at or above the threshold), the mix of pushed and agentless pods,
every probe and pull phase, and the moments of failure.

- **Mass, at once**: the failing pods hang at one moment (what is seen spreads over a pull
  interval, by the phases of probes and pulls): no pod ever leaves service.
- **Mass, developing**: the failing pods hang at random moments within one pull interval: a pod
  taken out before the mass showed itself is put back when PANIC begins, so none is out at the
  end; and pods out for suspect failures never reach the threshold at any moment.
- **Lone**: one pod hangs: it leaves service within its bound (agent: probe interval + probe
  timeout + the look; agentless: pull interval + pull timeout + the look).

``python -m bench.panic_trials`` runs more seeds and prints the figures.
"""

from __future__ import annotations

import pytest

from testsupport.simulation import (
    ANSWER,
    DEFAULTS,
    PULL_INTERVAL,
    lone_bound,
    mass_at_once,
    mass_developing,
    one_hang,
)

SEEDS = range(100)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mass_hang_at_once_takes_out_no_pod(seed: int) -> None:
    trial = mass_at_once(seed)
    assert trial.removals == []
    assert trial.sim.core.panic
    assert trial.sim.core.summary().panic_held_writes == len(trial.failing)


@pytest.mark.parametrize("seed", SEEDS)
def test_after_a_mass_hang_heals_panic_ends_and_no_pod_was_removed(seed: int) -> None:
    trial = mass_at_once(seed)
    sim = trial.sim
    healed = sim.now
    for key in trial.failing:
        sim.healed_at[key] = healed
    sim.run_until(healed + 4 * PULL_INTERVAL)
    assert not sim.core.panic
    assert sim.removals(since=trial.onset) == []
    assert sim.out_of_service() == set()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mass_hang_developing_within_a_pull_interval_leaves_no_pod_out(seed: int) -> None:
    trial = mass_developing(seed)
    assert trial.sim.out_of_service() == set()
    assert trial.sim.out_for_suspect_max < DEFAULTS.threshold * len(trial.sim.keys)
    assert trial.sim.core.panic


@pytest.mark.parametrize("seed", SEEDS)
def test_a_lone_hang_leaves_service_within_its_bound(seed: int) -> None:
    trial = one_hang(seed)
    (key,) = trial.failing
    assert [w.key for w in trial.removals] == [key]
    assert trial.removals[0].at - trial.onset <= lone_bound(trial) + 2 * ANSWER
    assert not trial.sim.core.panic


@pytest.mark.parametrize("seed", range(40))
def test_what_panic_holds_or_puts_back_is_what_the_pods_should_carry(seed: int) -> None:
    """The writer is level-triggered (issue 25): it writes what ``Core.desired_label`` says
    when it takes a pod, not what was wanted when the pod was queued. So while PANIC lasts,
    every failing pod must want ``"true"`` (put back when PANIC began: a write still queued
    must not be lost) or nothing (held: it keeps what it carries), never ``"false"``."""
    trial = mass_developing(seed)
    core = trial.sim.core
    assert core.panic
    put_back = {write.key for write in trial.removals}  # out before PANIC, then put back
    for key in trial.failing:
        wanted = core.desired_label(key)
        assert wanted != "false", key
        if key in put_back:
            assert wanted == "true", key
