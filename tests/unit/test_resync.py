"""The resync interval handed to agents that report on change, as the fleet grows."""

from __future__ import annotations

import pytest

from aggregator.decision.resync import MISSED_RESYNCS, ResyncSchedule, ResyncSettings, scale_factor


@pytest.mark.parametrize(
    ("pods", "factor"),
    [(0, 1), (1, 1), (128, 1), (129, 2), (256, 2), (257, 3), (1_000, 4), (10_000, 8), (20_000, 9)],
)
def test_scale_factor_follows_consuls_anti_entropy_rule(pods: int, factor: int) -> None:
    assert scale_factor(pods) == factor


def test_the_interval_stretches_with_the_fleet_and_never_shrinks() -> None:
    schedule = ResyncSchedule(ResyncSettings(base=30.0))
    assert schedule.for_fleet(10) == 30.0
    assert schedule.for_fleet(10_000) == 240.0
    assert schedule.kept_ttl == MISSED_RESYNCS * 240.0
    # Streams opened earlier keep 240 s: the silence allowed must still cover them.
    assert schedule.for_fleet(50) == 240.0
