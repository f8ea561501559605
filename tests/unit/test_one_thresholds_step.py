"""Both programs count the thresholds the same way (issue 25, "one thresholds step"): fed the
same probe results, the aggregator's tracker and an agent's fallback decider take a pod out of
service, and put it back, at the same observation. Both count with
:mod:`servehealth_common.pod_writes.streak`.

The two differences that remain are deliberate, and asserted as such:

- UNHEALTHY: the aggregator counts it out of service; an agent in fallback fails static (it
  decides nothing, and breaks the run);
- a first observation: the aggregator takes the first observation of a pod it knows nothing
  of at once; an agent counts it like any.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from aggregator.decision.tracker import Observation, Tracker, TrackerSettings
from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.pod_writes.streak import (
    NO_RUN,
    Run,
    Thresholds,
    accepted,
    advance,
    side,
    step,
)
from servehealth_common.states import ServeState, label_value

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
LABEL = "ray.io/serve"
AFTER = 10.0
S, N, D, P, U = (
    ServeState.SERVING,
    ServeState.NOT_READY,
    ServeState.DRAINING,
    ServeState.NO_PROXY,
    ServeState.UNHEALTHY,
)
THRESHOLDS = [(1, 1), (1, 2), (2, 2), (2, 3), (3, 1)]


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def aggregator_labels(
    start: ServeState | None, states: Sequence[ServeState], failure: int, success: int
) -> list[str]:
    """The label the aggregator wants after each observation, from a pod in ``start``
    (as seeded from what it carries; None: just registered, nothing known)."""
    clock = Clock()
    tracker = Tracker(TrackerSettings(failure_threshold=failure, success_threshold=success), clock)
    tracker.register(KEY, UID, "node-1")
    if start is not None:
        tracker.seed(KEY, start)
    labels = []
    for state in states:
        clock.now += 0.1
        tracker.observe(KEY, Observation(state))
        record = tracker.get(KEY)
        assert record is not None
        labels.append(label_value(record.state))
    return labels


def agent_labels(
    carried: str, states: Sequence[ServeState], failure: int, success: int
) -> list[str]:
    """The label an agent in fallback leaves on its pod after each probe result, from a pod
    that carries ``carried`` (each write it decides succeeds)."""
    clock = Clock()
    rules = WriteRules(LABEL, "", failure_threshold=failure, success_threshold=success)
    core = Fallback(after=AFTER, own=WhosePods(pod=KEY, uid=UID), flag_rules=rules, clock=clock)
    core.pod_seen(PodFacts(KEY, UID, labels={LABEL: carried}, resource_version="1"))
    clock.now += AFTER
    core.tick()
    labels = []
    for state in states:
        core.observe(KEY, state, "reason")
        for write in core.decide():
            core.finished(write, written=True)
        facts = core.facts(KEY)
        assert facts is not None
        labels.append(facts.carried(WriteKind.LABEL, LABEL) or "false")
    return labels


SEQUENCES = list(itertools.product((S, N, D, P), repeat=5))


@pytest.mark.parametrize(("failure", "success"), THRESHOLDS)
@pytest.mark.parametrize("start", [S, N])
def test_both_programs_change_sides_at_the_same_observation(
    start: ServeState, failure: int, success: int
) -> None:
    """Every sequence of five results (SERVING, NOT_READY, DRAINING, NO_PROXY) from a pod
    in service, or out of it."""
    for states in SEQUENCES:
        aggregator = aggregator_labels(start, states, failure, success)
        agent = agent_labels(label_value(start), states, failure, success)
        assert agent == aggregator, (states, failure, success)


@pytest.mark.parametrize(
    ("start", "states", "failure", "success", "aggregator", "agent"),
    [
        # The aggregator takes a pod out on UNHEALTHY past failure_threshold...
        (S, [U], 1, 2, ["false"], ["true"]),
        (S, [N, U], 2, 2, ["true", "false"], ["true", "true"]),
        # ... where an agent keeps what the pod carries, and starts its count again.
        (S, [N, U, N], 2, 2, ["true", "false", "false"], ["true", "true", "true"]),
        (S, [N, U, N, N], 2, 2, ["true", "false", "false", "false"], ["true"] * 3 + ["false"]),
        # Both: UNHEALTHY never puts a pod back; on the side out of service it breaks a run
        # back in (the aggregator: a move to UNHEALTHY; an agent: a result that decides nothing).
        (N, [S, U, S], 1, 2, ["false"] * 3, ["false"] * 3),
    ],
)
def test_unhealthy_counts_out_of_service_for_the_aggregator_only(
    start: ServeState,
    states: list[ServeState],
    failure: int,
    success: int,
    aggregator: list[str],
    agent: list[str],
) -> None:
    assert aggregator_labels(start, states, failure, success) == aggregator
    assert agent_labels(label_value(start), states, failure, success) == agent


def test_the_aggregator_takes_a_first_observation_at_once_an_agent_counts_it() -> None:
    assert aggregator_labels(None, [S, S], 1, 2) == ["true", "true"]
    assert agent_labels("false", [S, S], 1, 2) == ["false", "true"]


def test_the_step() -> None:
    thresholds = Thresholds(failure=1, success=2)
    assert step(NO_RUN, True, thresholds) == (Run(True, 1), False)
    assert step(Run(True, 1), True, thresholds) == (Run(True, 2), True)
    assert step(Run(True, 5), False, thresholds) == (Run(False, 1), True)
    assert step(Run(True, 5), None, thresholds) == (NO_RUN, False)
    assert step(NO_RUN, True, thresholds, at_once=True) == (Run(True, 1), True)
    assert step(NO_RUN, None, thresholds, at_once=True) == (NO_RUN, False)
    assert advance(Run(False, 2), False) == Run(False, 3)
    assert not accepted(NO_RUN, thresholds)
    assert accepted(Run(False, 1), thresholds)


@pytest.mark.parametrize("state", list(ServeState))
def test_the_sides(state: ServeState) -> None:
    """SERVING alone is in service; the aggregator counts every other state out of it, an
    agent only what its probes say of a proxy (not UNHEALTHY)."""
    assert side(state, unhealthy_decides=True) is (state is S)
    expected = {S: True, N: False, D: False, P: False}.get(state)
    assert side(state, unhealthy_decides=False) is expected
