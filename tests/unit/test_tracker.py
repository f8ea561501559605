"""The tracker's transition gate and heartbeat expiry, driven by a fake clock (no sleeps)."""

from __future__ import annotations

import pytest

from aggregator.decision.tracker import Observation, Tracker, TrackerSettings
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState, Source
from tests.conftest import FakeClock

S = ServeState
POD = PodKey("default", "raycluster-head")


def make(**settings: float) -> tuple[Tracker, FakeClock]:
    clock = FakeClock()
    tracker = Tracker(TrackerSettings(**settings), clock)  # type: ignore[arg-type]
    tracker.register(POD, uid="u1", node_name="n1")
    return tracker, clock


def feed(tracker: Tracker, clock: FakeClock, states: list[ServeState]) -> list[ServeState]:
    """Observe each state 0.5 s apart; returns the tracker's state after each."""
    seen = []
    for state in states:
        clock.advance(0.5)
        tracker.observe(POD, Observation(state, reason=state.name))
        seen.append(tracker.get(POD).state)  # type: ignore[union-attr]
    return seen


@pytest.mark.parametrize(
    ("settings", "observed", "expected"),
    [
        pytest.param({}, [S.SERVING], [S.SERVING], id="unknown-takes-first-observation"),
        pytest.param({}, [S.NO_PROXY], [S.NO_PROXY], id="unknown-takes-first-failure"),
        pytest.param(
            {}, [S.SERVING, S.DRAINING], [S.SERVING, S.DRAINING], id="failure-threshold-1-at-once"
        ),
        pytest.param(
            {"failure_threshold": 2},
            [S.SERVING, S.UNHEALTHY, S.SERVING, S.UNHEALTHY, S.NOT_READY],
            [S.SERVING, S.SERVING, S.SERVING, S.SERVING, S.NOT_READY],
            id="failure-threshold-2-needs-consecutive-failures",
        ),
        pytest.param(
            {},
            [S.SERVING, S.DRAINING, S.SERVING, S.SERVING],
            [S.SERVING, S.DRAINING, S.DRAINING, S.SERVING],
            id="hysteresis-success-threshold-2",
        ),
        pytest.param(
            {},
            [S.SERVING, S.DRAINING, S.SERVING, S.DRAINING, S.SERVING],
            [S.SERVING, S.DRAINING, S.DRAINING, S.DRAINING, S.DRAINING],
            id="flapping-proxy-stays-out",
        ),
        pytest.param(
            {"success_threshold": 1},
            [S.NOT_READY, S.SERVING],
            [S.NOT_READY, S.SERVING],
            id="success-threshold-1",
        ),
        pytest.param(
            {},
            [S.NOT_READY, S.DRAINING, S.NO_PROXY, S.UNHEALTHY],
            [S.NOT_READY, S.DRAINING, S.NO_PROXY, S.UNHEALTHY],
            id="moves-between-bad-states-at-once",
        ),
        pytest.param(
            {"failure_threshold": 3},
            [S.SERVING, S.DRAINING, S.NO_PROXY, S.UNHEALTHY],
            [S.SERVING, S.SERVING, S.SERVING, S.UNHEALTHY],
            id="different-failures-count-together",
        ),
    ],
)
def test_transition_table(
    settings: dict[str, float], observed: list[ServeState], expected: list[ServeState]
) -> None:
    tracker, clock = make(**settings)
    assert feed(tracker, clock, observed) == expected


def test_transitions_carry_old_new_source_reason_time() -> None:
    tracker, clock = make()
    clock.advance(1)
    first = tracker.observe(POD, Observation(S.SERVING, "success", 200, 0.003, Source.PUSH))
    assert first is not None
    assert (first.old, first.new, first.source, first.reason, first.at) == (
        S.UNKNOWN,
        S.SERVING,
        Source.PUSH,
        "success",
        clock.now,
    )
    assert first.label_changed
    assert tracker.observe(POD, Observation(S.SERVING)) is None  # no change, no transition
    drained = tracker.observe(POD, Observation(S.DRAINING, "This node is being drained."))
    assert drained is not None
    assert drained.label_changed
    moved = tracker.observe(POD, Observation(S.NO_PROXY))
    assert moved is not None
    assert not moved.label_changed  # false -> false


@pytest.mark.parametrize(
    ("silence", "expected"),
    [
        pytest.param(2.9, S.SERVING, id="within-ttl"),
        pytest.param(3.0, S.SILENT, id="at-ttl"),
        pytest.param(10.0, S.SILENT, id="long-silence"),
    ],
)
def test_heartbeat_expiry(silence: float, expected: ServeState) -> None:
    tracker, clock = make(heartbeat_ttl=3.0)
    tracker.observe(POD, Observation(S.SERVING))
    clock.advance(silence)
    transitions = tracker.expire()
    assert tracker.get(POD).state is expected  # type: ignore[union-attr]
    assert len(transitions) == (expected is S.SILENT)
    if transitions:
        assert transitions[0].source is None
        assert "No report for" in transitions[0].reason


def test_silent_pod_expires_once_and_returns_on_next_report() -> None:
    tracker, clock = make(heartbeat_ttl=3.0)
    tracker.observe(POD, Observation(S.SERVING))
    clock.advance(5)
    assert len(tracker.expire()) == 1
    clock.advance(5)
    assert tracker.expire() == []  # already silent: no second transition
    back = tracker.observe(POD, Observation(S.SERVING))
    assert back is not None
    assert (back.old, back.new) == (S.SILENT, S.SERVING)  # no hysteresis out of SILENT


def test_registered_pod_that_never_reports_goes_silent() -> None:
    tracker, clock = make(heartbeat_ttl=3.0)
    clock.advance(3)
    assert [t.new for t in tracker.expire()] == [S.SILENT]


def test_reports_keep_a_pod_fresh_and_expiry_scans_only_stale_pods() -> None:
    clock = FakeClock()
    tracker = Tracker(TrackerSettings(heartbeat_ttl=3.0), clock)
    keys = [PodKey("ns", f"pod-{i}") for i in range(100)]
    for key in keys:
        tracker.register(key)
        tracker.observe(key, Observation(S.SERVING))
    for _ in range(10):  # 10 s of heartbeats from every pod but the last ten
        clock.advance(1)
        for key in keys[:90]:
            tracker.observe(key, Observation(S.SERVING))
        tracker.expire()
    silent = {key for key in keys if tracker.get(key).state is S.SILENT}  # type: ignore[union-attr]
    assert silent == set(keys[90:])
    assert tracker.counts()[S.SERVING] == 90
    assert tracker.counts()[S.SILENT] == 10


def test_counts_follow_register_transitions_and_forget() -> None:
    tracker, clock = make()
    assert tracker.counts()[S.UNKNOWN] == 1
    tracker.observe(POD, Observation(S.SERVING))
    assert tracker.counts()[S.SERVING] == 1
    assert tracker.counts()[S.UNKNOWN] == 0
    tracker.forget(POD)
    assert sum(tracker.counts().values()) == 0
    assert POD not in tracker
    clock.advance(10)
    assert tracker.expire() == []  # forgotten pods do not expire


def test_register_same_name_new_uid_starts_over() -> None:
    tracker, _ = make()
    tracker.observe(POD, Observation(S.SERVING))
    tracker.register(POD, uid="u2")
    record = tracker.get(POD)
    assert record is not None
    assert (record.uid, record.state) == ("u2", S.UNKNOWN)
    assert tracker.counts()[S.SERVING] == 0


def test_detach_only_clears_the_stream_that_owns_the_pod() -> None:
    tracker, _ = make()
    tracker.observe(POD, Observation(S.SERVING), agent=1)
    tracker.detach([POD], 2)  # an older stream closing late
    assert tracker.get(POD).agent == 1  # type: ignore[union-attr]
    tracker.detach([POD], 1)
    assert tracker.get(POD).agent is None  # type: ignore[union-attr]


# -- pods kept alive by an open on-change stream --------------------------------------------


def test_an_open_on_change_stream_keeps_its_pod_alive_past_the_heartbeat_ttl() -> None:
    tracker, clock = make(heartbeat_ttl=3.0, kept_ttl=90.0)
    tracker.observe(POD, Observation(S.SERVING), agent=1, kept=True)
    record = tracker.get(POD)
    assert record is not None
    clock.advance(60)
    assert tracker.expire() == []
    assert record.state is S.SERVING
    assert tracker.agent_speaks(record, clock())
    clock.advance(30)  # the kept TTL: three resyncs missed
    [silent] = tracker.expire()
    assert silent.new is S.SILENT
    assert "No report or resync for 90.0s" in silent.reason


def test_a_heartbeat_stream_does_not_keep_its_pod_alive() -> None:
    tracker, clock = make(heartbeat_ttl=3.0, kept_ttl=90.0)
    tracker.observe(POD, Observation(S.SERVING), agent=1)  # an agent before 0.2.0
    record = tracker.get(POD)
    assert record is not None
    clock.advance(2)
    assert tracker.agent_speaks(record, clock())
    clock.advance(1)
    assert not tracker.agent_speaks(record, clock())
    assert [t.new for t in tracker.expire()] == [S.SILENT]


def test_when_a_kept_pods_stream_ends_it_gets_the_heartbeat_ttl_from_then() -> None:
    tracker, clock = make(heartbeat_ttl=3.0, kept_ttl=90.0)
    tracker.observe(POD, Observation(S.SERVING), agent=1, kept=True)
    clock.advance(50)  # long after its last report
    tracker.detach([POD], 1)
    record = tracker.get(POD)
    assert record is not None
    assert (record.agent, record.kept) == (None, False)
    assert not tracker.agent_speaks(record, clock())
    clock.advance(2.9)
    assert tracker.expire() == []  # time to reconnect, or for a pull
    clock.advance(0.1)
    [silent] = tracker.expire()
    assert silent.reason.startswith("Its agent's stream ended 3.0s ago")


def test_a_reconnected_agent_keeps_its_pod_again() -> None:
    tracker, clock = make(heartbeat_ttl=3.0, kept_ttl=90.0)
    tracker.observe(POD, Observation(S.SERVING), agent=1, kept=True)
    tracker.detach([POD], 1)
    clock.advance(1)
    tracker.observe(POD, Observation(S.SERVING), agent=2, kept=True)
    clock.advance(60)
    assert tracker.expire() == []
    record = tracker.get(POD)
    assert record is not None
    assert (record.agent, record.kept, record.agent_left_at) == (2, True, None)


def test_a_pull_of_a_kept_pod_leaves_it_kept() -> None:
    """A look (PANIC) may probe a pod whose agent is connected: it must not move the pod to
    the pull TTL, or a steady pod would go SILENT one pull TTL later."""
    tracker, clock = make(heartbeat_ttl=3.0, pull_ttl=8.0, kept_ttl=90.0)
    tracker.observe(POD, Observation(S.SERVING), agent=1, kept=True)
    clock.advance(1)
    tracker.observe(POD, Observation(S.SERVING, source=Source.PULL))
    clock.advance(30)
    assert tracker.expire() == []


def test_allow_silence_only_raises_the_kept_ttl() -> None:
    tracker, _ = make(kept_ttl=90.0)
    tracker.allow_silence(60.0)
    assert tracker.settings.kept_ttl == 90.0
    tracker.allow_silence(720.0)
    assert tracker.settings.kept_ttl == 720.0
