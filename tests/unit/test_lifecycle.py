"""The aggregator's phases (``aggregator.lifecycle``): every change the diagram allows is taken
and logged, every other one is refused (that only LEADING serves reports is tested through real
streams: tests/kube/test_leader_election.py, tests/aggregator/test_drain.py)."""

from __future__ import annotations

import logging

import pytest

from aggregator.lifecycle import ALLOWED, ImpossiblePhaseChange, Lifecycle, Phase

P = Phase


def reach(*path: Phase) -> Lifecycle:
    lifecycle = Lifecycle()
    for phase in path:
        lifecycle.move_to(phase, "test")
    return lifecycle


PATHS = {
    P.STARTING: (),
    P.STANDBY: (P.STANDBY,),
    P.LEADING: (P.LEADING,),
    P.STEPPING_DOWN: (P.STANDBY, P.STEPPING_DOWN),
    P.STOPPING: (P.STOPPING,),
    P.STOPPED: (P.STOPPING, P.STOPPED),
}


@pytest.mark.parametrize(
    ("old", "new", "allowed"),
    [
        pytest.param(old, new, new in ALLOWED[old], id=f"{old.name}->{new.name}")
        for old in Phase
        for new in Phase
    ],
)
def test_only_the_changes_of_the_diagram_are_allowed(old: Phase, new: Phase, allowed: bool) -> None:
    lifecycle = reach(*PATHS[old])
    if allowed:
        lifecycle.move_to(new, "why")
        assert lifecycle.phase is new
    else:
        with pytest.raises(ImpossiblePhaseChange, match=f"{old.value} -> {new.value}"):
            lifecycle.move_to(new, "why")
        assert lifecycle.phase is old


def test_every_change_is_logged_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[Phase, Phase]] = []
    lifecycle = Lifecycle(on_change=lambda old, new: seen.append((old, new)))
    with caplog.at_level(logging.INFO, logger="aggregator.lifecycle"):
        lifecycle.move_to(P.STANDBY, "waiting for the Lease")
    assert seen == [(P.STARTING, P.STANDBY)]
    assert "starting -> standby: waiting for the Lease" in caplog.text


def test_stepping_down_keeps_its_reason() -> None:
    lifecycle = Lifecycle()
    lifecycle.move_to(P.STANDBY, "election")
    lifecycle.move_to(P.LEADING, "Lease held")
    assert lifecycle.step_down_reason is None
    lifecycle.move_to(P.STEPPING_DOWN, "renew deadline passed")
    assert lifecycle.step_down_reason == "renew deadline passed"
    assert not lifecycle.stopping()
    lifecycle.move_to(P.STOPPING, "after stepping down")
    assert lifecycle.stopping()
