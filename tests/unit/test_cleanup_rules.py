"""What ``serve-health-cleanup`` decides for each pod (``aggregator/cleanup/rules.py``), as a
table: who created the pod (KubeRay's head tags, the RayService-only variable), its node type,
what it carries, the mode and key, and the change (or none) that gives it back to KubeRay. Then
the patch bodies each change is sent as."""

from __future__ import annotations

from typing import Any

import pytest

from aggregator.cleanup.rules import (
    EXTRA_TAGS_ENV,
    RAY_SERVICE_ENV,
    UNINSTALLED_MESSAGE,
    UNINSTALLED_REASON,
    Change,
    CleanupRules,
    Op,
    creator_of,
    patch_of,
    plan,
)
from servehealth_common import fallback_marks as marks
from servehealth_common.pod_identity import PodKey

GATE = "ray.io/serve-proxy-healthy"
KUBERAY = "ray.io/serve"
OWN = "example.com/serving"


def pod(
    name: str,
    *,
    head: bool = False,
    cluster: str = "c1",
    labels: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    gated: bool = False,
    condition: tuple[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A KubeRay-like pod: ``env`` on its Ray container, ``condition`` (status, reason) of
    type GATE."""
    all_labels = {"ray.io/node-type": "head" if head else "worker", "ray.io/cluster": cluster}
    container = {"name": "ray", "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    spec: dict[str, Any] = {"containers": [container]}
    if gated:
        spec["readinessGates"] = [{"conditionType": GATE}]
    conditions = [{"type": "Ready", "status": "True"}]
    if condition:
        conditions.append({"type": GATE, "status": condition[0], "reason": condition[1]})
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": all_labels | (labels or {}),
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"conditions": conditions},
    }


SERVICE_HEAD_ENV = {EXTRA_TAGS_ENV: "kuberay_version=v1.5.0;kuberay_crd=RayService"}
CLUSTER_HEAD_ENV = {EXTRA_TAGS_ENV: "kuberay_version=v1.5.0;kuberay_crd=RayCluster"}
SERVICE_ENV = {RAY_SERVICE_ENV: "0"}
#: The mark an agent in fallback leaves beside its label write.
MARKED = {marks.ANNOTATION: "2026-01-01T00:00:00.123456Z default/w (sidecar)"}


def changes_of(pods: list[dict[str, Any]], mode: str, key: str = KUBERAY) -> list[list[str]]:
    plans = plan(pods, CleanupRules(mode, key, GATE))
    return [
        [f"{c.op.value} {c.name}{'=' + c.value if c.value else ''}" for c in p.changes]
        for p in plans
    ]


@pytest.mark.parametrize(
    ("pods", "mode", "key", "expected"),
    [
        pytest.param(
            [pod("h", head=True, env=SERVICE_HEAD_ENV, labels={KUBERAY: "false"}),
             pod("w", labels={KUBERAY: "false"})],
            "label", KUBERAY, [[], [f"set label {KUBERAY}=true"]],
            id="rayservice: worker back to true (its head's tags say so), head left to KubeRay",
        ),
        pytest.param(
            [pod("w", labels={KUBERAY: "false"}, env=SERVICE_ENV)],
            "label", KUBERAY, [[f"set label {KUBERAY}=true"]],
            id="rayservice worker without its head listed: the RayService-only variable",
        ),
        pytest.param(
            [pod("w", labels={KUBERAY: "true"}, env=SERVICE_ENV)],
            "label", KUBERAY, [[]],
            id="rayservice worker already true: already right",
        ),
        pytest.param(
            [pod("w", env=SERVICE_ENV)],
            "label", KUBERAY, [[f"set label {KUBERAY}=true"]],
            id="rayservice worker without the label: true, as BuildPod sets it",
        ),
        pytest.param(
            [pod("h", head=True, env=CLUSTER_HEAD_ENV, labels={KUBERAY: "true"}),
             pod("w", labels={KUBERAY: "false"})],
            "label", KUBERAY, [[f"remove label {KUBERAY}"], [f"remove label {KUBERAY}"]],
            id="plain raycluster: KubeRay never sets it, removed from head and worker",
        ),
        pytest.param(
            [pod("h", head=True, env=CLUSTER_HEAD_ENV), pod("w", env=SERVICE_ENV,
             labels={KUBERAY: "false"})],
            "label", KUBERAY, [[], [f"remove label {KUBERAY}"]],
            id="the head's tags win over a variable the user set on a plain raycluster",
        ),
        pytest.param(
            [pod("w", labels={KUBERAY: "false"})],
            "label", KUBERAY, [[f"remove label {KUBERAY}"]],
            id="no sign of a RayService: a RayCluster pod, as KubeRay's GetCRDType defaults",
        ),
        pytest.param(
            [pod("h", head=True, env=SERVICE_HEAD_ENV, cluster="svc"),
             pod("w1", cluster="svc", labels={KUBERAY: "false"}),
             pod("w2", cluster="plain", labels={KUBERAY: "false"})],
            "label", KUBERAY, [[], [f"set label {KUBERAY}=true"], [f"remove label {KUBERAY}"]],
            id="each cluster by its own head",
        ),
        pytest.param(
            [pod("h", head=True, env=SERVICE_HEAD_ENV, labels={OWN: "true"}),
             pod("w", env=SERVICE_ENV, labels={OWN: "false"}),
             pod("x")],
            "label", OWN, [[f"remove label {OWN}"], [f"remove label {OWN}"], []],
            id="a key of our own: removed from every pod, RayService or not",
        ),
        pytest.param(
            [pod("w", env=SERVICE_ENV, labels={KUBERAY: "false"}, gated=True,
                 condition=("False", "ServeProxyNotServing"))],
            "condition", KUBERAY, [[f"set condition {GATE}"]],
            id="condition mode leaves labels alone; a gated pod's False becomes True",
        ),
        pytest.param(
            [pod("a", gated=True), pod("b", gated=True, condition=("True", "ServeProxyServing")),
             pod("c", gated=True, condition=("True", UNINSTALLED_REASON))],
            "condition", KUBERAY, [[f"set condition {GATE}"], [f"set condition {GATE}"], []],
            id="gated: absent or True for another reason is set, already uninstalled is right",
        ),
        pytest.param(
            [pod("a", condition=("False", "ServeProxyNotServing")), pod("b")],
            "condition", KUBERAY, [[f"remove condition {GATE}"], []],
            id="ungated: the condition is removed where it is",
        ),
        pytest.param(
            [pod("w", env=SERVICE_ENV, labels={KUBERAY: "false"}, gated=True,
                 condition=("False", "ServeProxyNotServing"))],
            "both", KUBERAY, [[f"set label {KUBERAY}=true", f"set condition {GATE}"]],
            id="both: the label and the condition",
        ),
        pytest.param(
            [pod("w", env=SERVICE_ENV, labels={KUBERAY: "true"}, annotations=MARKED),
             pod("x", labels={KUBERAY: "false"}, annotations=MARKED)],
            "label", KUBERAY,
            [[f"remove annotation {marks.ANNOTATION}"],
             [f"remove label {KUBERAY}", f"remove annotation {marks.ANNOTATION}"]],
            id="an agent's mark is removed, where the label is right or with its change",
        ),
        pytest.param(
            [pod("w", gated=True, condition=("True", "x"), annotations=MARKED)],
            "both", OWN, [[f"remove annotation {marks.ANNOTATION}", f"set condition {GATE}"]],
            id="both: the mark removed beside the label of any key",
        ),
        pytest.param(
            [pod("w", gated=True, condition=("False", marks.CONDITION_REASON)),
             pod("v", gated=True, condition=("True", marks.CONDITION_REASON)),
             pod("u", condition=("False", marks.CONDITION_REASON))],
            "condition", KUBERAY,
            [[f"set condition {GATE}"], [f"set condition {GATE}"], [f"remove condition {GATE}"]],
            id="an agent's NoAggregator condition: True and uninstalled when gated, else removed",
        ),
    ],
)  # fmt: skip
def test_changes(
    pods: list[dict[str, Any]], mode: str, key: str, expected: list[list[str]]
) -> None:
    assert changes_of(pods, mode, key) == expected


def test_in_condition_mode_the_mark_is_left_and_says_why() -> None:
    """The aggregator's admission policy lets its account remove the mark only in label or
    both mode (with the label it writes there): the cleanup, which runs as that account, says
    how to remove it by hand instead of failing on a 403."""
    [marked] = plan(
        [pod("w", gated=True, annotations=MARKED)], CleanupRules("condition", KUBERAY, GATE)
    )
    assert [c.op for c in marked.changes] == [Op.SET_CONDITION]
    [kept] = marked.kept
    assert kept.startswith(f"annotation {marks.ANNOTATION}: in condition mode")
    assert f"{marks.ANNOTATION}-" in kept


def test_a_rayservice_head_says_why_it_is_left_alone() -> None:
    [head] = plan([pod("h", head=True, env=SERVICE_HEAD_ENV)], CleanupRules("label", KUBERAY, GATE))
    assert head.key == PodKey("ns", "h")
    assert head.changes == ()
    assert head.kept == (f"label {KUBERAY}: KubeRay writes it on a RayService head",)


@pytest.mark.parametrize(
    ("env", "creator"),
    [
        pytest.param({EXTRA_TAGS_ENV: "kuberay_version=v1.4.0;kuberay_crd=RayJob"}, "RayJob",
                     id="rayjob head"),
        pytest.param({EXTRA_TAGS_ENV: "kuberay_crd=RayService"}, "RayService", id="tag alone"),
        pytest.param({EXTRA_TAGS_ENV: "something=else"}, "RayCluster", id="no crd tag"),
        pytest.param(SERVICE_ENV, "RayService", id="rayservice variable"),
        pytest.param({}, "RayCluster", id="nothing: KubeRay's default"),
    ],
)  # fmt: skip
def test_creator_of_a_pod_alone(env: dict[str, str], creator: str) -> None:
    assert creator_of(pod("p", env=env), {}) == creator


@pytest.mark.parametrize(
    ("change", "body"),
    [
        pytest.param(
            Change(Op.SET_LABEL, KUBERAY, "", value="true"),
            {"metadata": {"labels": {KUBERAY: "true"}}},
            id="set label: merge patch",
        ),
        pytest.param(
            Change(Op.REMOVE_LABEL, OWN, ""),
            {"metadata": {"labels": {OWN: None}}},
            id="remove label: merge patch null",
        ),
        pytest.param(
            Change(Op.REMOVE_ANNOTATION, marks.ANNOTATION, ""),
            {"metadata": {"annotations": {marks.ANNOTATION: None}}},
            id="remove annotation: merge patch null",
        ),
        pytest.param(
            Change(Op.REMOVE_CONDITION, GATE, ""),
            {"status": {"conditions": [{"type": GATE, "$patch": "delete"}]}},
            id="remove condition: strategic merge $patch delete",
        ),
        pytest.param(
            Change(Op.SET_CONDITION, GATE, "", transition=True),
            {"status": {"conditions": [{
                "type": GATE, "status": "True", "reason": UNINSTALLED_REASON,
                "message": UNINSTALLED_MESSAGE, "lastTransitionTime": "2026-01-01T00:00:00Z",
            }]}},
            id="set condition from False: a new lastTransitionTime",
        ),
        pytest.param(
            Change(Op.SET_CONDITION, GATE, "", transition=False),
            {"status": {"conditions": [{
                "type": GATE, "status": "True", "reason": UNINSTALLED_REASON,
                "message": UNINSTALLED_MESSAGE,
            }]}},
            id="set condition already True: the transition time kept",
        ),
    ],
)  # fmt: skip
def test_patch_bodies(change: Change, body: dict[str, Any]) -> None:
    assert patch_of(change, "2026-01-01T00:00:00Z") == body
    assert change.op.on_status is ("conditions" in str(body))
