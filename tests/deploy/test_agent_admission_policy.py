"""deploy/components/agent-admission-policy: the ValidatingAdmissionPolicy that keeps the agents'
fallback writes (issue 18: no aggregator answers, each agent writes for its own pods) to their
own pods, evaluated as the API server would, on sample admission requests.

The policy is taken from a user's overlay on the rendered overlays that lists the sidecars'
accounts in SIDECAR_AGENT_SERVICE_ACCOUNTS (as docs/install.md shows), with the constants
kustomize writes into it from the settings ConfigMap. Every expression is compiled and
evaluated by two CEL implementations, cel-python and Google's cel-cpp, which must agree
(tests/deploy/cel_policy.py, shared with test_admission_policy.py); the user info carries the
extras the API server's authenticator puts there for a pod-bound token
(``authentication.kubernetes.io/pod-name``, ``pod-uid``, and from Kubernetes 1.30
``node-name``). The cases are a table, each refusal checked for its reason:

- allowed: a DaemonSet agent flips the label (with the annotation) or the condition of a pod on
  its node, and records an Event; a sidecar does the same for its own pod;
- refused: another pod, a pod on another node, a token without its pod or node, another label,
  another annotation, a malformed one, the image, owner references, another condition type, a
  condition not marked NoAggregator, a status field, an Event about another pod or with another
  reason, and every other operation;
- not matched at all: the KubeRay operator (its token is pod-bound too), the aggregator, a
  sidecar account not listed, the same ServiceAccount name in another namespace, kubelets.

The marks the policy allows are the ones the agents leave (servehealth_common/fallback_marks.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from servehealth_common import fallback_marks as marks
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
from tests.deploy.manifests import (
    ROOT,
    SETTINGS,
    find,
    pod_specs,
    render,
    render_written,
    settings_configmap,
)

NAMESPACE = "ray-serve-health"
NAME = "ray-serve-health-agent"  # the policy's, its binding's and the DaemonSet's account
LIST = "SIDECAR_AGENT_SERVICE_ACCOUNTS"
LABEL_MODE = "deploy/overlays/label-mode"
GATE_MODE = "deploy/overlays/readiness-gate-mode"
LABEL = "ray.io/serve"
CONDITION = "ray.io/serve-proxy-healthy"
WHEN = "2026-12-01T10:00:05Z"

DAEMONSET = f"system:serviceaccount:{NAMESPACE}:{NAME}"
SIDECAR = "system:serviceaccount:ray:rayservice-sample"
UNLISTED = "system:serviceaccount:ray:default"
KUBERAY = "system:serviceaccount:kuberay:kuberay-operator"
AGGREGATOR = f"system:serviceaccount:{NAMESPACE}:ray-serve-health-aggregator"
ELSEWHERE = f"system:serviceaccount:other:{NAME}"  # another installation's, or nobody's
KUBELET = "system:node:node-a"

UID = {
    "worker-1": "7f1c0e52-0000-4000-8000-000000000001",
    "worker-2": "7f1c0e52-0000-4000-8000-000000000002",
    "worker-3": "7f1c0e52-0000-4000-8000-000000000003",
    "coredns": "7f1c0e52-0000-4000-8000-000000000004",
}


# -- the policy, as the overlays render it ----------------------------------------------


def rendered(directory: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(policy, binding, settings ConfigMap) as ``directory`` renders them."""
    return rendered_policy(directory, NAME)


def policy(source: str = GATE_MODE, **settings: str) -> Policy:
    """The policy of a user's overlay on ``source`` ("both": label mode's, in both mode) that
    lists the example's sidecar account and merges ``settings``."""
    listed = {LIST: SIDECAR, **settings}
    if source == "both":
        return compiled_policy(LABEL_MODE, NAME, SERVE_HEALTH_MODE="both", **listed)
    return compiled_policy(source, NAME, **listed)


# -- sample requests --------------------------------------------------------------------


def token(pod_name: str, node: str | None = "node-a") -> dict[str, list[str]]:
    """The user extras of a pod-bound token of a pod named ``pod_name`` on ``node`` (None: a
    token without the node, as before Kubernetes 1.30)."""
    extra = {
        "authentication.kubernetes.io/pod-name": [pod_name],
        "authentication.kubernetes.io/pod-uid": [UID.get(pod_name, "9e0c0e52-0000-0000-0000-0")],
        "authentication.kubernetes.io/credential-id": ["JTI=7ee52be0-9045-4653-aa5e-0da57b8dccdc"],
    }
    if node is not None:
        extra["authentication.kubernetes.io/node-name"] = [node]
        extra["authentication.kubernetes.io/node-uid"] = ["497e9d9a-47aa-4930-b0f6-9f2fb574c8c6"]
    return extra


DAEMONSET_TOKEN = token("ray-serve-health-agent-x7k2p")
SIDECAR_TOKEN = token("worker-1")
KUBERAY_TOKEN = token("kuberay-operator-5d9c-x")


def request(
    user: str = DAEMONSET,
    extra: dict[str, list[str]] | None = None,
    operation: str = "UPDATE",
    sub: str = "",
    resource: str = "pods",
    namespace: str = "ray",
    name: str = "worker-1",
) -> dict[str, Any]:
    if extra is None:
        extra = {DAEMONSET: DAEMONSET_TOKEN, SIDECAR: SIDECAR_TOKEN, KUBERAY: KUBERAY_TOKEN}.get(
            user, {}
        )
    namespace_of_account = user.split(":")[2] if user.startswith("system:serviceaccount:") else ""
    return {
        "operation": operation,
        "subResource": sub,
        "resource": {"group": "", "version": "v1", "resource": resource},
        "userInfo": {
            "username": user,
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace_of_account}",
                "system:authenticated",
            ],
            "extra": extra,
        },
        "namespace": namespace,
        "name": name,
    }


def pod(
    name: str = "worker-1",
    namespace: str = "ray",
    node: str | None = "node-a",
    labels: dict[str, str] | None = None,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Ray worker as the API server holds it (what matters here of it)."""
    spec: dict[str, Any] = {
        "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}],
        "readinessGates": [{"conditionType": CONDITION}],
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": UID[name],
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
        "spec": spec,
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "podIPs": [{"ip": "10.0.0.7"}],
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": CONDITION, "status": "True", "reason": "ServeProxyServing"},
            ]
            if conditions is None
            else conditions,
        },
    }


def event(
    pod_name: str = "worker-1",
    namespace: str = "ray",
    reason: str = marks.EVENT_REASON,
    kind: str = "Pod",
    uid: str | None = "",
    event_namespace: str | None = None,
) -> dict[str, Any]:
    """The Event an agent records for a fallback write (node_agent's event body, in short)."""
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": kind,
        "namespace": namespace,
        "name": pod_name,
    }
    if uid is not None:
        involved["uid"] = uid or UID.get(pod_name, "")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{pod_name}.1880f5a2c3d4e5f6",
            "namespace": event_namespace or namespace,
        },
        "involvedObject": involved,
        "reason": reason,
        "message": f"{marks.WHY}: the agent node node-a (DaemonSet) wrote label {LABEL}=false",
        "type": "Warning",
        "source": {"component": "ray-serve-health-agent"},
        "reportingComponent": "ray-serve-health-agent",
        "reportingInstance": "node node-a (DaemonSet)",
        "firstTimestamp": WHEN,
        "lastTimestamp": WHEN,
        "count": 1,
    }


def flip_label(value: str, writer: str = "node node-a (DaemonSet)") -> Any:
    """The agent's label write: the label and its annotation, one merge patch."""
    return all_of(
        set_label(LABEL, value),
        set_path("metadata", "annotations", marks.ANNOTATION, value=f"{WHEN} {writer}"),
    )


def flip_condition(status: str) -> Any:
    """The agent's condition write (reason NoAggregator)."""
    return set_condition(CONDITION, status, reason=marks.CONDITION_REASON)


def set_annotation(key: str, value: str | None) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        if value is None:
            obj["metadata"]["annotations"].pop(key, None)
        else:
            obj["metadata"]["annotations"][key] = value

    return edit


class Sample(NamedTuple):
    request: dict[str, Any]
    old: dict[str, Any] | None
    #: An edit of ``old`` (the object sent is ``old`` after it), an object (CREATE), or None.
    new: Any
    #: Where the settings come from: a directory, or "both" (label mode's, in both mode).
    source: str = GATE_MODE


def evaluate(sample: Sample) -> Verdict:
    req, old, new, source = sample
    if isinstance(new, dict) or new is None:
        obj = new
    else:
        assert old is not None
        obj = changed(old, new, manager="serve-health-agent")
    return policy(source).admit(req, obj, old)


# -- the cases --------------------------------------------------------------------------

WORKER = pod()  # worker-1, on node-a: the sidecar's own pod, and on the DaemonSet agent's node
OUT = pod(labels={"ray.io/node-type": "worker", LABEL: "false"})
UNLABELLED = pod(labels={"ray.io/node-type": "worker"})
MARKED = changed(WORKER, flip_label("false"), manager="serve-health-agent")
UNGATED = pod(conditions=[{"type": "Ready", "status": "False"}])
ELSEWHERE_POD = pod("worker-2", node="node-b")  # another pod, on another node
NEIGHBOUR = pod("worker-3", namespace="team-b")  # another pod on node-a, another namespace
PENDING = pod("worker-3", node=None)  # not scheduled yet
RECREATED = copy.deepcopy(WORKER)  # the same name, another pod (a new uid)
RECREATED["metadata"]["uid"] = "7f1c0e52-0000-4000-8000-0000000000ff"
MOVED = pod(namespace="other")  # a pod of the same name in another namespace
NOT_RAY = pod("coredns", namespace="kube-system", labels={"k8s-app": "kube-dns"})
LABEL_STATUS = request(sub="status")

STATUS = {"sub": "status"}
SIDE = {"user": SIDECAR}

ALLOWED: dict[str, Sample] = {
    # The DaemonSet agent, for the pods of its node (in any namespace).
    "daemonset-label-out": Sample(request(), WORKER, flip_label("false"), LABEL_MODE),
    "daemonset-label-back-in": Sample(request(), OUT, flip_label("true"), LABEL_MODE),
    "daemonset-label-added": Sample(request(), UNLABELLED, flip_label("true"), LABEL_MODE),
    "daemonset-label-again": Sample(request(), MARKED, flip_label("true"), LABEL_MODE),
    "daemonset-label-other-namespace": Sample(
        request(namespace="team-b", name="worker-3"), NEIGHBOUR, flip_label("false"), LABEL_MODE
    ),
    "daemonset-label-in-both-mode": Sample(request(), WORKER, flip_label("false"), "both"),
    "daemonset-condition-out": Sample(request(**STATUS), WORKER, flip_condition("False")),
    "daemonset-condition-in": Sample(request(**STATUS), UNGATED, flip_condition("True")),
    "daemonset-condition-in-both-mode": Sample(
        request(**STATUS), WORKER, flip_condition("False"), "both"
    ),
    "daemonset-event": Sample(request(operation="CREATE", resource="events"), None, event()),
    # A limit, not a wish: an Event does not say where its pod runs, so the API server cannot
    # keep a DaemonSet agent's Events to its node's pods (its writes, above, are).
    "daemonset-event-about-a-pod-elsewhere": Sample(
        request(operation="CREATE", resource="events", name=""), None, event("worker-2")
    ),
    # A sidecar, for its own pod.
    "sidecar-label-out": Sample(
        request(**SIDE), WORKER, flip_label("false", "ray/worker-1 (sidecar)"), LABEL_MODE
    ),
    "sidecar-label-back-in": Sample(request(**SIDE), OUT, flip_label("true"), LABEL_MODE),
    "sidecar-condition-out": Sample(request(**SIDE, **STATUS), WORKER, flip_condition("False")),
    "sidecar-condition-in": Sample(request(**SIDE, **STATUS), UNGATED, flip_condition("True")),
    "sidecar-event": Sample(request(**SIDE, operation="CREATE", resource="events"), None, event()),
    "sidecar-event-without-uid": Sample(
        request(**SIDE, operation="CREATE", resource="events"), None, event(uid=None)
    ),
    # Not an agent: the match condition leaves the request alone, whatever it does.
    "kuberay-operator-changes-anything": Sample(request(KUBERAY), WORKER, set_image),
    "kuberay-operator-labels-a-head": Sample(
        request(KUBERAY), WORKER, set_label(LABEL, "false"), LABEL_MODE
    ),
    "aggregator": Sample(request(AGGREGATOR), WORKER, set_label("team", "x")),
    "sidecar-account-not-listed": Sample(request(UNLISTED, SIDECAR_TOKEN), WORKER, set_image),
    "same-name-other-namespace": Sample(request(ELSEWHERE, DAEMONSET_TOKEN), WORKER, set_image),
    "kubelet-writes-status": Sample(
        request(KUBELET, **STATUS),
        WORKER,
        all_of(set_condition("Ready", "False"), set_path("status", "podIP", value="10.0.0.9")),
    ),
    "someone-else-deletes": Sample(request(KUBELET, operation="DELETE"), WORKER, None),
}

# Which rule refuses each case (a word of its message).
OPERATION, TOKEN = "may only update pods", "may write only with a token"
NODE, OWN_POD = "may write only pods on its node", "may write only its own pod"
LABELS, ANNOTATIONS = "may change only the label", "may change only the annotation"
METADATA, SPEC, STATUS_FIELDS = "metadata other than", "spec", "status other than"
CONDITIONS = "may change only the condition"
EVENTS, OWN_EVENTS = "only Events with reason", "Events only about its own pod"

REFUSED: dict[str, tuple[Sample, str]] = {
    # Whose pods.
    "daemonset-pod-on-another-node": (
        Sample(request(name="worker-2", **STATUS), ELSEWHERE_POD, flip_condition("False")),
        NODE,
    ),
    "daemonset-label-on-another-node": (
        Sample(request(name="worker-2"), ELSEWHERE_POD, flip_label("false"), LABEL_MODE),
        NODE,
    ),
    "daemonset-pod-not-scheduled": (
        Sample(request(name="worker-3", **STATUS), PENDING, flip_condition("True")),
        NODE,
    ),
    "daemonset-token-without-node": (
        Sample(
            request(DAEMONSET, token("ray-serve-health-agent-x7k2p", None), **STATUS),
            WORKER,
            flip_condition("False"),
        ),
        TOKEN,
    ),
    "daemonset-token-not-pod-bound": (
        Sample(request(DAEMONSET, {}, **STATUS), WORKER, flip_condition("False")),
        TOKEN,
    ),
    "sidecar-another-pod": (
        Sample(request(SIDECAR, name="worker-2", **STATUS), ELSEWHERE_POD, flip_condition("False")),
        OWN_POD,
    ),
    "sidecar-another-pod-on-its-node": (
        Sample(
            request(SIDECAR, namespace="team-b", name="worker-3"),
            NEIGHBOUR,
            flip_label("false"),
            LABEL_MODE,
        ),
        OWN_POD,
    ),
    "sidecar-same-name-new-pod": (
        Sample(request(SIDECAR, **STATUS), RECREATED, flip_condition("False")),
        OWN_POD,
    ),
    "sidecar-same-name-other-namespace": (
        Sample(request(SIDECAR, namespace="other", **STATUS), MOVED, flip_condition("False")),
        OWN_POD,
    ),
    "sidecar-token-not-pod-bound": (
        Sample(request(SIDECAR, {}, **STATUS), WORKER, flip_condition("False")),
        TOKEN,
    ),
    # Labels and annotations (label mode).
    "another-label": (
        Sample(request(), WORKER, all_of(flip_label("false"), set_label("team", "x")), LABEL_MODE),
        LABELS,
    ),
    "kuberay-label": (
        Sample(request(), WORKER, set_label("ray.io/node-type", "head"), LABEL_MODE),
        LABELS,
    ),
    "label-removed": (Sample(request(), WORKER, set_label(LABEL, None), LABEL_MODE), LABELS),
    "label-not-boolean": (Sample(request(), WORKER, flip_label("maybe"), LABEL_MODE), LABELS),
    "label-on-a-pod-not-ray": (
        Sample(
            request(namespace="kube-system", name="coredns"),
            NOT_RAY,
            set_label(LABEL, "true"),
            LABEL_MODE,
        ),
        LABELS,
    ),
    "label-in-condition-mode": (Sample(request(), WORKER, flip_label("false")), LABELS),
    "label-through-status": (
        Sample(request(**STATUS), WORKER, set_label(LABEL, "false"), LABEL_MODE),
        LABELS,
    ),
    "sidecar-another-label": (
        Sample(request(SIDECAR), WORKER, set_label("team", "x"), LABEL_MODE),
        LABELS,
    ),
    "another-annotation": (
        Sample(
            request(), WORKER, all_of(flip_label("false"), set_annotation("x", "y")), LABEL_MODE
        ),
        ANNOTATIONS,
    ),
    "override-annotation": (
        Sample(
            request(SIDECAR),
            WORKER,
            set_annotation("ray-serve-health/override", "in-service"),
            LABEL_MODE,
        ),
        ANNOTATIONS,
    ),
    "annotation-removed": (
        Sample(request(), MARKED, set_annotation(marks.ANNOTATION, None), LABEL_MODE),
        ANNOTATIONS,
    ),
    "annotation-malformed": (
        Sample(request(), WORKER, set_annotation(marks.ANNOTATION, "payload"), LABEL_MODE),
        ANNOTATIONS,
    ),
    "annotation-too-long": (
        Sample(
            request(), WORKER, set_annotation(marks.ANNOTATION, f"{WHEN} {'x' * 600}"), LABEL_MODE
        ),
        ANNOTATIONS,
    ),
    "annotation-in-condition-mode": (
        Sample(request(), WORKER, set_annotation(marks.ANNOTATION, f"{WHEN} node node-a")),
        ANNOTATIONS,
    ),
    "owner-references": (
        Sample(request(), WORKER, set_path("metadata", "ownerReferences", value=[]), LABEL_MODE),
        METADATA,
    ),
    "finalizer-added": (
        Sample(
            request(SIDECAR),
            WORKER,
            set_path("metadata", "finalizers", value=["example.com/hold"]),
            LABEL_MODE,
        ),
        METADATA,
    ),
    "image": (Sample(request(), WORKER, all_of(flip_label("false"), set_image), LABEL_MODE), SPEC),
    "sidecar-image": (Sample(request(SIDECAR), WORKER, set_image, LABEL_MODE), SPEC),
    # Conditions (condition mode).
    "another-condition": (
        Sample(request(**STATUS), WORKER, set_condition("Ready", "True", "NoAggregator")),
        CONDITIONS,
    ),
    "condition-unknown": (Sample(request(**STATUS), WORKER, flip_condition("Unknown")), CONDITIONS),
    "condition-as-the-aggregator": (
        Sample(
            request(**STATUS), WORKER, set_condition(CONDITION, "False", "ServeProxyNotServing")
        ),
        CONDITIONS,
    ),
    "condition-removed": (
        Sample(request(**STATUS), WORKER, set_condition(CONDITION, None)),
        CONDITIONS,
    ),
    "condition-in-label-mode": (
        Sample(request(**STATUS), WORKER, flip_condition("False"), LABEL_MODE),
        CONDITIONS,
    ),
    "condition-through-pod-update": (
        Sample(request(), WORKER, flip_condition("False")),
        CONDITIONS,
    ),
    "condition-on-a-pod-not-ray": (
        Sample(
            request(namespace="kube-system", name="coredns", **STATUS),
            NOT_RAY,
            flip_condition("True"),
        ),
        CONDITIONS,
    ),
    "pod-ip": (
        Sample(
            request(SIDECAR, **STATUS),
            WORKER,
            all_of(flip_condition("False"), set_path("status", "podIP", value="6.6.6.6")),
        ),
        STATUS_FIELDS,
    ),
    "phase": (
        Sample(request(**STATUS), WORKER, set_path("status", "phase", value="Failed")),
        STATUS_FIELDS,
    ),
    # Events.
    "event-another-reason": (
        Sample(
            request(operation="CREATE", resource="events"), None, event(reason="ServeUnhealthy")
        ),
        EVENTS,
    ),
    "event-about-a-node": (
        Sample(request(operation="CREATE", resource="events"), None, event("node-a", kind="Node")),
        EVENTS,
    ),
    "event-about-a-pod-of-another-namespace": (
        Sample(
            request(operation="CREATE", resource="events", namespace="ray"),
            None,
            event(namespace="team-b", event_namespace="ray"),
        ),
        EVENTS,
    ),
    "sidecar-event-about-another-pod": (
        Sample(request(SIDECAR, operation="CREATE", resource="events"), None, event("worker-2")),
        OWN_EVENTS,
    ),
    "sidecar-event-about-a-pod-of-its-name-elsewhere": (
        Sample(
            request(SIDECAR, operation="CREATE", resource="events", namespace="other"),
            None,
            event(namespace="other", uid=None),
        ),
        OWN_EVENTS,
    ),
    "sidecar-event-about-its-old-pod": (
        Sample(
            request(SIDECAR, operation="CREATE", resource="events"),
            None,
            event(uid="7f1c0e52-0000-4000-8000-0000000000ff"),
        ),
        OWN_EVENTS,
    ),
    # Every other operation.
    "delete": (Sample(request(operation="DELETE"), WORKER, None), OPERATION),
    "sidecar-delete-own-pod": (
        Sample(request(SIDECAR, operation="DELETE"), WORKER, None),
        OPERATION,
    ),
    "eviction": (
        Sample(
            request(operation="CREATE", sub="eviction"),
            None,
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "worker-1"}},
        ),
        OPERATION,
    ),
    "exec": (
        Sample(
            request(SIDECAR, operation="CONNECT", sub="exec"),
            None,
            {"kind": "PodExecOptions", "apiVersion": "v1", "command": ["sh"]},
        ),
        OPERATION,
    ),
    "ephemeral-container": (
        Sample(
            request(sub="ephemeralcontainers"),
            WORKER,
            set_path("spec", "ephemeralContainers", value=[{"name": "x", "image": "busybox"}]),
        ),
        OPERATION,
    ),
    "create-a-pod": (
        Sample(request(SIDECAR, operation="CREATE"), None, pod("worker-2")),
        OPERATION,
    ),
    "event-updated": (
        Sample(request(operation="UPDATE", resource="events"), event(), event()),
        OPERATION,
    ),
    "event-deleted": (
        Sample(request(operation="DELETE", resource="events"), event(), None),
        OPERATION,
    ),
}


@pytest.mark.parametrize("sample", [pytest.param(s, id=name) for name, s in ALLOWED.items()])
def test_allowed(sample: Sample) -> None:
    verdict = evaluate(sample)
    assert verdict.allowed, verdict.refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_for_the_right_reason(name: str) -> None:
    sample, why = REFUSED[name]
    verdict = evaluate(sample)
    assert verdict.matched
    assert verdict.refusals
    who = sample.request["userInfo"]["username"]
    for message in verdict.refusals:
        assert message.startswith(f"ray-serve-health agent {who} may"), message
    assert any(why in message for message in verdict.refusals), verdict.refusals


def test_each_refusal_has_one_reason_where_it_can() -> None:
    """A request wrong in one way is refused by one rule, so the message says what to fix."""
    for name, (sample, _) in REFUSED.items():
        if name in {
            "image",
            "another-label",
            "another-annotation",
            "pod-ip",
            "label-in-condition-mode",
        }:
            continue  # a right write with a wrong one beside it: two rules
        refusals = evaluate(sample).refusals
        assert len(refusals) == 1, (name, refusals)


@pytest.mark.parametrize(
    "user",
    [
        KUBERAY,
        AGGREGATOR,
        UNLISTED,
        ELSEWHERE,
        KUBELET,
        "alice",
        "system:serviceaccount:ray:rayservice",
    ],
)
def test_other_accounts_are_not_matched_at_all(user: str) -> None:
    """Not even their own pod's writes: the KubeRay operator's token is pod-bound too."""
    for req, old, new in (
        (request(user, KUBERAY_TOKEN), WORKER, changed(WORKER, set_image)),
        (request(user, SIDECAR_TOKEN, operation="DELETE"), WORKER, None),
        (request(user, operation="CREATE", resource="events"), None, event(reason="Created")),
    ):
        assert not policy().admit(req, new, old).matched, user


def test_the_sidecar_list_matches_whole_usernames() -> None:
    edit = changed(WORKER, set_image)
    listed = f"system:serviceaccount:a:one,{SIDECAR},system:serviceaccount:b:two"
    for value, user, matched in (
        (listed, SIDECAR, True),
        (listed, "system:serviceaccount:a:one", True),
        (listed, "system:serviceaccount:b:two", True),
        (listed, "system:serviceaccount:a:on", False),
        (listed, "system:serviceaccount:b:two-2", False),
        (listed, "serviceaccount:a:one", False),
        (listed, f"system:serviceaccount:a:one,{SIDECAR}", False),
        (SIDECAR, SIDECAR, True),
        (SIDECAR, SIDECAR + "-2", False),
        ("", SIDECAR, False),
        # The aggregator listed by mistake stays under its own policy only.
        (f"{SIDECAR},{AGGREGATOR}", AGGREGATOR, False),
    ):
        verdict = compiled_policy(GATE_MODE, NAME, **{LIST: value}).admit(
            request(user, SIDECAR_TOKEN), edit, WORKER
        )
        assert verdict.matched is matched, (value, user)
    nobody = compiled_policy(GATE_MODE, NAME)  # the overlay as it is: no sidecar listed
    assert not nobody.admit(request(SIDECAR), edit, WORKER).matched
    assert nobody.admit(request(DAEMONSET), edit, WORKER).matched


def test_the_daemonset_account_is_taken_from_the_overlays_namespace() -> None:
    moved = compiled_policy(GATE_MODE, NAME, "other", **{LIST: SIDECAR})
    edit = changed(WORKER, set_image)
    assert moved.admit(request(ELSEWHERE, DAEMONSET_TOKEN), edit, WORKER).refusals
    assert not moved.admit(request(DAEMONSET), edit, WORKER).matched


def test_the_policy_follows_the_settings_of_the_overlay() -> None:
    """The label key and condition type of the one ConfigMap, written into the policy."""
    own_key = policy(LABEL_MODE, SERVE_HEALTH_LABEL_KEY="ray-serve-health/serve")
    new_key = all_of(
        set_label("ray-serve-health/serve", "false"),
        set_path("metadata", "annotations", marks.ANNOTATION, value=f"{WHEN} node node-a"),
    )
    assert own_key.admit(request(), changed(WORKER, new_key), WORKER).allowed
    assert not own_key.admit(request(), changed(WORKER, flip_label("false")), WORKER).allowed
    own_type = policy(SERVE_HEALTH_CONDITION_TYPE="example.com/serving")
    flip = changed(UNGATED, set_condition("example.com/serving", "True", marks.CONDITION_REASON))
    assert own_type.admit(request(**STATUS), flip, UNGATED).allowed
    old_type = changed(UNGATED, flip_condition("True"))
    assert not own_type.admit(request(**STATUS), old_type, UNGATED).allowed


def test_the_policy_allows_the_marks_the_agents_leave() -> None:
    """The literals of the policy are the constants the agents write with."""
    text = yaml.safe_dump(rendered(GATE_MODE)[0]["spec"])
    assert f"'{marks.ANNOTATION}'" in text
    assert f"'{marks.CONDITION_REASON}'" in text
    assert f"'{marks.EVENT_REASON}'" in text
    assert (
        marks.annotation_value(WHEN, "node node-a (DaemonSet)") == f"{WHEN} node node-a (DaemonSet)"
    )


# -- where it is installed --------------------------------------------------------------

INSTALLS = [
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/overlays/namespaced",
    "deploy/examples/production",
    "deploy/examples/tls-secret",
    "deploy/examples/monitoring",
    "deploy/examples/label-mode-fallback",
    "deploy/examples/both-mode",
]


def unrendered_policy() -> dict[str, Any]:
    path = ROOT / "deploy/components/agent-admission-policy/policy.yaml"
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("directory", INSTALLS)
def test_every_install_binds_the_policy_with_the_aggregators_settings(directory: str) -> None:
    vap, binding, configmap = rendered(directory)
    # One policy for every mode, with the settings of the install written in.
    data = configmap["data"]
    constants = {
        "RAY_SERVE_HEALTH_AGENT_NAMESPACE": configmap["metadata"]["namespace"],
        "RAY_SERVE_HEALTH_AGENT_AGGREGATOR_ACCOUNT": "ray-serve-health-aggregator",
        "RAY_SERVE_HEALTH_SIDECAR_ACCOUNTS": data[LIST],
        "RAY_SERVE_HEALTH_AGENT_MODE": data["SERVE_HEALTH_MODE"],
        "RAY_SERVE_HEALTH_AGENT_LABEL_KEY": data["SERVE_HEALTH_LABEL_KEY"],
        "RAY_SERVE_HEALTH_AGENT_CONDITION_TYPE": data["SERVE_HEALTH_CONDITION_TYPE"],
    }
    expected = yaml.safe_dump(unrendered_policy()["spec"])
    for var, value in constants.items():
        expected = expected.replace(f"$({var})", value)
    assert vap["spec"] == yaml.safe_load(expected)
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert "paramKind" not in vap["spec"]  # no parameters: nothing to lose or edit
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""]
    assert set(rule["resources"]) == {"pods", "pods/*", "events"}
    assert rule["operations"] == ["*"]
    assert vap["metadata"]["name"] == NAME
    assert binding["spec"] == {"policyName": NAME, "validationActions": ["Deny"]}
    for validation in vap["spec"]["validations"]:
        assert validation["reason"] == "Forbidden"
        assert validation.get("message") or validation.get("messageExpression")
    # The sidecars' list is there, empty until you list your Ray pods' accounts.
    assert data[LIST] == ""


def test_a_user_overlay_lists_its_sidecars(tmp_path: Path) -> None:
    """The configMapGenerator merge the docs show puts the account into the policy, which then
    limits it (in a namespace of the user's choosing, too)."""
    here = tmp_path / "mine"
    here.mkdir()
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "platform",
                "resources": [os.path.relpath(ROOT / GATE_MODE, here)],
                "configMapGenerator": [
                    {
                        "name": SETTINGS,
                        "behavior": "merge",
                        "literals": [f"{LIST}={SIDECAR}"],
                    }
                ],
            }
        )
    )
    objects = render_written(here)
    settings = settings_configmap(objects)
    assert settings["metadata"]["namespace"] == "platform"
    assert settings["data"][LIST] == SIDECAR
    theirs = Policy(find(objects, "ValidatingAdmissionPolicy", NAME))
    edit = changed(WORKER, set_image)
    assert theirs.admit(request(SIDECAR), edit, WORKER).refusals
    # The DaemonSet agent of that installation, in its namespace; not the default one's.
    daemonset = f"system:serviceaccount:platform:{NAME}"
    assert theirs.admit(request(daemonset, DAEMONSET_TOKEN), edit, WORKER).refusals
    assert not theirs.admit(request(DAEMONSET), edit, WORKER).matched


def test_the_sidecar_example_runs_as_the_account_to_list() -> None:
    """Both pod templates name the example's own ServiceAccount, the one its RoleBinding grants
    and the docs tell you to list."""
    objects = render("deploy/examples/rayservice-sidecar")
    account = find(objects, "ServiceAccount")["metadata"]["name"]
    assert account == SIDECAR.rsplit(":", 1)[1]
    service = find(objects, "RayService")
    accounts = {where: spec.get("serviceAccountName") for where, spec in pod_specs(service)}
    assert set(accounts.values()) == {account}, accounts
    binding = find(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["kind"] == "Role"
    assert "namespace" not in binding["metadata"]  # applied with -n <ray namespace>
