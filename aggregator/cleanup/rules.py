"""What ``serve-health-cleanup`` does to each pod once the aggregator is uninstalled: the pure
decisions (no I/O; :mod:`aggregator.cleanup.kube` reads the pods and sends the patches).

What KubeRay expects (ray-project/kuberay, ``ray-operator/controllers/ray``, master at
feeaf72, 2026-08-19):

- ``common/pod.go``, ``BuildPod``: when the pod's creator is a RayService (``creatorCRDType ==
  utils.RayServiceCRD``) it sets ``ray.io/serve`` (``utils.RayClusterServingServiceLabelKey``)
  in the pod's labels at creation: ``"true"`` on workers ("traffic readiness is determined by
  the readiness probe"), ``"false"`` on the head. It never writes a worker's label again (since
  KubeRay 1.1, #1856; before, the operator probed workers and wrote their label). Pods
  of a plain RayCluster or of a RayJob get no ``ray.io/serve`` label at all (unless the user's
  own pod template has one).
- ``rayservice_controller.go``, ``updateHeadPodServeLabel``: on every reconcile it writes the
  head's label itself (the proxy's health, or always ``"false"`` with
  ``excludeHeadPodFromServeSvc``).
- ``raycluster_controller.go``, ``getCreatorCRDType``: the creator is the RayCluster's
  ``ray.io/originated-from-crd`` label, which pods do not carry. Pods show it two ways:
  ``setContainerEnvVars`` (``common/pod.go``) puts ``RAY_USAGE_STATS_EXTRA_TAGS=
  kuberay_version=...;kuberay_crd=<RayService|RayCluster|RayJob>`` on the head (KubeRay 1.2+),
  and ``RAY_timeout_ms_task_wait_for_death_info`` on every pod of a RayService (KubeRay 0.4+,
  added unless the template already sets it). :func:`creator_of` reads the head's tag for all
  pods of its cluster (``ray.io/cluster``), else the pod's own tag or variable.

So, per pod (``--mode label`` or ``both`` for the label, ``condition`` or ``both`` for the
condition):

=====================================  ==========================================================
pod                                    change
=====================================  ==========================================================
label ``ray.io/serve``, RayService     set ``"true"`` (what ``BuildPod`` set; the readiness probe
worker                                 decides from here on)
label ``ray.io/serve``, RayService     none: ``updateHeadPodServeLabel`` writes it
head
label ``ray.io/serve``, any other pod  remove it (KubeRay never sets it there)
label of another key                   remove it, from every pod
condition, pod declares the gate       ``True``, reason ``RayServeHealthUninstalled`` (or it
                                       stays NotReady for ever)
condition, pod without the gate        remove it (strategic merge ``$patch: delete``)
annotation ``ray-serve-health/``       remove it (``--mode label`` or ``both``): the mark an
``fallback-write``                     agent in fallback leaves beside its label write
                                       (:mod:`servehealth_common.fallback_marks`); in condition
                                       mode it is left (the aggregator's admission policy lets
                                       its account remove it only where it writes the label)
=====================================  ==========================================================

A condition an agent in fallback wrote (reason ``NoAggregator``) is handled as the aggregator's:
``True`` with the uninstalled reason on a gated pod, removed from any other.

A pod that already is so is "already right"; nothing is sent for it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from servehealth_common import fallback_marks
from servehealth_common.pod_identity import PodKey

#: KubeRay's serve label (``utils.RayClusterServingServiceLabelKey``).
KUBERAY_SERVE_LABEL = "ray.io/serve"
#: KubeRay's pod labels: the pod's Ray cluster and its node type (head or worker).
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
#: The head's usage-stats tags (``utils.RAY_USAGE_STATS_EXTRA_TAGS``), naming the creator CRD.
EXTRA_TAGS_ENV = "RAY_USAGE_STATS_EXTRA_TAGS"
#: Set on every pod of a RayService only (``utils.RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO``).
RAY_SERVICE_ENV = "RAY_timeout_ms_task_wait_for_death_info"
RAY_SERVICE = "RayService"

#: The reason and message of the condition a gated pod is left with.
UNINSTALLED_REASON = "RayServeHealthUninstalled"
UNINSTALLED_MESSAGE = (
    "the ray-serve-health aggregator was uninstalled: this condition no longer follows the "
    "Serve proxy's health (set True by serve-health-cleanup so that the pod can be Ready)"
)


class Op(enum.Enum):
    SET_LABEL = "set label"
    REMOVE_LABEL = "remove label"
    SET_CONDITION = "set condition"
    REMOVE_CONDITION = "remove condition"
    REMOVE_ANNOTATION = "remove annotation"

    @property
    def on_status(self) -> bool:
        """Whether the change is a patch of ``pods/status`` (else of the pod)."""
        return self in (Op.SET_CONDITION, Op.REMOVE_CONDITION)


@dataclass(frozen=True, slots=True)
class CleanupRules:
    """What the aggregator wrote: ``mode`` (label, condition or both), its label key and its
    condition type."""

    mode: str
    label_key: str
    condition_type: str

    @property
    def label(self) -> bool:
        return self.mode in ("label", "both")

    @property
    def condition(self) -> bool:
        return self.mode in ("condition", "both")


@dataclass(frozen=True, slots=True)
class Change:
    op: Op
    #: The label key, the condition type or the annotation.
    name: str
    #: Why, in a few words (printed with the change).
    why: str
    #: SET_LABEL: the value. SET_CONDITION: whether the status changes (a new
    #: lastTransitionTime).
    value: str = ""
    transition: bool = False

    def describe(self) -> str:
        if self.op is Op.SET_LABEL:
            return f"set label {self.name}={self.value} ({self.why})"
        if self.op is Op.SET_CONDITION:
            return f"set condition {self.name}=True, reason {UNINSTALLED_REASON} ({self.why})"
        return f"{self.op.value} {self.name} ({self.why})"


@dataclass(frozen=True, slots=True)
class PodPlan:
    key: PodKey
    changes: tuple[Change, ...]
    #: What is left as it is, and why (e.g. a RayService head's label: KubeRay writes it).
    kept: tuple[str, ...] = ()


# -- who created the pod ------------------------------------------------------------------


def _env(pod: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for container in (pod.get("spec") or {}).get("containers") or []:
        yield from container.get("env") or []


def tagged_creator(pod: Mapping[str, Any]) -> str:
    """The ``kuberay_crd`` of the pod's usage-stats tags (KubeRay puts them on heads), or ""."""
    for entry in _env(pod):
        if entry.get("name") != EXTRA_TAGS_ENV:
            continue
        for tag in str(entry.get("value") or "").split(";"):
            name, _, value = tag.partition("=")
            if name.strip() == "kuberay_crd" and value.strip():
                return value.strip()
    return ""


def _cluster(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    metadata = pod.get("metadata") or {}
    cluster = (metadata.get("labels") or {}).get(CLUSTER_LABEL)
    return (metadata.get("namespace", ""), cluster) if cluster else None


def cluster_creators(pods: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """(namespace, ``ray.io/cluster``) -> the creator CRD its head's tags name."""
    found = {}
    for pod in pods:
        cluster, creator = _cluster(pod), tagged_creator(pod)
        if cluster is not None and creator:
            found[cluster] = creator
    return found


def creator_of(pod: Mapping[str, Any], clusters: Mapping[tuple[str, str], str]) -> str:
    """``RayService``, or the other creator KubeRay would have seen (``RayCluster`` for any
    pod it cannot tell: KubeRay's own default in ``utils.GetCRDType``)."""
    cluster = _cluster(pod)
    if cluster is not None and cluster in clusters:
        return clusters[cluster]
    if tagged := tagged_creator(pod):
        return tagged
    if any(entry.get("name") == RAY_SERVICE_ENV for entry in _env(pod)):
        return RAY_SERVICE
    return "RayCluster"


# -- the changes ----------------------------------------------------------------------------


def label_changes(
    labels: Mapping[str, str], head: bool, creator: str, rules: CleanupRules
) -> tuple[tuple[Change, ...], tuple[str, ...]]:
    """The label change of one pod (none or one), and what is kept."""
    key = rules.label_key
    carried = labels.get(key)
    if key == KUBERAY_SERVE_LABEL and creator == RAY_SERVICE:
        if head:
            return (), (f"label {key}: KubeRay writes it on a RayService head",)
        if carried == "true":
            return (), ()
        why = "KubeRay sets it on RayService workers at creation"
        return (Change(Op.SET_LABEL, key, why, value="true"),), ()
    if carried is None:
        return (), ()
    if key == KUBERAY_SERVE_LABEL:
        return (Change(Op.REMOVE_LABEL, key, f"KubeRay never sets it on {creator} pods"),), ()
    return (Change(Op.REMOVE_LABEL, key, "a label of the aggregator's own"),), ()


def condition_changes(
    gated: bool, condition: Mapping[str, Any] | None, rules: CleanupRules
) -> tuple[Change, ...]:
    """The condition change of one pod (none or one). ``condition``: the pod's condition of
    the type, as read (None: absent)."""
    kind = rules.condition_type
    if not gated:
        if condition is None:
            return ()
        return (Change(Op.REMOVE_CONDITION, kind, "the pod has no readiness gate for it"),)
    status, reason = (condition.get("status"), condition.get("reason")) if condition else ("", "")
    if status == "True" and reason == UNINSTALLED_REASON:
        return ()
    why = "its readiness gate would keep the pod NotReady"
    return (Change(Op.SET_CONDITION, kind, why, transition=status != "True"),)


def mark_changes(rules: CleanupRules) -> tuple[tuple[Change, ...], tuple[str, ...]]:
    """The removal of an agent's fallback mark from a pod that carries it, or why it is kept
    (condition mode: the aggregator's admission policy refuses its account the removal)."""
    name = fallback_marks.ANNOTATION
    if rules.label:
        return (Change(Op.REMOVE_ANNOTATION, name, "the mark of an agent's fallback write"),), ()
    why = (
        f"annotation {name}: in condition mode the aggregator's admission policy lets it "
        f"remove the mark only with its label (kubectl annotate pod ... {name}-)"
    )
    return (), (why,)


def plan_pod(pod: Mapping[str, Any], creator: str, rules: CleanupRules) -> PodPlan:
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    key = PodKey(metadata.get("namespace", ""), metadata.get("name", ""))
    changes: tuple[Change, ...] = ()
    kept: tuple[str, ...] = ()
    if rules.label:
        head = labels.get(NODE_TYPE_LABEL) == "head"
        changes, kept = label_changes(labels, head, creator, rules)
    if fallback_marks.ANNOTATION in (metadata.get("annotations") or {}):
        removal, left = mark_changes(rules)
        changes, kept = changes + removal, kept + left
    if rules.condition:
        gates = {
            g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []
        }
        conditions = (pod.get("status") or {}).get("conditions") or []
        condition = next((c for c in conditions if c.get("type") == rules.condition_type), None)
        changes += condition_changes(rules.condition_type in gates, condition, rules)
    return PodPlan(key, changes, kept)


def plan(pods: Iterable[Mapping[str, Any]], rules: CleanupRules) -> list[PodPlan]:
    """A plan for each pod, in the order given."""
    pods = list(pods)
    clusters = cluster_creators(pods)
    return [plan_pod(pod, creator_of(pod, clusters), rules) for pod in pods]


# -- the patches ----------------------------------------------------------------------------


def patch_of(change: Change, now: str) -> dict[str, Any]:
    """The body of the change's patch: a JSON merge patch of the pod for labels and the
    annotation, a strategic merge patch of ``pods/status`` for conditions (``now``: an RFC 3339
    time, the condition's lastTransitionTime when its status changes)."""
    if change.op is Op.SET_LABEL:
        return {"metadata": {"labels": {change.name: change.value}}}
    if change.op is Op.REMOVE_LABEL:
        return {"metadata": {"labels": {change.name: None}}}
    if change.op is Op.REMOVE_ANNOTATION:
        return {"metadata": {"annotations": {change.name: None}}}
    if change.op is Op.REMOVE_CONDITION:
        return {"status": {"conditions": [{"type": change.name, "$patch": "delete"}]}}
    condition = {
        "type": change.name,
        "status": "True",
        "reason": UNINSTALLED_REASON,
        "message": UNINSTALLED_MESSAGE,
    }
    if change.transition:
        condition["lastTransitionTime"] = now
    return {"status": {"conditions": [condition]}}
