"""StreamRateLimit alone: the per-stream token bucket of --max-reports-per-second (fake clock)."""

from __future__ import annotations

import pytest

from aggregator.ingest.rate_limit import StreamRateLimit
from tests.conftest import FakeClock


def test_a_burst_of_rate_messages_passes_and_one_more_does_not() -> None:
    clock = FakeClock()
    limit = StreamRateLimit(5, clock)
    assert [limit.take() for _ in range(5)] == [True] * 5
    assert limit.take() is False


def test_the_budget_refills_with_time() -> None:
    clock = FakeClock()
    limit = StreamRateLimit(4, clock)
    for _ in range(4):
        assert limit.take()
    clock.advance(0.125)  # half a message earned: still nothing
    assert limit.take() is False
    clock.advance(0.625)  # 0.75 s since the refill: three messages, and no fourth
    assert [limit.take() for _ in range(4)] == [True, True, True, False]


def test_a_full_bucket_holds_no_more_than_rate() -> None:
    clock = FakeClock()
    limit = StreamRateLimit(4, clock)
    for _ in range(4):
        limit.take()
    clock.advance(60)  # a long quiet spell earns one bucket, not 240 messages
    assert [limit.take() for _ in range(4)] == [True] * 4
    assert limit.take() is False


def test_a_steady_stream_at_the_rate_is_never_refused() -> None:
    clock = FakeClock()
    limit = StreamRateLimit(50, clock)
    for _ in range(5_000):  # 100 s at exactly 50 messages per second
        clock.advance(0.02)
        assert limit.take()


@pytest.mark.parametrize("rate", [0, -1])
def test_a_rate_below_one_is_refused(rate: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StreamRateLimit(rate, FakeClock())
