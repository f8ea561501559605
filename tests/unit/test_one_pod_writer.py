"""Both programs write a pod the same way (issue 25, "one pod writer for both programs"): for
the same pod, as read from the API, and the same state, an agent in fallback decides a write
exactly when the aggregator's writer does, and sends the same patch, but for what marks who
wrote it.

The differences that remain are deliberate, and asserted as such:

- an agent's label write carries its mark (``ray-serve-health/fallback-write``) and its
  condition the reason ``NoAggregator`` and a message naming the agent; the aggregator writes
  ``ServeProxyServing``/``ServeProxyNotServing`` (and removes an agent's mark);
- an agent's write is conditional on the pod's resourceVersion it was decided on (many writers
  who cannot see each other); the aggregator's is not (one writer, which re-reads on a 409);
- a condition ``NoProxyByDesign`` is left alone by an agent whose probe sees NO_PROXY: only the
  aggregator has the Serve controller's view that says a proxy is meant there or not (unless a
  manual override decides, for both).

A manual override is written the same by both: its label, whatever the health, for a pod read
from the API and for a sidecar's pod as the aggregator tells it (``PodView``).
"""

from __future__ import annotations

import copy
import datetime
import itertools
from typing import Any

import pytest

from aggregator.ingest.wire import pod_view_message
from aggregator.kube.pod_view import pod_view
from aggregator.kube.pods import KubePod, parse_pod
from aggregator.kube.writer import Writer, WriterSettings
from aggregator.metrics import Metrics
from node_agent.fallback.bodies import write_body
from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from node_agent.fallback.wire import facts_from_view
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common import fallback_marks
from servehealth_common.override import ANNOTATION, NONE, Override
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.desired import Desired, Known, desired
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind
from servehealth_common.states import ServeState, label_value

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
LABEL = "ray.io/serve"
GATE = "ray.io/serve-proxy-healthy"
WHO = "ray/worker-0 (sidecar)"
WHEN = datetime.datetime(2026, 12, 2, 7, 30, 1, 250000, tzinfo=datetime.UTC)
AFTER = 10.0

LABELS = (None, "true", "false")
#: The condition as the API holds it: (status, reason); None: no condition.
CONDITIONS = (
    None,
    ("True", "ServeProxyServing"),
    ("False", "ServeProxyNotServing"),
    ("True", NO_PROXY_BY_DESIGN),
    ("False", fallback_marks.CONDITION_REASON),
)
STATES = (ServeState.SERVING, ServeState.NOT_READY, ServeState.DRAINING, ServeState.NO_PROXY)
#: The override annotation (None: none; "maintenance" is ignored by both).
OVERRIDES = (None, "in-service", "out-of-service", "maintenance")


def raw_pod(
    label: str | None, condition: tuple[str, str] | None, override: str | None = None
) -> dict[str, Any]:
    conditions = [] if condition is None else [{"status": condition[0], "reason": condition[1]}]
    return {
        "metadata": {
            "namespace": KEY.namespace,
            "name": KEY.name,
            "uid": UID,
            "resourceVersion": "42",
            "labels": {"ray.io/node-type": "worker"} | ({LABEL: label} if label else {}),
            "annotations": {} if override is None else {ANNOTATION: override},
        },
        "spec": {"nodeName": "node-1", "readinessGates": [{"conditionType": GATE}]},
        "status": {"conditions": [{"type": GATE, **c} for c in conditions]},
    }


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def agent_patches(
    raw: dict[str, Any], state: ServeState, *, told: bool = False
) -> dict[WriteKind, dict[str, Any]]:
    """What an agent in fallback sends for ``raw`` in ``state`` (thresholds of 1), having read
    the pod, or been ``told`` it by the aggregator (a sidecar's ``PodView``)."""
    clock = Clock()
    rules = WriteRules(LABEL, GATE, failure_threshold=1, success_threshold=1)
    core = Fallback(after=AFTER, own=WhosePods(pod=KEY, uid=UID), flag_rules=rules, clock=clock)
    facts = told_pod(raw) if told else PodFacts.from_pod(raw)
    assert facts is not None
    core.pod_seen(facts)
    core.observe(KEY, state, "reason")
    clock.now += AFTER
    core.tick()
    return {write.kind: write_body(write, WHO, WHEN) for write in core.decide()}


def told_pod(raw: dict[str, Any]) -> PodFacts | None:
    """The pod as the aggregator tells it to its sidecar, over the wire, read back."""
    message = pod_view_message(pod_view(parse_pod(raw, 8000), LABEL, GATE))
    writes = pb.WriteSettings(label_key=LABEL, condition_type=GATE)
    return facts_from_view(pb.PodView.FromString(message.SerializeToString()), writes)


class RecordingApi:
    def __init__(self) -> None:
        self.patches: dict[WriteKind, dict[str, Any]] = {}

    async def patch_pod(self, key: PodKey, body: dict[str, Any]) -> dict[str, Any]:
        self.patches[WriteKind.LABEL] = body
        return {}

    async def patch_pod_status(self, key: PodKey, body: dict[str, Any]) -> dict[str, Any]:
        self.patches[WriteKind.CONDITION] = body
        return {}


class Copies:
    """The registry as the writer reads it: the one pod, and what it should carry (the health's
    label ``health``, with ``override`` and the condition's ``message``)."""

    def __init__(self, pod: KubePod, health: str, message: str = "reason") -> None:
        self.pod = pod
        self.health = health
        self.override = NONE
        self.message = message

    def desired(self, key: PodKey) -> Desired:
        writable = self.pod.writable
        known = Known(
            self.health,
            writes_label=True,
            writes_condition=True,
            gated=GATE in writable.readiness_gates,
            override=self.override,
            label=writable.carried(WriteKind.LABEL, LABEL),
            condition=writable.carried(WriteKind.CONDITION, GATE),
            message=self.message,
        )
        return desired(known)

    def marked(self, key: PodKey) -> bool:
        return self.pod.writable.fallback_annotated

    def written(self, key: PodKey, kind: WriteKind, value: str, body: dict[str, Any]) -> None:
        pass

    async def refresh(self, key: PodKey) -> None:
        pass


async def work_once(writer: Writer) -> None:
    """What one of the writer's workers does with the pod queued, if one is (as
    ``KeyedQueue.serve``; nothing is queued where the pod carries what it should)."""
    key = writer._queue.get_nowait()
    if key is None:
        return
    assert key == KEY
    await writer._reconcile(key)
    writer._queue.done(key)


async def aggregator_patches(
    raw: dict[str, Any], state: ServeState
) -> dict[WriteKind, dict[str, Any]]:
    """What the aggregator's writer sends for ``raw`` in ``state`` (no serve view: a NO_PROXY
    is not judged by design)."""
    api = RecordingApi()
    settings = WriterSettings(LABEL, GATE, qps=1000, burst=1000, concurrency=1)
    copies = Copies(parse_pod(raw, 8000), label_value(state))
    copies.override = copies.pod.writable.override
    writer = Writer(api, settings, Metrics("test"), copies)
    writer.enqueue(KEY, copies.desired(KEY))
    await work_once(writer)
    assert writer.pending == 0  # written, nothing left to retry
    return api.patches


def without_the_writers_marks(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` less what says who wrote it, and an agent's precondition (deliberate)."""
    body = copy.deepcopy(body)
    metadata = body.get("metadata", {})
    metadata.pop("resourceVersion", None)
    metadata.pop("annotations", None)
    if not metadata:
        body.pop("metadata", None)
    for condition in body.get("status", {}).get("conditions", []):
        condition.pop("reason")
        condition.pop("message")
        condition.pop("lastTransitionTime")
    return body


CASES = [
    pytest.param(
        label,
        condition,
        state,
        override,
        told,
        id=f"label={label}-condition={condition}-{state.name}-{override}-{told=}",
    )
    for label, condition, state, override, told in itertools.product(
        LABELS, CONDITIONS, STATES, OVERRIDES, (False, True)
    )
]


@pytest.mark.parametrize(("label", "condition", "state", "override", "told"), CASES)
async def test_both_programs_write_the_same(
    label: str | None,
    condition: tuple[str, str] | None,
    state: ServeState,
    override: str | None,
    told: bool,
) -> None:
    raw = raw_pod(label, condition, override)
    agent = agent_patches(raw, state, told=told)
    aggregator = await aggregator_patches(raw, state)
    honoured = Override.parse(override).value is not None
    if state is ServeState.NO_PROXY and condition == ("True", NO_PROXY_BY_DESIGN) and not honoured:
        # Only the aggregator knows whether no proxy is meant there: an agent leaves it.
        assert WriteKind.CONDITION in aggregator
        assert WriteKind.CONDITION not in agent
        aggregator.pop(WriteKind.CONDITION)
    assert agent.keys() == aggregator.keys()
    for kind, body in agent.items():
        assert without_the_writers_marks(body) == without_the_writers_marks(aggregator[kind])


def test_the_differences_are_the_marks_and_the_precondition() -> None:
    """What the comparison above leaves out, on one pod: the agent's marks and its
    resourceVersion precondition; the times in the API's whole-second format in both."""
    agent = agent_patches(raw_pod(None, None), ServeState.SERVING)
    label, condition = agent[WriteKind.LABEL], agent[WriteKind.CONDITION]
    assert label["metadata"]["resourceVersion"] == "42"
    assert label["metadata"]["annotations"] == {
        fallback_marks.ANNOTATION: f"2026-12-02T07:30:01.250000Z {WHO}"
    }
    assert condition["metadata"] == {"resourceVersion": "42"}
    written = condition["status"]["conditions"][0]
    assert written["reason"] == fallback_marks.CONDITION_REASON
    assert written["lastTransitionTime"] == "2026-12-02T07:30:01Z"


async def test_the_aggregator_removes_an_agents_mark_with_its_label() -> None:
    raw = raw_pod("true", None)
    raw["metadata"]["annotations"] = {fallback_marks.ANNOTATION: f"2026-12-02T07:30:01Z {WHO}"}
    patches = await aggregator_patches(raw, ServeState.NOT_READY)
    assert patches[WriteKind.LABEL] == {
        "metadata": {"labels": {LABEL: "false"}, "annotations": {fallback_marks.ANNOTATION: None}}
    }


async def test_the_write_carries_what_the_pod_should_carry_when_it_is_sent() -> None:
    """Level-triggered: the writer writes what the pod should carry when a worker takes it, not
    what was wanted when it was queued. An override's condition write, still queued when the
    override goes, is sent as the health's value with the health's message: the override's
    ("the pod's health does not decide") does not come along (issue 25: a race of the earlier
    writer, which kept a pending message across a change of value)."""
    api = RecordingApi()
    settings = WriterSettings(LABEL, GATE, qps=1000, burst=1000, concurrency=1)
    copies = Copies(parse_pod(raw_pod("true", None), 8000), "true", "SERVING: probe says so")
    copies.override = Override.parse("out-of-service")
    writer = Writer(api, settings, Metrics("test"), copies)
    wanted = copies.desired(KEY)
    assert wanted.condition == "False"
    assert "override" in (wanted.message or "")
    writer.enqueue(KEY, wanted)
    copies.override = NONE  # removed before a worker took the pod
    await work_once(writer)
    (condition,) = api.patches[WriteKind.CONDITION]["status"]["conditions"]
    assert condition["status"] == "True"
    assert condition["message"] == "SERVING: probe says so"
    assert WriteKind.LABEL not in api.patches  # it carries "true" already
