"""The aggregator's garbage-collection policy (:mod:`aggregator.heap`)."""

from __future__ import annotations

import gc

import pytest

from aggregator.heap import THAW_EVERY, LongLived


def test_survivors_of_a_full_collection_are_frozen_and_only_then() -> None:
    calls: list[str] = []
    policy = LongLived(freeze=lambda: calls.append("freeze"))
    policy.collected("start", {"generation": 2})
    policy.collected("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
    policy.collected("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    assert calls == []
    policy.collected("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert calls == ["freeze"]


def test_with_the_real_collector_a_full_collection_freezes_its_survivors() -> None:
    policy = LongLived()
    policy.install()
    try:
        survivors = [[] for _ in range(1000)]  # containers the collector tracks
        gc.collect(2)
        assert gc.get_freeze_count() >= len(survivors)
    finally:
        policy.uninstall()
        gc.unfreeze()
    assert policy.collected not in gc.callbacks


class Stop(Exception):
    pass


async def test_everything_is_thawed_every_hour() -> None:
    calls: list[str] = []
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            raise Stop

    policy = LongLived(unfreeze=lambda: calls.append("thaw"))
    with pytest.raises(Stop):
        await policy.thaw_forever(sleep)
    assert slept == [THAW_EVERY] * 3
    assert calls == ["thaw"] * 2
