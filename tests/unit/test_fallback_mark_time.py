"""The time of an agent's fallback mark (issue 26, bug 6): the annotation beside a label an agent
wrote has microseconds, as the Lease's ``renewTime`` it is compared with at a take-over; a mark
with whole seconds only (a condition's ``lastTransitionTime``, which the API server keeps so, or
an older agent's annotation) is compared at that resolution (``written_after``)."""

from __future__ import annotations

import datetime
import re

import pytest

from node_agent.fallback.bodies import event_body, write_body
from node_agent.fallback.rules import Write
from servehealth_common import fallback_marks
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.pod_writes.times import micro_time
from servehealth_common.states import ServeState

UTC = datetime.UTC
WHEN = datetime.datetime(2026, 12, 1, 20, 31, 7, 123456, tzinfo=UTC)
RENEWED = datetime.datetime(2026, 12, 1, 20, 31, 7, 500000, tzinfo=UTC)


def write(kind: WriteKind) -> Write:
    name = "ray.io/serve" if kind is WriteKind.LABEL else "ray.io/serve-proxy-healthy"
    value = "false" if kind is WriteKind.LABEL else "False"
    return Write(PodKey("ray", "w"), "uid", kind, name, value, ServeState.NOT_READY, "503")


def test_the_annotation_has_microseconds() -> None:
    body = write_body(write(WriteKind.LABEL), "ray/w (sidecar)", WHEN)
    value = body["metadata"]["annotations"][fallback_marks.ANNOTATION]
    assert value == "2026-12-01T20:31:07.123456Z ray/w (sidecar)"
    assert re.fullmatch(r"\S+\.\d{6}Z", fallback_marks.annotation_time(value))


def test_the_condition_and_the_event_keep_whole_seconds() -> None:
    condition = write_body(write(WriteKind.CONDITION), "w", WHEN)["status"]["conditions"][0]
    assert condition["lastTransitionTime"] == "2026-12-01T20:31:07Z"
    event = event_body(write(WriteKind.CONDITION), "w", WHEN)
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-12-01T20:31:07Z"


def at(seconds: int, micro: int = 0) -> datetime.datetime:
    return datetime.datetime(2026, 12, 1, 20, 31, seconds, micro, tzinfo=UTC)


@pytest.mark.parametrize(
    ("mark", "after"),
    [
        pytest.param(at(7, 700000), True, id="micro-after"),
        pytest.param(at(7, 300000), False, id="micro-before"),
        pytest.param(at(7, 500000), False, id="micro-equal"),
        pytest.param(at(7), True, id="whole-second-of-the-renewal"),
        pytest.param(at(8), True, id="whole-second-after"),
        pytest.param(at(6), False, id="whole-second-before"),
    ],
)
def test_written_after_compares_like_with_like(mark: datetime.datetime, after: bool) -> None:
    assert fallback_marks.written_after(mark, RENEWED) is after


def test_micro_time_is_the_leases_format() -> None:
    """One function for the agents' marks and the aggregator's Lease (they are compared)."""
    from aggregator.leader import elector

    assert elector.micro_time is micro_time
    assert micro_time(WHEN) == "2026-12-01T20:31:07.123456Z"
