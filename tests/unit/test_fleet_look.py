"""The verdict of a look at the pods in service (aggregator/decision/fleet_look.py), as a table."""

from __future__ import annotations

import pytest

from aggregator.decision.fleet_look import LookTally, LookVerdict, Threshold
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

HALF = Threshold(share=0.5, min_pods=3)
KEYS = [PodKey("default", f"pod-{i}") for i in range(10)]


def tally(answers: dict[int, ServeState], sampled: int = 10, pool: int = 10) -> LookTally:
    result = LookTally(KEYS[:sampled], pool)
    for index, state in answers.items():
        result.record(KEYS[index], state)
    return result


def never_tracker_bad(key: PodKey) -> bool:
    return False


@pytest.mark.parametrize(
    ("answers", "known_bad", "tracked", "expected"),
    [
        # One pod failed (known); 9 others in service all answer healthy: lone at once.
        ({i: ServeState.SERVING for i in range(9)}, 1, 10, LookVerdict.LONE),
        # Nothing answered yet: 1 known + 9 that could all fail reach the threshold: wait.
        ({}, 1, 10, LookVerdict.UNDECIDED),
        # Four healthy answers: 1 + 5 unanswered could still reach 5 of 10: wait.
        ({i: ServeState.SERVING for i in range(4)}, 1, 10, LookVerdict.UNDECIDED),
        # Six healthy answers: at most 1 + 4 = 5 of 11 could fail: lone.
        ({i: ServeState.SERVING for i in range(6)}, 1, 11, LookVerdict.LONE),
        # Four timeouts seen: 1 + 4 = 5 of 10 reach the threshold: mass at once.
        ({i: ServeState.UNHEALTHY for i in range(4)}, 1, 10, LookVerdict.MASS),
        # A 503 or a refusal is the pod answering for itself: not a suspect failure.
        ({i: ServeState.NOT_READY for i in range(9)}, 1, 10, LookVerdict.LONE),
        ({i: ServeState.NO_PROXY for i in range(9)}, 1, 10, LookVerdict.LONE),
        # Every answer in: never undecided.
        (
            {i: ServeState.SILENT for i in range(2)}
            | {i: ServeState.SERVING for i in range(2, 10)},
            1,
            11,
            LookVerdict.LONE,
        ),
    ],
)
def test_verdict(
    answers: dict[int, ServeState], known_bad: int, tracked: int, expected: LookVerdict
) -> None:
    assert tally(answers).verdict(known_bad, tracked, HALF, never_tracker_bad) is expected


def test_too_few_failing_pods_are_never_mass() -> None:
    two = tally({0: ServeState.UNHEALTHY, 1: ServeState.UNHEALTHY}, sampled=2, pool=2)
    assert two.verdict(1, 3, HALF, never_tracker_bad) is LookVerdict.MASS  # 3 of 3
    one = tally({0: ServeState.UNHEALTHY}, sampled=1, pool=1)
    assert one.verdict(1, 2, HALF, never_tracker_bad) is LookVerdict.LONE  # 2 < --panic-min-pods


def test_a_sample_stands_for_its_pool() -> None:
    # 10 of 90 pods in service looked at; 4 of them time out: about 36 of the 90 fail, and with
    # the 10 known, 46 of 100 is under half; 5 of them would be 55: mass.
    four = tally(
        {i: ServeState.UNHEALTHY if i < 4 else ServeState.SERVING for i in range(10)}, pool=90
    )
    assert four.verdict(10, 100, HALF, never_tracker_bad) is LookVerdict.LONE
    five = tally(
        {i: ServeState.UNHEALTHY if i < 5 else ServeState.SERVING for i in range(10)}, pool=90
    )
    assert five.verdict(10, 100, HALF, never_tracker_bad) is LookVerdict.MASS


def test_a_sampled_pod_the_tracker_already_counts_is_not_counted_twice() -> None:
    # pod-0 answered a timeout and its pull made it UNHEALTHY in the tracker too.
    looked = tally({0: ServeState.UNHEALTHY} | {i: ServeState.SERVING for i in range(1, 10)})
    verdict = looked.verdict(2, 11, HALF, lambda key: key == KEYS[0])
    assert verdict is LookVerdict.LONE  # 2 of 11, not 3


def test_a_share_of_one_turns_panic_off() -> None:
    everything = tally({i: ServeState.UNHEALTHY for i in range(10)})
    verdict = everything.verdict(11, 11, Threshold(share=1.0, min_pods=3), never_tracker_bad)
    assert verdict is LookVerdict.LONE
