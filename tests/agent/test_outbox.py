"""The outbox (what is due) and how the stream reads the aggregator's settings."""

from __future__ import annotations

import random

import pytest

from node_agent.flags import AgentFlags
from node_agent.outbox import Outbox
from node_agent.stream import MIN_HEARTBEAT_INTERVAL, ReportClient
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.probe import ProbeResult
from servehealth_common.states import ServeState

S = ServeState


def result(state: ServeState) -> ProbeResult:
    return ProbeResult(state, state.name, 200, 0.001)


def due(outbox: Outbox) -> list[ServeState]:
    return [probe.state for _, probe in outbox.take(everything=False)]


def test_a_change_is_due_with_the_confirmations_that_follow_it() -> None:
    outbox = Outbox()
    outbox.reports_per_change = 3
    outbox.put("a", None, result(S.SERVING), changed=True)
    assert due(outbox) == [S.SERVING]
    for _ in range(2):  # the next two results confirm it
        outbox.put("a", None, result(S.SERVING), changed=False)
        assert outbox.changed.is_set()
        outbox.changed.clear()
        assert due(outbox) == [S.SERVING]
    outbox.put("a", None, result(S.SERVING), changed=False)  # then nothing until a resync
    assert not outbox.changed.is_set()
    assert due(outbox) == []
    assert [probe.state for _, probe in outbox.take(everything=True)] == [S.SERVING]


def test_a_new_change_restarts_the_confirmations() -> None:
    outbox = Outbox()
    outbox.reports_per_change = outbox.reports_per_failure = 2
    outbox.put("a", None, result(S.SERVING), changed=True)
    outbox.put("a", None, result(S.NOT_READY), changed=True)
    assert due(outbox) == [S.NOT_READY]  # the SERVING never sent: replaced
    outbox.put("a", None, result(S.NOT_READY), changed=False)
    assert due(outbox) == [S.NOT_READY]
    outbox.put("a", None, result(S.NOT_READY), changed=False)
    assert due(outbox) == []


def test_confirmations_follow_the_direction_of_the_change() -> None:
    """--success-threshold 2, --failure-threshold 1: a pod that fails needs one report, one
    that comes back two."""
    outbox = Outbox()
    outbox.reports_per_change, outbox.reports_per_failure = 2, 1
    outbox.put("a", None, result(S.SERVING), changed=True)
    outbox.take(everything=False)
    outbox.put("a", None, result(S.NOT_READY), changed=True)
    assert due(outbox) == [S.NOT_READY]
    outbox.put("a", None, result(S.NOT_READY), changed=False)
    assert due(outbox) == []  # no confirmation of a failure
    outbox.put("a", None, result(S.SERVING), changed=True)
    assert due(outbox) == [S.SERVING]
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert due(outbox) == [S.SERVING]  # its confirmation
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert due(outbox) == []


def test_a_result_that_replaces_one_not_sent_yet_spends_no_confirmation() -> None:
    """Two results of a pod before the stream takes them (a DaemonSet agent's stream waits
    50 ms for the rest of a round) are sent as one report, the latest: the confirmation still
    follows. It used to be spent on the result replaced, and the aggregator, which needs two
    SERVING reports in a row, kept the pod out until the next resync (bench.endpoints: 6 of 64
    healed faults back after 17-29 s instead of ~1 s)."""
    outbox = Outbox()
    outbox.reports_per_change, outbox.reports_per_failure = 2, 1
    outbox.put("a", None, result(S.SERVING), changed=True)
    outbox.put("a", None, result(S.SERVING), changed=False)  # before the stream took it
    assert due(outbox) == [S.SERVING]  # one report
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert outbox.changed.is_set()
    assert due(outbox) == [S.SERVING]  # and its confirmation
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert due(outbox) == []


def test_without_confirmations_only_changes_are_due() -> None:
    outbox = Outbox()  # reports_per_change 1: heartbeats carry the rest
    outbox.put("a", None, result(S.SERVING), changed=True)
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert due(outbox) == [S.SERVING]
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert due(outbox) == []


def test_a_discarded_pod_owes_nothing() -> None:
    outbox = Outbox()
    outbox.reports_per_change = 2
    outbox.put("a", None, result(S.SERVING), changed=True)
    outbox.discard("a")
    outbox.put("a", None, result(S.SERVING), changed=True)  # back: new again
    outbox.put("a", None, result(S.SERVING), changed=False)
    assert len(due(outbox)) == 1
    assert "a" in outbox


def client() -> ReportClient:
    settings = AgentFlags(aggregator="127.0.0.1:1", token_file="")
    hello = pb.Hello(mode=pb.AGENT_MODE_SIDECAR)
    return ReportClient(settings, hello, Outbox(), who="test", rng=random.Random(1))


def settings_message(
    heartbeat: float, resync: float = 0, per_change: int = 0, per_failure: int = 0
) -> object:
    message = pb.AgentSettings(reports_per_change=per_change, reports_per_failure=per_failure)
    message.heartbeat_interval.FromNanoseconds(round(heartbeat * 1e9))
    if resync:
        message.resync_interval.FromNanoseconds(round(resync * 1e9))
    return pb.AggregatorMessage(settings=message)


def test_the_hello_says_the_agent_reports_on_change() -> None:
    stream = client()
    assert stream._hello.hello.reports_on_change


def test_an_aggregator_that_gives_a_resync_interval_gets_changes_and_resyncs() -> None:
    stream = client()
    stream._apply(settings_message(1.0, resync=240.0, per_change=2, per_failure=1))
    assert (stream.on_change, stream.full_send_interval) == (True, 240.0)
    assert (stream.outbox.reports_per_change, stream.outbox.reports_per_failure) == (2, 1)


def test_without_reports_per_failure_failures_take_reports_per_change() -> None:
    stream = client()
    stream._apply(settings_message(1.0, resync=240.0, per_change=3))
    assert (stream.outbox.reports_per_change, stream.outbox.reports_per_failure) == (3, 3)


@pytest.mark.parametrize("heartbeat", [1.0, 0.000001])
def test_an_aggregator_before_0_2_gets_heartbeats(heartbeat: float) -> None:
    stream = client()
    stream._apply(settings_message(3.0, resync=240.0, per_change=2))
    stream._apply(settings_message(heartbeat))  # an older aggregator, after a failover
    assert not stream.on_change
    assert stream.full_send_interval == max(heartbeat, MIN_HEARTBEAT_INTERVAL)
    assert (stream.outbox.reports_per_change, stream.outbox.reports_per_failure) == (1, 1)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, 3.0),  # the default: above one turn (0.75 + 2 x 0.5 + 0.1) plus a second
        ({"interval": 3.0, "probe_timeout": 1.0, "confirm_delay": 0.2}, 6.2),
        ({"stall_timeout": 10.0}, 10.0),
        ({"stall_timeout": 0.0}, 0.0),  # off
    ],
)
def test_the_stall_timeout_never_falls_within_a_probe_turn(
    flags: dict[str, float], expected: float
) -> None:
    settings = AgentFlags(aggregator="127.0.0.1:1", **flags)  # type: ignore[arg-type]
    assert settings.effective_stall_timeout == pytest.approx(expected)
