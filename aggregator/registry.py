"""Where pods come from and where their serve label goes.

A backend answers two questions for the core: may this pod be tracked (``admit``), and make
this pod say this (``desire``): it writes what the pod's desired state
(:func:`servehealth_common.pod_writes.desired.desired`) differs in from what the pod
``carried`` (:func:`servehealth_common.pod_writes.rule.write_needed`). The in-memory backend
needs no cluster: pods register through their agent's hello and labels live in a dict.
"""

from __future__ import annotations

import abc
import datetime
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from aggregator.decision.serve_view import UNKNOWN, ProxyIntent
from aggregator.decision.shadow import Target, WouldBeWrites
from aggregator.decision.tracker import StateChange
from servehealth_common.override import NONE, Override
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.desired import Known, desired
from servehealth_common.pod_writes.rule import WriteKind

log = logging.getLogger(__name__)


class PodSink(Protocol):
    """What a registry tells the core about pods it discovers (the core implements it)."""

    def pod_seen(self, pod: PodInfo, label: str | None, *, by_design: bool = False) -> None:
        """A pod exists (new or changed); ``label`` is the serve label it carries now;
        ``by_design``: it carries the condition of a pod with no proxy by design."""

    def agent_wrote(self, key: PodKey, label: str | None) -> None:
        """An agent's fallback write arrived (a new mark); ``label`` as in :meth:`pod_seen`."""

    def pod_gone(self, key: PodKey) -> None:
        """A pod was deleted: forget it, write nothing to it."""

    def desired_label(self, key: PodKey) -> str | None:
        """The label the core wants for ``key`` (None if it does not track it)."""

    def no_proxy_by_design(self, key: PodKey) -> bool:
        """Whether ``key`` is NO_PROXY_BY_DESIGN (its condition is True, not False)."""

    def proxy_views_changed(self, keys: Iterable[PodKey]) -> None:
        """The Serve controller's view of these pods' cluster changed: judge them again."""


@dataclass(frozen=True, slots=True)
class PodViewFacts:
    """What a backend that watches pods last saw of one (a sidecar's ``AggregatorMessage.pod``):
    enough for an agent in fallback to decide, and write, without reading its pod first."""

    key: PodKey
    uid: str
    resource_version: str
    node_name: str
    #: The value of the label the aggregator writes (None: the pod has no such label).
    label: str | None
    #: The condition the aggregator writes, as ``KubePod.conditions`` holds it ("True",
    #: "False", "Unknown" or "NoProxyByDesign"; None: the pod has no such condition).
    condition: str | None
    #: Whether the pod's spec.readinessGates declares that condition.
    gated: bool
    #: Whether the pod is under an override the aggregator honours, and which ("" none).
    overridden: bool
    override: str = ""
    #: Whether the kubelet's readiness probe checks the Serve proxy too, and the pod's Ready
    #: condition ("True", "False"; "" unknown): GetPod, ListPods (issue 27).
    kubelet_checks_serve: bool = False
    kubelet_ready: str = ""


class PodRegistry(abc.ABC):
    """The seam between the core and wherever pods live (memory or Kubernetes)."""

    name: str
    #: Whether start() registers pods the cluster already has (and seeds them from labels).
    seeds_from_cluster = False
    #: Whether the core must forget a pod whose agent left: true where nothing else can tell
    #: whether the pod still exists, or check on it (the memory backend: no watch, no pulls).
    forgets_departed = False
    #: Who hears that a pod's :meth:`view` may have changed (the Report streams of sidecars,
    #: through :meth:`aggregator.decision.core.Core.listen_to_views`).
    view_listener: Callable[[PodKey], None] | None = None

    async def start(self, sink: PodSink) -> None:  # noqa: B027 - optional hook
        """Begin discovery and writing; discovered pods are reported to ``sink``."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop background work; the default has nothing to stop."""

    @abc.abstractmethod
    def admit(self, pod: PodInfo) -> bool:
        """An agent names ``pod``: may the aggregator track it?"""

    @abc.abstractmethod
    def desire(self, key: PodKey, value: str, transition: StateChange | None = None) -> None:
        """Make the pod's label say ``value`` (applied in the background by writing backends).

        ``transition`` is the state change behind it, for events and condition messages.
        """

    def pod(self, key: PodKey) -> PodInfo | None:
        """What the backend knows of the pod (address and port for pulls)."""
        return None

    def view(self, key: PodKey) -> PodViewFacts | None:
        """What the backend's watch last showed of the pod (None: it watches no pods)."""
        return None

    def pods_kubelet_checks_serve(self) -> int:
        """Pods whose readiness probe checks the Serve proxy too (none known here)."""
        return 0

    def views_changed(self, key: PodKey) -> None:
        """What :meth:`view` shows of ``key`` may have changed: tell the view listener."""
        if self.view_listener is not None:
            self.view_listener(key)

    def proxy_meant(self, key: PodKey) -> ProxyIntent:
        """Whether the Serve controller means a proxy to run at the pod (unknown without a
        view of its cluster: the memory backend has none)."""
        return UNKNOWN

    @abc.abstractmethod
    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        """What the pod carries now for ``kind``, as far as the backend knows (None: absent)."""

    def forget(self, key: PodKey) -> None:  # noqa: B027 - optional hook
        """The core no longer tracks ``key``."""

    def override(self, key: PodKey) -> Override:
        """The pod's manual override (:mod:`aggregator.decision.override`; none without
        annotations)."""
        return NONE

    def overrides(self) -> dict[str, int]:
        """Pods whose override is honoured, by value."""
        return {}

    def changed_by_agents(self, since: datetime.datetime | None) -> int:
        """Pods an agent in fallback wrote after ``since`` (None: whenever): none here."""
        return 0

    def targets(self, key: PodKey, health: str | None) -> tuple[Target, ...]:
        """Each thing the aggregator writes to the pod: its kind, what the pod carries now, and
        the value that goes with the label its health calls for (``health``, the override
        first; none where nothing is wanted: :mod:`aggregator.decision.shadow`)."""
        if health is None:
            return ()
        return ((WriteKind.LABEL, self.carried(key, WriteKind.LABEL), health),)


class MemoryRegistry(PodRegistry):
    """Every pod an agent names is admitted; labels are kept in this process."""

    name = "memory"
    forgets_departed = True

    def __init__(
        self,
        label_key: str,
        *,
        dry_run: bool = False,
        would_write: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.label_key = label_key
        self._labels: dict[PodKey, str] = {}
        #: --dry-run: labels are not even kept in the process (they stay as they were: none).
        self._shadow = WouldBeWrites(would_write) if dry_run else None

    def admit(self, pod: PodInfo) -> bool:
        return True

    def desire(self, key: PodKey, value: str, transition: StateChange | None = None) -> None:
        carried = self.carried(key, WriteKind.LABEL)
        # The label alone, as wanted: no condition, no override, without a cluster.
        wanted = desired(Known(value, writes_label=True, writes_condition=False, label=carried))
        if self._shadow is not None:
            self._shadow.want(key, WriteKind.LABEL, carried, value)
        elif WriteKind.LABEL in wanted.writes:
            self._labels[key] = value
            log.info("label %s=%s on pod %s (memory backend)", self.label_key, value, key)

    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        return self._labels.get(key) if kind is WriteKind.LABEL else None

    def forget(self, key: PodKey) -> None:
        self._labels.pop(key, None)
        if self._shadow is not None:
            self._shadow.forget(key)
