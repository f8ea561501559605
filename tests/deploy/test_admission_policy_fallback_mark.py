"""deploy/components/admission-policy lets the aggregator remove an agent's fallback mark (issue
26, bug 6): the annotation ``ray-serve-health/fallback-write`` that an agent leaves beside the
label it wrote while no aggregator answered goes with the aggregator's next write of that label,
so that it is no longer counted as an agent's write at the next take-over or restart. Only that
removal, with the label, on a Ray pod, in label or both mode: never an annotation added or
changed, never another one removed, never through pods/status. Evaluated as in
tests/deploy/test_admission_policy.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from servehealth_common import fallback_marks
from tests.deploy.cel_policy import all_of, changed, set_condition, set_label, set_path
from tests.deploy.test_admission_policy import (
    CONDITION,
    GATE_MODE,
    LABEL,
    LABEL_MODE,
    pod,
    policy,
    request,
)

MARK = fallback_marks.ANNOTATION
OTHER = "ray.io/ft-enabled"  # the sample pod's own annotation


def marked(*, alone: bool = False) -> dict[str, Any]:
    """A Ray worker whose label an agent wrote (``alone``: the mark is its only annotation)."""
    obj = pod(labels={"ray.io/node-type": "worker", LABEL: "false"})
    annotations = {} if alone else dict(obj["metadata"]["annotations"])
    obj["metadata"]["annotations"] = {
        **annotations,
        MARK: "2026-12-01T20:31:00.123456Z default/worker-1 (sidecar)",
    }
    return obj


def remove_annotation(key: str) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        annotations = obj["metadata"]["annotations"]
        del annotations[key]
        if not annotations:  # the API server drops an empty map
            del obj["metadata"]["annotations"]

    return edit


ALLOWED = {
    # name: (old object, edits)
    "removed-with-the-label": (marked(), [set_label(LABEL, "true"), remove_annotation(MARK)]),
    "removed-its-last-annotation": (
        marked(alone=True),
        [set_label(LABEL, "true"), remove_annotation(MARK)],
    ),
    "removed-label-rewritten-unchanged": (marked(), [remove_annotation(MARK)]),
}
REFUSED = {
    "added": (pod(), [set_path("metadata", "annotations", MARK, value="2026-12-01T20:31:00Z x")]),
    "changed": (marked(), [set_path("metadata", "annotations", MARK, value="now me")]),
    "another-removed-with-it": (
        marked(),
        [set_label(LABEL, "true"), remove_annotation(MARK), remove_annotation(OTHER)],
    ),
    "another-removed": (marked(), [set_label(LABEL, "true"), remove_annotation(OTHER)]),
}


def admit(old: dict[str, Any], edits: list[Any], *, sub: str = "", source: str = LABEL_MODE):
    new = changed(copy.deepcopy(old), all_of(*edits))
    return policy(source).admit(request(sub=sub), new, old)


@pytest.mark.parametrize("name", list(ALLOWED))
@pytest.mark.parametrize("source", [LABEL_MODE, "both"])
def test_the_mark_may_be_removed_with_the_label(name: str, source: str) -> None:
    old, edits = ALLOWED[name]
    verdict = admit(old, edits, source=source)
    assert verdict.allowed, verdict.refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_no_other_annotation_change(name: str) -> None:
    old, edits = REFUSED[name]
    verdict = admit(old, edits)
    assert verdict.matched
    assert any("metadata" in message for message in verdict.refusals), verdict.refusals


def test_not_in_condition_mode_nor_through_the_status() -> None:
    old = marked()
    assert admit(old, [remove_annotation(MARK)], source=GATE_MODE).refusals
    status = [set_condition(CONDITION, "False"), remove_annotation(MARK)]
    assert admit(old, status, sub="status", source="both").refusals


def test_not_on_a_pod_that_is_not_rays() -> None:
    old = marked()
    old["metadata"]["labels"] = {"app": "web", LABEL: "false"}
    assert admit(old, [remove_annotation(MARK)]).refusals
