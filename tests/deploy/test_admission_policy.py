"""deploy/components/admission-policy: the ValidatingAdmissionPolicy that keeps the aggregator's
writes to its one label, its leader label and its one condition, evaluated as the API server
would, on sample admission requests.

The policy is taken from the rendered overlays, with the constants kustomize writes into it
from the settings ConfigMap they render (the one the aggregator reads): ``both`` mode and other
settings come from a user's overlay on them that merges those settings
(tests/deploy/cel_policy.py, rendered_with). Every expression (match condition, variables in
order, validations and their messages) is compiled and evaluated by two CEL implementations,
cel-python and Google's cel-cpp, which must agree: the policy uses standard CEL only, so a pass
here means the same expressions, the same answers, in the API server (which evaluates
``object`` and ``oldObject`` as untyped maps, as here). An expression that fails to evaluate
counts as a refusal, as ``failurePolicy: Fail`` makes it. The cases are a table: allowed (the label
flipped, added, removed; the leader label; the condition flipped, added, removed; requests of
anyone else, which the match condition leaves alone) and refused (another label, an
annotation, the image, owner references, a status field, a condition of another type, another
mode's write, other operations)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.cel_policy import (
    Policy,
    Verdict,
    all_of,
    changed,
    compiled_policy,
    rendered_policy,
    set_condition,
    set_image,
    set_label,
    set_path,
)
from tests.deploy.manifests import ROOT, find, render_written, settings_configmap

NAMESPACE = "ray-serve-health"
NAME = "ray-serve-health-aggregator"  # the policy's, its binding's and the account's
ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{NAME}"
LABEL_MODE = "deploy/overlays/label-mode"
GATE_MODE = "deploy/overlays/readiness-gate-mode"
LABEL = "ray.io/serve"
LEADER = "ray-serve-health/leader"
CONDITION = "ray.io/serve-proxy-healthy"


# -- the policy, as the overlays render it -----------------------------------------------


def rendered(directory: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(policy, binding, settings ConfigMap) as ``directory`` renders them."""
    return rendered_policy(directory, NAME)


def policy(source: str = LABEL_MODE, **settings: str) -> Policy:
    """The policy as ``source`` renders it ("both": label mode's, in both mode), or a user's
    overlay on it that merges ``settings``."""
    if source == "both":
        return compiled_policy(LABEL_MODE, NAME, SERVE_HEALTH_MODE="both", **settings)
    return compiled_policy(source, NAME, **settings)


# -- sample requests --------------------------------------------------------------------


def request(
    operation: str = "UPDATE",
    sub: str = "",
    user: str = ACCOUNT,
    about: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An admission request; ``about``: the pod it is on (its namespace and name, which the
    API server puts in the request), ray/worker-1 if not given."""
    metadata = (about or {}).get("metadata", {})
    return {
        "operation": operation,
        "subResource": sub,
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"]},
        "namespace": metadata.get("namespace", "ray"),
        "name": metadata.get("name", "worker-1"),
    }


def pod(
    namespace: str = "ray",
    labels: dict[str, str] | None = None,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Ray worker as the API server holds it (what matters here of it)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "worker-1",
            "namespace": namespace,
            "uid": "7f1c0e52-0000-4000-8000-000000000001",
            "resourceVersion": "1001",
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": {
                "ray.io/node-type": "worker",
                "ray.io/cluster": "rayservice-sample-raycluster-abcde",
                LABEL: "true",
            }
            if labels is None
            else labels,
            "annotations": {"ray.io/ft-enabled": "false"},
            "ownerReferences": [
                {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "raycluster", "uid": "u"}
            ],
            "managedFields": [{"manager": "kuberay-operator", "operation": "Update"}],
        },
        "spec": {
            "nodeName": "node-a",
            "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}],
            "readinessGates": [{"conditionType": CONDITION}],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "podIPs": [{"ip": "10.0.0.7"}],
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": CONDITION, "status": "True", "reason": "ProxyServing"},
            ]
            if conditions is None
            else conditions,
        },
    }


def aggregator_pod(labels: dict[str, str] | None = None) -> dict[str, Any]:
    obj = pod(namespace=NAMESPACE, labels={"app.kubernetes.io/component": "aggregator"})
    obj["metadata"]["name"] = "ray-serve-health-aggregator-5d9c-x"
    if labels is not None:
        obj["metadata"]["labels"] = labels
    return obj


# -- the cases --------------------------------------------------------------------------

WORKER = pod()
WORKER_OUT = pod(labels={"ray.io/node-type": "worker", LABEL: "false"})
WORKER_UNLABELLED = pod(labels={"ray.io/node-type": "worker"})
NOT_RAY = pod(namespace="kube-system", labels={"k8s-app": "kube-dns"})
GATED = pod(
    conditions=[{"type": "Ready", "status": "False"}, {"type": CONDITION, "status": "False"}]
)
UNGATED = pod(conditions=[{"type": "Ready", "status": "True"}])
AGGREGATOR_POD = aggregator_pod()
LEADER_POD = aggregator_pod({"app.kubernetes.io/component": "aggregator", LEADER: "true"})
# The same ServiceAccount name in another namespace: another installation, or nobody's.
ELSEWHERE = "system:serviceaccount:other:ray-serve-health-aggregator"
KUBELET = "system:node:node-a"

# (request, old object, edit or None for the object as sent, settings source) per case.
Case = tuple[dict[str, Any], dict[str, Any] | None, Any, str]

ALLOWED: dict[str, Case] = {
    "label-flipped-to-false": (request(), WORKER, set_label(LABEL, "false"), LABEL_MODE),
    "label-flipped-back-to-true": (request(), WORKER_OUT, set_label(LABEL, "true"), LABEL_MODE),
    "label-added": (request(), WORKER_UNLABELLED, set_label(LABEL, "true"), LABEL_MODE),
    "label-removed": (request(), WORKER, set_label(LABEL, None), LABEL_MODE),
    "label-rewritten-unchanged": (request(), WORKER, set_label(LABEL, "true"), LABEL_MODE),
    "label-in-both-mode": (request(), WORKER, set_label(LABEL, "false"), "both"),
    "leader-label-on-own-pod": (request(), AGGREGATOR_POD, set_label(LEADER, "true"), GATE_MODE),
    "leader-label-removed": (request(), LEADER_POD, set_label(LEADER, None), GATE_MODE),
    "leader-label-in-label-mode": (
        request(),
        AGGREGATOR_POD,
        set_label(LEADER, "true"),
        LABEL_MODE,
    ),
    "condition-flipped-to-true": (
        request(sub="status"),
        GATED,
        set_condition(CONDITION, "True"),
        GATE_MODE,
    ),
    "condition-flipped-to-false": (
        request(sub="status"),
        WORKER,
        set_condition(CONDITION, "False"),
        GATE_MODE,
    ),
    "condition-added": (
        request(sub="status"),
        UNGATED,
        set_condition(CONDITION, "True"),
        GATE_MODE,
    ),
    "condition-removed": (request(sub="status"), WORKER, set_condition(CONDITION, None), GATE_MODE),
    "resource-version-moves": (
        request(),
        WORKER,
        all_of(set_label(LABEL, "false"), set_path("metadata", "resourceVersion", value="1002")),
        LABEL_MODE,
    ),
    # Not the aggregator: the match condition leaves the request alone, whatever it does.
    "other-account-changes-image": (
        request(user="system:serviceaccount:ray:deployer"),
        WORKER,
        set_image,
        LABEL_MODE,
    ),
    "same-name-other-namespace": (request(user=ELSEWHERE), WORKER, set_image, LABEL_MODE),
    "kubelet-writes-status": (
        request(sub="status", user=KUBELET),
        WORKER,
        all_of(set_condition("Ready", "False"), set_path("status", "podIP", value="10.0.0.9")),
        GATE_MODE,
    ),
    "other-account-deletes": (request("DELETE", user=KUBELET), WORKER, None, LABEL_MODE),
}

REFUSED: dict[str, Case] = {
    "another-label": (
        request(),
        WORKER,
        all_of(set_label(LABEL, "false"), set_label("team", "x")),
        LABEL_MODE,
    ),
    "kuberay-label": (request(), WORKER, set_label("ray.io/node-type", "head"), LABEL_MODE),
    "label-value-not-boolean": (request(), WORKER, set_label(LABEL, "maybe"), LABEL_MODE),
    "label-on-a-pod-not-ray": (request(), NOT_RAY, set_label(LABEL, "true"), LABEL_MODE),
    "label-in-condition-mode": (request(), WORKER, set_label(LABEL, "false"), GATE_MODE),
    "label-through-status": (request(sub="status"), WORKER, set_label(LABEL, "false"), LABEL_MODE),
    "annotation-added": (
        request(),
        WORKER,
        all_of(set_label(LABEL, "false"), set_path("metadata", "annotations", "x", value="y")),
        LABEL_MODE,
    ),
    "annotations-removed": (
        request(),
        WORKER,
        set_path("metadata", "annotations", value={}),
        LABEL_MODE,
    ),
    "owner-references": (
        request(),
        WORKER,
        set_path("metadata", "ownerReferences", value=[]),
        LABEL_MODE,
    ),
    "finalizer-added": (
        request(),
        WORKER,
        set_path("metadata", "finalizers", value=["example.com/hold"]),
        LABEL_MODE,
    ),
    "image": (request(), WORKER, all_of(set_label(LABEL, "false"), set_image), LABEL_MODE),
    "image-in-kube-system": (request(), NOT_RAY, set_image, LABEL_MODE),
    "leader-label-elsewhere": (request(), WORKER, set_label(LEADER, "true"), LABEL_MODE),
    "leader-label-false": (request(), AGGREGATOR_POD, set_label(LEADER, "false"), GATE_MODE),
    "another-condition": (
        request(sub="status"),
        WORKER,
        set_condition("Ready", "False"),
        GATE_MODE,
    ),
    "condition-unknown": (
        request(sub="status"),
        WORKER,
        set_condition(CONDITION, "Unknown"),
        GATE_MODE,
    ),
    "condition-in-label-mode": (
        request(sub="status"),
        WORKER,
        set_condition(CONDITION, "False"),
        LABEL_MODE,
    ),
    "condition-through-pod-update": (
        request(),
        WORKER,
        set_condition(CONDITION, "False"),
        GATE_MODE,
    ),
    "pod-ip": (
        request(sub="status"),
        WORKER,
        all_of(
            set_condition(CONDITION, "False"),
            set_path("status", "podIPs", value=[{"ip": "6.6.6.6"}]),
        ),
        GATE_MODE,
    ),
    "phase": (
        request(sub="status"),
        WORKER,
        set_path("status", "phase", value="Failed"),
        GATE_MODE,
    ),
    "status-field-of-a-newer-kubernetes": (
        request(sub="status"),
        WORKER,
        set_path("status", "observedGeneration", value=7),
        GATE_MODE,
    ),
    "delete": (request("DELETE"), WORKER, None, LABEL_MODE),
    "eviction": (request("CREATE", sub="eviction"), WORKER, None, LABEL_MODE),
    "ephemeral-container": (
        request(sub="ephemeralcontainers"),
        WORKER,
        set_path("spec", "ephemeralContainers", value=[{"name": "debug", "image": "busybox"}]),
        GATE_MODE,
    ),
    "resize": (request(sub="resize"), WORKER, set_image, LABEL_MODE),
}


# Which rule refuses each case (a word of its message).
LABELS, METADATA, SPEC = "only the label", "metadata", "spec"
CONDITIONS, STATUS, UPDATE_ONLY = "only the condition", "status other", "only update"
WHY = {
    "another-label": LABELS,
    "kuberay-label": LABELS,
    "label-value-not-boolean": LABELS,
    "label-on-a-pod-not-ray": LABELS,
    "label-in-condition-mode": LABELS,
    "label-through-status": LABELS,
    "annotation-added": METADATA,
    "annotations-removed": METADATA,
    "owner-references": METADATA,
    "finalizer-added": METADATA,
    "image": SPEC,
    "image-in-kube-system": SPEC,
    "leader-label-elsewhere": LABELS,
    "leader-label-false": LABELS,
    "another-condition": CONDITIONS,
    "condition-unknown": CONDITIONS,
    "condition-in-label-mode": CONDITIONS,
    "condition-through-pod-update": CONDITIONS,
    "pod-ip": STATUS,
    "phase": STATUS,
    "status-field-of-a-newer-kubernetes": STATUS,
    "delete": UPDATE_ONLY,
    "eviction": UPDATE_ONLY,
    "ephemeral-container": UPDATE_ONLY,
    "resize": UPDATE_ONLY,
}


def evaluate(case: Case) -> Verdict:
    req, old, edit, source = case
    if old is not None:  # the request names the pod it is on
        req = {**req, "namespace": old["metadata"]["namespace"], "name": old["metadata"]["name"]}
    if req["operation"] == "DELETE":
        obj = None
    elif req["operation"] == "CREATE":
        obj = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "worker-1"}}
        old = None
    else:
        assert old is not None
        obj = changed(old, edit)
    return policy(source).admit(req, obj, old)


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in ALLOWED.items()])
def test_allowed(case: Case) -> None:
    verdict = evaluate(case)
    assert verdict.allowed, verdict.refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(name: str) -> None:
    verdict = evaluate(REFUSED[name])
    assert verdict.matched
    assert verdict.refusals
    for message in verdict.refusals:
        assert message.startswith("ray-serve-health-aggregator may "), message
    assert any(WHY[name] in message for message in verdict.refusals), verdict.refusals


def test_every_refusal_says_why() -> None:
    assert set(WHY) == set(REFUSED)


def test_other_users_are_not_matched_at_all() -> None:
    for user in (ELSEWHERE, KUBELET, "system:serviceaccount:kuberay:kuberay-operator"):
        verdict = policy().admit(request(user=user), changed(WORKER, set_image), WORKER)
        assert not verdict.matched, user


def test_refusals_name_the_configured_label_and_the_pod() -> None:
    verdict = evaluate(REFUSED["another-label"])
    assert verdict.refusals == [
        f"ray-serve-health-aggregator may change only the label {LABEL} (true or false, on Ray "
        f"pods, in label mode) and {LEADER} (true, on pods of {NAMESPACE}): pod ray/worker-1"
    ]
    verdict = evaluate(REFUSED["another-condition"])
    assert verdict.refusals == [
        f"ray-serve-health-aggregator may change only the condition {CONDITION} (True or False, "
        "on pods/status, in condition mode) among the conditions of pod ray/worker-1"
    ]


def test_the_policy_follows_the_settings_of_the_overlay() -> None:
    """Change the label key in the one ConfigMap of a user's overlay: its policy allows the new
    key and refuses the old one (kustomize writes the settings into the policy)."""
    own_key = policy(LABEL_MODE, SERVE_HEALTH_LABEL_KEY="ray-serve-health/serve")
    flip_new = changed(WORKER, set_label("ray-serve-health/serve", "false"))
    flip_old = changed(WORKER, set_label(LABEL, "false"))
    assert own_key.admit(request(), flip_new, WORKER).allowed
    assert not own_key.admit(request(), flip_old, WORKER).allowed
    assert policy().admit(request(), flip_old, WORKER).allowed
    own_leader = policy(GATE_MODE, SERVE_HEALTH_LEADER_LABEL="example.com/leader")
    leader = changed(AGGREGATOR_POD, set_label("example.com/leader", "true"))
    on_own_pod = request(about=AGGREGATOR_POD)
    assert own_leader.admit(on_own_pod, leader, AGGREGATOR_POD).allowed
    old_leader = changed(AGGREGATOR_POD, set_label(LEADER, "true"))
    assert not own_leader.admit(on_own_pod, old_leader, AGGREGATOR_POD).allowed


def test_the_aggregator_account_is_taken_from_the_overlays_namespace() -> None:
    """A user's overlay in namespace `other`: its policy is for that namespace's aggregator
    (and its pods are the leader label's), not for the default namespace's."""
    moved = compiled_policy(GATE_MODE, NAME, "other")
    edit = changed(WORKER, set_image)
    assert moved.admit(request(user=ELSEWHERE), edit, WORKER).refusals
    assert not moved.admit(request(), edit, WORKER).matched
    own = aggregator_pod()
    own["metadata"]["namespace"] = "other"
    verdict = moved.admit(
        request(user=ELSEWHERE, about=own), changed(own, set_label(LEADER, "true")), own
    )
    assert verdict.allowed, verdict.refusals
    theirs = request(user=ELSEWHERE, about=AGGREGATOR_POD)
    leader = changed(AGGREGATOR_POD, set_label(LEADER, "true"))
    assert moved.admit(theirs, leader, AGGREGATOR_POD).refusals


def unrendered_policy() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy/components/admission-policy/policy.yaml").read_text())


@pytest.mark.parametrize("directory", [LABEL_MODE, GATE_MODE, "deploy/overlays/namespaced"])
def test_the_binding_enforces_the_policy_with_the_aggregators_settings(directory: str) -> None:
    vap, binding, configmap = rendered(directory)
    # One policy for every mode, with the settings of the install written in.
    data = configmap["data"]
    constants = {
        "RAY_SERVE_HEALTH_AGGREGATOR_NAMESPACE": configmap["metadata"]["namespace"],
        "RAY_SERVE_HEALTH_AGGREGATOR_ACCOUNT": NAME,
        "RAY_SERVE_HEALTH_AGGREGATOR_MODE": data["SERVE_HEALTH_MODE"],
        "RAY_SERVE_HEALTH_AGGREGATOR_LABEL_KEY": data["SERVE_HEALTH_LABEL_KEY"],
        "RAY_SERVE_HEALTH_AGGREGATOR_CONDITION_TYPE": data["SERVE_HEALTH_CONDITION_TYPE"],
        "RAY_SERVE_HEALTH_AGGREGATOR_LEADER_LABEL": data["SERVE_HEALTH_LEADER_LABEL"],
    }
    expected = yaml.safe_dump(unrendered_policy()["spec"])
    for var, value in constants.items():
        expected = expected.replace(f"$({var})", value)
    assert vap["spec"] == yaml.safe_load(expected)
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert "paramKind" not in vap["spec"]  # no parameters: nothing to lose or edit
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""]
    assert set(rule["resources"]) == {"pods", "pods/*"}  # status and every other subresource
    assert rule["operations"] == ["*"]
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    for validation in vap["spec"]["validations"]:
        assert validation["reason"] == "Forbidden"
        assert validation.get("message") or validation.get("messageExpression")


def test_a_user_overlay_in_another_namespace_moves_the_policy_along(tmp_path: Path) -> None:
    """A `namespace:` set on top of an overlay moves the settings and the account the policy
    is for."""
    here = tmp_path / "mine"
    here.mkdir()
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "platform",
                "resources": [os.path.relpath(ROOT / GATE_MODE, here)],
            }
        )
    )
    objects = render_written(here)
    assert settings_configmap(objects)["metadata"]["namespace"] == "platform"
    vap = find(objects, "ValidatingAdmissionPolicy", NAME)
    (condition,) = vap["spec"]["matchConditions"]
    assert "'platform'" in condition["expression"]
    platform = Policy(vap)
    edit = changed(WORKER, set_image)
    assert platform.admit(
        request(user=f"system:serviceaccount:platform:{NAME}"), edit, WORKER
    ).refusals
    assert not platform.admit(request(), edit, WORKER).matched
