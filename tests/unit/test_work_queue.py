"""servehealth_common.work_queue.KeyedQueue: the one keyed queue both pod writers run on
(issue 25). Time is moved by hand (a fake timer); no real sleep."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from servehealth_common.backoff import RETRY_CAP, RETRY_FLOOR, backoff_delay
from servehealth_common.work_queue import KeyedQueue


@dataclass
class Timer:
    delay: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeTimers:
    timers: list[Timer] = field(default_factory=list)

    def schedule(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(delay, callback)
        self.timers.append(timer)
        return timer

    def fire_all(self) -> None:
        due, self.timers = self.timers, []
        for timer in due:
            if not timer.cancelled:
                timer.callback()


def queue(timers: FakeTimers | None = None) -> KeyedQueue[str]:
    return KeyedQueue(rng=random.Random(7), schedule=(timers or FakeTimers()).schedule)


async def taken(work: KeyedQueue[str]) -> list[str]:
    """The keys ready now, in order (each taken and done)."""
    keys = []
    while (key := work.get_nowait()) is not None:
        keys.append(key)
        work.done(key)
    return keys


async def test_a_key_added_many_times_is_one_piece_of_work() -> None:
    work = queue()
    for key in ["a", "b", "a", "a", "b"]:
        work.add(key)
    assert await taken(work) == ["a", "b"]
    assert len(work) == 0


async def test_a_key_added_while_worked_on_comes_again_after_done_not_before() -> None:
    work = queue()
    work.add("a")
    key = await work.get()
    work.add("a")
    work.add("a")
    assert work.get_nowait() is None  # not handed to a second worker
    work.done(key)
    assert await taken(work) == ["a"]
    assert await taken(work) == []


async def test_a_retry_waits_for_its_backoff_and_an_add_does_not_bring_it_forward() -> None:
    timers = FakeTimers()
    work = queue(timers)
    work.add("a")
    key = await work.get()
    delay = work.retry(key)
    work.add("a")  # a newer state while the retry waits
    work.done(key)
    assert await taken(work) == []
    assert len(work) == 1  # waiting for its retry
    assert [timer.delay for timer in timers.timers] == [delay]
    timers.fire_all()
    assert await taken(work) == ["a"]


async def test_retry_after_is_honoured_within_bounds() -> None:
    timers = FakeTimers()
    work = queue(timers)
    for retry_after, expected in [(5.0, 5.0), (0.0, RETRY_FLOOR), (3600.0, RETRY_CAP)]:
        work.add("a")
        key = await work.get()
        assert work.retry(key, retry_after) == expected
        work.done(key)
        timers.fire_all()
        await taken(work)


async def test_the_backoff_grows_per_key_and_forget_starts_it_again() -> None:
    timers = FakeTimers()
    work = queue(timers)
    rng = random.Random(7)
    ceilings = []
    for failures in range(4):
        work.add("a")
        key = await work.get()
        delay = work.retry(key)
        ceilings.append(min(RETRY_CAP, RETRY_FLOOR * 2**failures))
        assert 0 <= delay <= ceilings[-1]
        assert delay == backoff_delay(failures, rng)
        work.done(key)
        timers.fire_all()
        await taken(work)
    assert work.failures("a") == 4
    assert work.failures("b") == 0  # per key
    work.forget("a")
    assert work.failures("a") == 0


async def test_drop_forgets_the_place_the_retry_and_the_failures() -> None:
    timers = FakeTimers()
    work = queue(timers)
    work.add("a")
    key = await work.get()
    work.retry(key)
    work.done(key)
    work.add("b")
    work.drop("a")
    work.drop("b")
    timers.fire_all()
    assert await taken(work) == []
    assert work.failures("a") == 0
    assert len(work) == 0
    work.add("b")  # added again after a drop: one piece of work, not two
    assert await taken(work) == ["b"]


async def test_serve_retries_a_handler_surprise_and_keeps_the_other_keys_going() -> None:
    timers = FakeTimers()
    work = queue(timers)
    seen: list[str] = []
    both = asyncio.Event()

    async def handle(key: str) -> None:
        seen.append(key)
        if len(seen) == 3:
            both.set()
        if key == "bad" and seen.count("bad") == 1:
            raise RuntimeError("surprise")

    workers = asyncio.create_task(work.serve(handle, workers=2, name="test"))
    work.add("bad")
    work.add("good")
    await asyncio.sleep(0)  # let the workers take both
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(seen) == ["bad", "good"]
    assert work.failures("bad") == 1
    timers.fire_all()
    await asyncio.wait_for(both.wait(), 5)
    assert seen.count("bad") == 2
    workers.cancel()
    with pytest.raises(asyncio.CancelledError):
        await workers


async def test_a_key_is_in_the_queue_while_queued_worked_on_or_waiting_for_its_retry() -> None:
    timers = FakeTimers()
    work = queue(timers)
    assert "a" not in work
    work.add("a")
    assert "a" in work
    key = await work.get()
    assert "a" in work
    work.retry(key)
    work.done(key)
    assert "a" in work
    timers.fire_all()
    assert await taken(work) == ["a"]
    assert "a" not in work
