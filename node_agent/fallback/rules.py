"""The rules of the agent's fallback writes (pure): what it may write, to which pods, and what
a pod carries.

- :class:`WriteRules`: the label key, the condition type and the thresholds, from the last
  aggregator's ``AgentSettings.writes`` or from the agent's flags; :func:`refusal` says why an
  agent must not write with them: a label key that is not one, or one KubeRay or Kubernetes
  relies on for other purposes (``ray.io/node-type``, ``ray.io/cluster``, anything under
  ``app.kubernetes.io/``...), or a condition type of the kubelet's (``Ready``...). A crafted
  setting must not make an agent rewrite another label.
- :class:`WhosePods`: a sidecar writes only for its own pod (namespace, name and uid from the
  downward API), a DaemonSet agent only for pods on its node (``spec.nodeName``).
- :data:`PodFacts`: a pod as read from the API, and what it carries: the aggregator's view of a
  pod too (:class:`servehealth_common.pod_writes.pod.WritablePod`), compared with what is
  wanted by the write rule both programs share (:mod:`servehealth_common.pod_writes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.pod import WritablePod
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.pod_writes.streak import NO_RUN, Run, Thresholds
from servehealth_common.states import ServeState

#: The aggregator's default thresholds (--failure-threshold, --success-threshold).
DEFAULT_FAILURE_THRESHOLD, DEFAULT_SUCCESS_THRESHOLD = 1, 2
#: --fallback-write's choices ("": only what an aggregator's settings allow).
FALLBACK_WRITES = ("", "label", "condition", "both")
#: Label keys KubeRay (and Kubernetes) rely on for other purposes: never written by an agent.
RESERVED_LABEL_KEYS = frozenset(
    {
        "ray.io/node-type",
        "ray.io/cluster",
        "ray.io/group",
        "ray.io/is-ray-node",
        "ray.io/node-group",
        "ray.io/identifier",
        "ray.io/originated-from-crd",
        "ray.io/originated-from-cr-name",
        "ray-serve-health/leader",
        "pod-template-hash",
        "controller-revision-hash",
        "pod-template-generation",
    }
)
#: Label key prefixes (the part before "/") that belong to others.
RESERVED_PREFIXES = ("app.kubernetes.io", "kubernetes.io", "k8s.io")
#: Condition types the kubelet and the scheduler own.
BUILTIN_CONDITIONS = frozenset(
    {
        "Ready",
        "ContainersReady",
        "PodScheduled",
        "Initialized",
        "PodReadyToStartContainers",
        "DisruptionTarget",
        "PodResizePending",
        "PodResizeInProgress",
    }
)
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
#: A qualified name (label keys, condition types): ``[prefix/]name``.
_QUALIFIED = re.compile(rf"((?=.{{1,253}}/){_PREFIX}/)?{_NAME}")


#: The label each side calls for (True: in service; the condition that goes with it, and
#: whether either is written, are :func:`servehealth_common.pod_writes.desired.desired`'s).
LABELS = {True: "true", False: "false"}


@dataclass(slots=True)
class Streak:
    """A pod's latest probe results: the run of the last ones on one side
    (:mod:`servehealth_common.pod_writes.streak`, as the aggregator counts them), and the
    latest state and its reason."""

    run: Run = NO_RUN
    state: ServeState = ServeState.UNKNOWN
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WriteRules:
    """What the aggregator writes, as an agent in fallback writes it ("" for none)."""

    label_key: str = ""
    condition_type: str = ""
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    success_threshold: int = DEFAULT_SUCCESS_THRESHOLD

    def targets(self) -> tuple[tuple[WriteKind, str], ...]:
        found = [(WriteKind.LABEL, self.label_key), (WriteKind.CONDITION, self.condition_type)]
        return tuple((kind, name) for kind, name in found if name)

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.failure_threshold, self.success_threshold)

    def __str__(self) -> str:
        parts = [f"label {self.label_key}"] if self.label_key else []
        parts += [f"condition {self.condition_type}"] if self.condition_type else []
        return (
            f"{' and '.join(parts) or 'nothing'} (thresholds: {self.failure_threshold} to leave, "
            f"{self.success_threshold} to enter)"
        )


def rules_from_flags(mode: str, label_key: str, condition_type: str) -> WriteRules | None:
    """The rules of ``--fallback-write`` (``""``: None, only an aggregator's), with the
    aggregator's default thresholds."""
    if not mode:
        return None
    return WriteRules(
        label_key=label_key if mode in ("label", "both") else "",
        condition_type=condition_type if mode in ("condition", "both") else "",
    )


def refusal(rules: WriteRules) -> str | None:
    """Why an agent must not write with ``rules`` (None: it may)."""
    key, condition = rules.label_key, rules.condition_type
    if not key and not condition:
        return "no label key and no condition type to write"
    if key:
        if not _QUALIFIED.fullmatch(key):
            return f"label key {key[:100]!r} is not a valid label key"
        prefix = key.rpartition("/")[0]
        reserved = key in RESERVED_LABEL_KEYS or any(
            prefix == p or prefix.endswith("." + p) for p in RESERVED_PREFIXES
        )
        if reserved:
            return f"label key {key!r} is one KubeRay or Kubernetes relies on for other purposes"
    if condition:
        if not _QUALIFIED.fullmatch(condition):
            return f"condition type {condition[:100]!r} is not a valid condition type"
        if condition in BUILTIN_CONDITIONS:
            return f"condition type {condition!r} is the kubelet's, not a readiness gate of ours"
    if rules.failure_threshold < 1 or rules.success_threshold < 1:
        return "thresholds must be at least 1"
    return None


#: One pod as read from the API (or as an aggregator's ``PodView`` tells it), as the aggregator
#: holds it too: the one view of a pod both programs decide their writes from.
PodFacts = WritablePod


@dataclass(frozen=True, slots=True)
class WhosePods:
    """Whose pods an agent may write: its own pod (sidecar: namespace, name and uid from the
    downward API) or the pods on its node (DaemonSet: ``spec.nodeName``)."""

    pod: PodKey | None = None
    uid: str = ""
    node_name: str = ""

    def refusal(self, facts: PodFacts) -> str | None:
        if self.pod is not None:
            if facts.key != self.pod:
                return f"pod {facts.key} is not this sidecar's pod {self.pod}"
            if facts.uid != self.uid:
                return f"pod {facts.key} has uid {facts.uid}, not POD_UID {self.uid}"
            return None
        if not self.node_name or facts.node_name != self.node_name:
            return f"pod {facts.key} runs on node {facts.node_name!r}, not {self.node_name!r}"
        return None


@dataclass(frozen=True, slots=True)
class Write:
    """One write an agent in fallback makes."""

    key: PodKey
    uid: str
    kind: WriteKind
    name: str  # the label key, or the condition type
    value: str  # "true"/"false", or "True"/"False"
    state: ServeState  # the latest probe's state, and its reason
    reason: str
    epoch: int = 0  # which fallback decided it (a write of an earlier one is never sent)
    #: The pod's resourceVersion the write was decided on: sent as a precondition ("": none).
    version: str = ""
    #: Why the value, where a manual override decides it rather than the probes ("": they do).
    override: str = ""

    @property
    def cause(self) -> str:
        """What decided the value, for the condition's message, the Event and the logs."""
        return self.override or f"{self.state.name}: {self.reason}"

    def __str__(self) -> str:
        return f"{self.kind.value} {self.name}={self.value} on pod {self.key}"
