"""How ``serve-health-cleanup`` judges the aggregator's Lease and retries API calls
(``aggregator/cleanup/kube.py``), on a fake clock: a Lease is live only if it is renewed while
watched for its duration (never judged by the time written in it); released, missing or stale
Leases hold nothing back; retries are for 429/5xx/409 and transport errors only, ``attempt
i/n``, honouring Retry-After, and give up after ``max_attempts``."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest

from aggregator.cleanup.kube import Retrier, live_holder
from aggregator.leader.elector import Lease, LeaseRecord
from servehealth_common.backoff import backoff_delay
from servehealth_common.kube.errors import (
    APIConflictError,
    APIError,
    APIForbiddenError,
    APINotFoundError,
    APIRetryableError,
)
from tests.conftest import FakeClock


class Store:
    """A Lease that ``renew`` (called at each read, with the time) may change."""

    def __init__(self, record: LeaseRecord | None, renew: Callable[[float], None] | None = None):
        self.record = record
        self.renew = renew
        self.reads: list[float] = []
        self.clock = FakeClock()

    def describe(self) -> str:
        return "ns/lease"

    async def get(self) -> Lease | None:
        self.reads.append(self.clock())
        if self.renew is not None:
            self.renew(self.clock())
        return None if self.record is None else Lease(self.record, "1")

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.clock.advance(seconds)


def held(holder: str = "aggregator-0_ab12", duration: int = 3, renew: str = "x") -> LeaseRecord:
    return LeaseRecord(holder, duration, renew, renew, 1)


async def holder_of(store: Store, watch: bool = True) -> str:
    retrier = Retrier(3, random.Random(1), store.sleep)
    return await live_holder(
        store, retrier, watch=watch, poll=0.5, clock=store.clock, sleep=store.sleep
    )


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(None, "", id="no lease"),
        pytest.param(held(holder=""), "", id="released (empty holder)"),
    ],
)
async def test_nobody_holds_it_without_waiting(record: LeaseRecord | None, expected: str) -> None:
    store = Store(record)
    assert await holder_of(store) == expected
    assert len(store.reads) == 1


async def test_a_renewed_lease_is_held() -> None:
    store = Store(held())

    def renew(now: float) -> None:
        if now >= 1001.0:  # the holder renews a second after the first read
            store.record = held(renew=f"t{now}")

    store.renew = renew
    assert await holder_of(store) == "aggregator-0_ab12"
    assert store.clock() - 1000.0 < 3, "answered as soon as the renewal was seen"


async def test_a_lease_not_renewed_for_its_duration_is_expired_whatever_it_says() -> None:
    # The renewTime written in it could be "now" by a skewed clock: only change counts.
    store = Store(held(duration=3, renew="2999-01-01T00:00:00.000000Z"))
    assert await holder_of(store) == ""
    assert store.clock() - 1000.0 >= 3, "watched for the whole lease duration"


async def test_a_lease_released_while_watched_is_free() -> None:
    store = Store(held())

    def release(now: float) -> None:
        if now >= 1001.0:  # the aggregator stops (SIGTERM) a second after the first read
            store.record = held(holder="", duration=1)

    store.renew = release
    assert await holder_of(store) == ""
    assert len(store.reads) == 3  # 1000, 1000.5, 1001


async def test_without_watching_whoever_it_names() -> None:
    store = Store(held(duration=15))
    assert await holder_of(store, watch=False) == "aggregator-0_ab12"
    assert len(store.reads) == 1


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(APIRetryableError("x: HTTP 500: boom", 500), id="500"),
        pytest.param(APIRetryableError("x: HTTP 429: slow down", 429), id="429"),
        pytest.param(APIRetryableError("x: ConnectionResetError"), id="connection"),
        pytest.param(APIConflictError("x: HTTP 409: conflict", 409), id="409"),
    ],
)
async def test_retried_errors(error: APIError, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    failures = [error, error]

    async def call() -> str:
        if failures:
            raise failures.pop()
        return "ok"

    async def sleep(seconds: float) -> None:
        clock.advance(seconds)

    with caplog.at_level(logging.WARNING):
        assert await Retrier(5, random.Random(1), sleep).call(call) == "ok"
    assert [r.getMessage().split("(attempt ")[1][:3] for r in caplog.records] == ["1/5", "2/5"]
    # The writers' backoff (full jitter): at most 0.2 s, then at most 0.4 s; the same draws.
    rng = random.Random(1)
    assert clock() - 1000.0 == pytest.approx(backoff_delay(0, rng) + backoff_delay(1, rng))
    assert clock() - 1000.0 <= 0.2 + 0.4


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(APINotFoundError("x: HTTP 404", 404), id="404"),
        pytest.param(APIForbiddenError("x: HTTP 403", 403), id="403"),
    ],
)
async def test_errors_not_worth_retrying_surface_at_once(error: APIError) -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise error

    async def sleep(seconds: float) -> None:
        raise AssertionError("no retry expected")

    with pytest.raises(type(error)):
        await Retrier(5, random.Random(1), sleep).call(call)
    assert calls == 1


async def test_retries_stop_after_max_attempts_and_honour_retry_after() -> None:
    waits: list[float] = []

    async def call() -> None:
        raise APIRetryableError("x: HTTP 429", 429, retry_after=7.0)

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    with pytest.raises(APIRetryableError):
        await Retrier(3, random.Random(1), sleep).call(call)
    assert waits == [7.0, 7.0]
