"""When a Report stream is acked (``ReportStream.ack_due``): acks are cumulative, and every ack
is a write that costs the aggregator as much as a read."""

from __future__ import annotations

from typing import Any

import pytest

from aggregator.ingest.rate_limit import StreamRateLimit
from aggregator.ingest.report_stream import ReportStream
from aggregator.metrics import Metrics


def stream(on_change: bool, ack_every: int = 10) -> ReportStream:
    core: Any = None  # acks never ask the core
    return ReportStream(
        core,
        Metrics("acks"),
        stream_id=1,
        own=None,
        node=None,
        rate_limit=StreamRateLimit(50, lambda: 0.0),
        max_pods=10,
        ack_every=ack_every,
        on_change=on_change,
    )


@pytest.mark.parametrize("on_change", [False, True])
def test_one_ack_every_ack_every_messages(on_change: bool) -> None:
    reports = stream(on_change)
    acks = [reports.ack_due(changed=False) for _ in range(30)]
    assert [i for i, due in enumerate(acks) if due] == [9, 19, 29]


def test_a_heartbeat_agent_gets_an_ack_for_each_change() -> None:
    reports = stream(on_change=False)
    assert reports.ack_due(changed=True)
    assert not reports.ack_due(changed=False)


def test_an_on_change_agent_is_acked_every_few_messages_only() -> None:
    """Its messages are changes already: an ack each would double the aggregator's writes."""
    reports = stream(on_change=True)
    assert [reports.ack_due(changed=True) for _ in range(10)] == [False] * 9 + [True]
