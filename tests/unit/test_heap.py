"""The aggregator's garbage-collection policy, on a fake clock and a fake sleep."""

from __future__ import annotations

import gc

import pytest

from aggregator.heap import FREEZE_EVERY, THAW_EVERY, freeze_long_lived
from tests.conftest import FakeClock


class Stop(Exception):
    pass


async def test_long_lived_objects_are_frozen_every_minute_and_thawed_every_hour() -> None:
    clock = FakeClock()
    calls: list[str] = []

    async def sleep(seconds: float) -> None:
        assert seconds == FREEZE_EVERY
        clock.advance(seconds)
        if clock.now - 1000.0 >= 2 * THAW_EVERY + FREEZE_EVERY:
            raise Stop

    with pytest.raises(Stop):
        await freeze_long_lived(
            sleep,
            clock,
            freeze=lambda: calls.append("freeze"),
            unfreeze=lambda: calls.append("thaw"),
        )
    per_hour = int(THAW_EVERY / FREEZE_EVERY)
    assert calls == (["freeze"] * (per_hour - 1) + ["thaw"]) * 2


async def test_the_real_collector_freezes_and_thaws() -> None:
    """With the real gc functions: what a minute held is frozen, and thawed again."""
    clock = FakeClock()
    turns = 0

    async def sleep(seconds: float) -> None:
        nonlocal turns
        turns += 1
        clock.advance(THAW_EVERY if turns == 2 else seconds)
        if turns == 1:
            return
        if turns == 2:
            assert gc.get_freeze_count() > 0  # the first turn froze
            return
        assert gc.get_freeze_count() == 0  # the second one, an hour on, thawed
        raise Stop

    try:
        with pytest.raises(Stop):
            await freeze_long_lived(sleep, clock)
    finally:
        gc.unfreeze()
