"""The agent's fallback decider (``node_agent.fallback.decider``, ``node_agent.fallback.rules``),
pure,
on a fake clock: when fallback begins and ends, the aggregator's rule and thresholds, fail
static on UNHEALTHY, writes only on change, only to gated pods for the condition, a stop the
moment a stream is accepted (pending writes dropped), which write settings are refused, and
which pods are an agent's own.

Each case of the main table is a story: steps (the pod as read, probe results, seconds passing,
the stream coming and going) and the writes the agent makes along them, each written as soon
as it is decided (what the API answers is what the pod then carries)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.rules import (
    PodFacts,
    WhosePods,
    Write,
    WriteRules,
    refusal,
)
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind
from servehealth_common.states import ServeState

SERVING = ServeState.SERVING
NOT_READY = ServeState.NOT_READY
DRAINING = ServeState.DRAINING
NO_PROXY = ServeState.NO_PROXY
UNHEALTHY = ServeState.UNHEALTHY

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
NODE = "node-1"
GATE = "ray.io/serve-proxy-healthy"
LABEL = "ray.io/serve"
AFTER = 10.0

CONDITION = WriteRules(condition_type=GATE)
LABELS = WriteRules(label_key=LABEL)
BOTH = WriteRules(label_key=LABEL, condition_type=GATE)
SIDECAR = WhosePods(pod=KEY, uid=UID)
DAEMONSET = WhosePods(node_name=NODE)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(
    *,
    label: str | None = None,
    condition: str | None = None,
    gated: bool = True,
    reason: str = "",
    **changes: Any,
) -> PodFacts:
    """The pod as read from the API (through PodFacts.from_pod, as the agent reads it)."""
    status: dict[str, Any] = {}
    if condition is not None:
        status["conditions"] = [{"type": GATE, "status": condition, "reason": reason}]
    raw = {
        "metadata": {
            "namespace": KEY.namespace,
            "name": KEY.name,
            "uid": UID,
            "resourceVersion": "10",
            "labels": {"ray.io/node-type": "worker"} | ({LABEL: label} if label else {}),
        },
        "spec": {
            "nodeName": NODE,
            "readinessGates": [{"conditionType": GATE}] if gated else [],
        },
        "status": status,
    }
    return replace(PodFacts.from_pod(raw), **changes)


@dataclass(frozen=True)
class Wait:
    seconds: float


UP, DOWN = "stream accepted", "stream ended"
FALLBACK = Wait(AFTER)  # no stream since the agent started: fallback begins


def story(
    steps: Sequence[object],
    *,
    rules: WriteRules | None = CONDITION,
    after: float = AFTER,
    own: WhosePods = SIDECAR,
) -> list[str]:
    """Play ``steps``; the writes made, as ``kind=value``, each one written at once."""
    clock = Clock()
    core = Fallback(after=after, own=own, flag_rules=rules, clock=clock)
    made: list[str] = []
    for step in steps:
        if isinstance(step, PodFacts):
            core.pod_seen(step)
        elif isinstance(step, ServeState):
            core.observe(KEY, step, "reason")
        elif isinstance(step, Wait):
            clock.now += step.seconds
            core.tick()
        elif step == UP:
            core.stream_up()
        elif step == DOWN:
            core.stream_down()
        else:
            raise AssertionError(step)
        for write in core.decide():
            assert core.still_wanted(write)
            made.append(f"{write.kind.value}={write.value}")
            core.finished(write, written=True)
    return made


@pytest.mark.parametrize(
    ("steps", "options", "writes"),
    [
        # When: only in fallback, counted from the agent's start or the last stream's end.
        pytest.param([pod(), SERVING, SERVING, Wait(9.9)], {}, [], id="not-before-fallback-after"),
        pytest.param(
            [pod(), SERVING, SERVING, Wait(9.9), Wait(0.1)],
            {},
            ["condition=True"],
            id="at-fallback-after-the-latest-results-decide",
        ),
        pytest.param([pod(), FALLBACK, SERVING, SERVING], {}, ["condition=True"], id="new-pod-in"),
        pytest.param(
            [pod(), UP, Wait(60), SERVING, SERVING], {}, [], id="never-while-a-stream-is-up"
        ),
        pytest.param(
            [pod(), UP, Wait(60), DOWN, Wait(9), SERVING, SERVING], {}, [], id="counted-from-end"
        ),
        pytest.param(
            [pod(), UP, Wait(60), DOWN, Wait(9), SERVING, SERVING, Wait(1)],
            {},
            ["condition=True"],
            id="fallback-after-the-stream-ended",
        ),
        pytest.param(
            [pod(), FALLBACK, SERVING, UP, SERVING, SERVING], {}, [], id="stops-on-stream"
        ),
        pytest.param([pod(), FALLBACK, SERVING, SERVING], {"after": 0}, [], id="after-0-is-off"),
        pytest.param([pod(), FALLBACK, SERVING, SERVING], {"rules": None}, [], id="no-rules"),
        # The aggregator's rule and thresholds (failure 1, success 2).
        pytest.param([pod(), FALLBACK, SERVING], {}, [], id="one-serving-is-not-enough"),
        pytest.param(
            [pod(condition="True"), FALLBACK, NOT_READY], {}, ["condition=False"], id="not-ready"
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, DRAINING], {}, ["condition=False"], id="draining"
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, NO_PROXY], {}, ["condition=False"], id="no-proxy"
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, NOT_READY],
            {"rules": replace(CONDITION, failure_threshold=2)},
            [],
            id="failure-threshold-2-one-is-not-enough",
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, NOT_READY, DRAINING],
            {"rules": replace(CONDITION, failure_threshold=2)},
            ["condition=False"],
            id="failure-threshold-2-any-non-serving-counts",
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, NOT_READY, SERVING, SERVING, SERVING],
            {},
            ["condition=False", "condition=True"],
            id="out-then-back-in-after-two",
        ),
        pytest.param(
            [pod(condition="False"), FALLBACK, SERVING, SERVING, SERVING],
            {"rules": replace(CONDITION, success_threshold=3)},
            ["condition=True"],
            id="success-threshold-3",
        ),
        # Fail static: UNHEALTHY holds what the pod carries, and breaks any run.
        pytest.param(
            [pod(condition="True"), FALLBACK, *[UNHEALTHY] * 5], {}, [], id="unhealthy-holds-in"
        ),
        pytest.param(
            [pod(condition="False"), FALLBACK, *[UNHEALTHY] * 5], {}, [], id="unhealthy-holds-out"
        ),
        pytest.param([pod(), FALLBACK, *[UNHEALTHY] * 5], {}, [], id="unhealthy-nothing-carried"),
        pytest.param(
            [pod(), FALLBACK, SERVING, UNHEALTHY, SERVING], {}, [], id="unhealthy-breaks-a-run"
        ),
        pytest.param(
            [pod(condition="True"), FALLBACK, NOT_READY, UNHEALTHY, NOT_READY],
            {"rules": replace(CONDITION, failure_threshold=2)},
            [],
            id="unhealthy-breaks-a-failure-run",
        ),
        # Only on change.
        pytest.param(
            [pod(condition="True"), FALLBACK, *[SERVING] * 4], {}, [], id="carries-true-already"
        ),
        pytest.param(
            [pod(condition="False"), FALLBACK, *[NOT_READY] * 4], {}, [], id="carries-false"
        ),
        pytest.param(
            [pod(), FALLBACK, *[NOT_READY] * 3], {}, ["condition=False"], id="absent-condition"
        ),
        pytest.param(
            [pod(), FALLBACK, *[NOT_READY] * 3], {"rules": LABELS}, [], id="absent-label-is-false"
        ),
        pytest.param(
            [pod(), FALLBACK, *[SERVING] * 4], {"rules": LABELS}, ["label=true"], id="label-true"
        ),
        pytest.param(
            [pod(label="true", condition="True"), FALLBACK, NOT_READY],
            {"rules": BOTH},
            ["label=false", "condition=False"],
            id="both",
        ),
        pytest.param(
            [pod(label="true", condition="False"), FALLBACK, SERVING, SERVING],
            {"rules": BOTH},
            ["condition=True"],
            id="both-only-what-differs",
        ),
        # Which pods, and which condition.
        pytest.param([pod(gated=False), FALLBACK, SERVING, SERVING], {}, [], id="not-gated"),
        pytest.param(
            [pod(gated=False), FALLBACK, SERVING, SERVING],
            {"rules": BOTH},
            ["label=true"],
            id="not-gated-label-only",
        ),
        pytest.param(
            [pod(overridden=True), FALLBACK, SERVING, SERVING], {}, [], id="manual-override"
        ),
        pytest.param(
            [pod(condition="True", reason=NO_PROXY_BY_DESIGN), FALLBACK, NO_PROXY, NO_PROXY],
            {},
            [],
            id="no-proxy-by-design-stays",
        ),
        pytest.param(
            [pod(condition="True", reason=NO_PROXY_BY_DESIGN), FALLBACK, NOT_READY],
            {},
            ["condition=False"],
            id="no-proxy-by-design-but-a-proxy-says-not-ready",
        ),
        pytest.param(
            [pod(uid="another"), FALLBACK, SERVING, SERVING], {}, [], id="sidecar-another-uid"
        ),
        pytest.param(
            [pod(key=PodKey("ray", "worker-1")), FALLBACK, SERVING, SERVING],
            {},
            [],
            id="sidecar-another-pod",
        ),
        pytest.param(
            [pod(), FALLBACK, SERVING, SERVING],
            {"own": DAEMONSET},
            ["condition=True"],
            id="daemonset-pod-on-its-node",
        ),
        pytest.param(
            [pod(node_name="node-2"), FALLBACK, SERVING, SERVING],
            {"own": DAEMONSET},
            [],
            id="daemonset-pod-on-another-node",
        ),
        pytest.param(
            [pod(), FALLBACK, SERVING, SERVING, pod(node_name="node-2"), NOT_READY],
            {"own": DAEMONSET},
            ["condition=True"],
            id="daemonset-pod-moved-away-is-forgotten",
        ),
        pytest.param(
            [SERVING, SERVING, FALLBACK, pod()], {}, ["condition=True"], id="read-after-probes"
        ),
    ],
)
def test_what_the_agent_writes(
    steps: Sequence[object], options: dict[str, Any], writes: list[str]
) -> None:
    assert story(steps, **options) == writes


def fallen_back(rules: WriteRules | None = CONDITION) -> tuple[Fallback, Clock]:
    clock = Clock()
    core = Fallback(after=AFTER, own=SIDECAR, flag_rules=rules, clock=clock)
    core.pod_seen(pod())
    clock.now += AFTER
    began = core.tick()
    assert began is not None
    assert began.new is FallbackPhase.FALLBACK
    assert began.seconds == AFTER
    return core, clock


def test_a_stream_drops_the_writes_not_yet_sent_and_ends_fallback_at_once() -> None:
    core, clock = fallen_back()
    core.observe(KEY, SERVING)
    core.observe(KEY, SERVING)
    [write] = core.decide()
    clock.now += 3
    assert core.seconds_in_fallback() == 3
    ended = core.stream_up()
    assert ended is not None
    assert (ended.old, ended.new, ended.seconds) == (
        FallbackPhase.FALLBACK,
        FallbackPhase.CONNECTED,
        3,
    )
    assert not core.still_wanted(write)
    assert core.seconds_in_fallback() == 0
    assert core.decide() == []
    # The next fallback decides afresh; the dropped write of the last one stays dropped.
    core.stream_down()
    clock.now += AFTER
    core.tick()
    [again] = core.decide()
    assert (again.value, again.epoch) == ("True", write.epoch + 1)
    assert core.still_wanted(again)
    assert not core.still_wanted(write)


def test_what_is_written_is_what_the_pod_should_carry_when_it_goes() -> None:
    """Level-triggered (issue 25): the writer asks next_write when its worker takes the pod,
    so a write decided earlier and no longer wanted is never sent; one that failed for good
    (a 403, say) is not wanted again for that value in this fallback."""
    core, _ = fallen_back()
    core.observe(KEY, SERVING)
    core.observe(KEY, SERVING)
    [write] = core.decide()
    assert core.next_write(KEY) == write
    core.observe(KEY, NOT_READY)  # the probes change their mind before it goes
    assert not core.still_wanted(write)
    [other] = core.decide()
    assert core.next_write(KEY) == other
    assert other.value == "False"
    core.finished(other, gave_up=True)  # a 403, say
    core.observe(KEY, NOT_READY)
    assert core.decide() == []
    assert core.next_write(KEY) is None


def test_the_answer_of_a_write_is_what_the_pod_carries() -> None:
    core, _ = fallen_back()
    core.observe(KEY, SERVING)
    core.observe(KEY, SERVING)
    [write] = core.decide()
    answer = pod(condition="True", resource_version="11")
    core.finished(write, answer=answer, written=True)
    assert core.facts(KEY) == answer
    core.pod_seen(pod(condition=None, resource_version="9"))  # a late watch event: older
    assert core.facts(KEY) == answer
    core.observe(KEY, SERVING)
    assert core.decide() == []


def test_a_pod_gone_is_forgotten_with_its_probe_results() -> None:
    core, _ = fallen_back()
    core.observe(KEY, SERVING)
    core.pod_gone(KEY)
    core.pod_seen(pod())
    core.observe(KEY, SERVING)
    assert core.decide() == []  # one result since: not enough


def test_settings_learned_from_an_aggregator_win_over_the_flags() -> None:
    clock = Clock()
    core = Fallback(after=AFTER, own=SIDECAR, flag_rules=LABELS, clock=clock)
    assert core.rules == LABELS
    assert core.learned(CONDITION) is None
    assert core.rules == CONDITION
    core.stream_up()
    core.stream_down()
    assert core.rules == CONDITION  # kept across reconnections
    assert core.learned(None) is None  # this aggregator does not allow fallback
    assert core.rules is None
    assert core.due() is None


def test_without_flags_only_an_aggregator_turns_fallback_on() -> None:
    clock = Clock()
    core = Fallback(after=AFTER, own=SIDECAR, flag_rules=None, clock=clock)
    assert core.due() is None
    core.learned(CONDITION)
    core.stream_up()
    core.stream_down()
    assert core.due() == clock.now + AFTER


@pytest.mark.parametrize(
    "rules",
    [
        pytest.param(WriteRules(label_key="ray.io/node-type"), id="ray.io/node-type"),
        pytest.param(WriteRules(label_key="ray.io/cluster"), id="ray.io/cluster"),
        pytest.param(WriteRules(label_key="ray.io/group"), id="ray.io/group"),
        pytest.param(WriteRules(label_key="ray.io/is-ray-node"), id="ray.io/is-ray-node"),
        pytest.param(WriteRules(label_key="ray.io/node-group"), id="ray.io/node-group"),
        pytest.param(WriteRules(label_key="app.kubernetes.io/name"), id="app.kubernetes.io"),
        pytest.param(WriteRules(label_key="kubernetes.io/hostname"), id="kubernetes.io"),
        pytest.param(WriteRules(label_key="node.kubernetes.io/x"), id="node.kubernetes.io"),
        pytest.param(WriteRules(label_key="pod-template-hash"), id="pod-template-hash"),
        pytest.param(WriteRules(label_key="ray-serve-health/leader"), id="leader-label"),
        pytest.param(WriteRules(label_key="not a key"), id="invalid-key"),
        pytest.param(WriteRules(label_key="a/b/c"), id="two-slashes"),
        pytest.param(WriteRules(label_key="-serve"), id="bad-first-character"),
        pytest.param(WriteRules(label_key="x" * 64), id="name-too-long"),
        pytest.param(WriteRules(condition_type="Ready"), id="condition-Ready"),
        pytest.param(WriteRules(condition_type="ContainersReady"), id="condition-ContainersReady"),
        pytest.param(WriteRules(condition_type="bad type"), id="invalid-condition"),
        pytest.param(WriteRules(), id="nothing"),
        pytest.param(replace(CONDITION, success_threshold=0), id="threshold-0"),
    ],
)
def test_crafted_settings_are_refused_and_nothing_is_written(rules: WriteRules) -> None:
    why = refusal(rules)
    assert why
    clock = Clock()
    core = Fallback(after=AFTER, own=SIDECAR, flag_rules=CONDITION, clock=clock)
    core.pod_seen(pod(label="true", condition="True"))
    assert core.learned(rules) == why
    core.stream_up()
    core.stream_down()
    for _ in range(3):
        core.observe(KEY, NOT_READY)
    clock.now += AFTER
    assert core.tick() is None  # no fallback at all: not even the flags' rules
    assert core.decide() == []


@pytest.mark.parametrize(
    "rules",
    [
        pytest.param(LABELS, id="ray.io/serve"),
        pytest.param(WriteRules(label_key="example.com/serve"), id="own-key"),
        pytest.param(WriteRules(label_key="serve"), id="no-prefix"),
        pytest.param(CONDITION, id="condition"),
        pytest.param(BOTH, id="both"),
    ],
)
def test_ordinary_settings_are_accepted(rules: WriteRules) -> None:
    assert refusal(rules) is None


def test_nothing_an_aggregator_sends_adds_a_pod() -> None:
    """Pods come only from pod_seen, checked against the agent's own identity."""
    clock = Clock()
    core = Fallback(after=AFTER, own=SIDECAR, flag_rules=None, clock=clock)
    assert core.pod_seen(pod(key=PodKey("ray", "other"))) is not None
    core.learned(BOTH)
    clock.now += AFTER
    core.tick()
    core.observe(PodKey("ray", "other"), SERVING)
    core.observe(PodKey("ray", "other"), SERVING)
    assert core.decide() == []
    assert core.own_pods() == 0


def test_a_write_names_what_it_writes() -> None:
    write = Write(KEY, UID, WriteKind.CONDITION, GATE, "True", SERVING, "success")
    assert str(write) == f"condition {GATE}=True on pod ray/worker-0"
