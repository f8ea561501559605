"""What happens when an agent says hello, reports, or goes away: the aggregator's one story.

The core owns the tracker and acts on its transitions: the label it asks of the registry, the
log line, metrics, watchers, pulls and PANIC. It knows nothing of gRPC or Kubernetes: the
servicers translate messages into calls here, the registry reports the pods it discovers
(:class:`~aggregator.registry.PodSink`), and the puller and the inspection service read pods
through the query methods at the end (nothing outside the tracker changes a pod record).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from aggregator.decision.fleet_look import SUSPECT_BAD, OnLooked
from aggregator.decision.resync import ResyncSchedule, ResyncSettings
from aggregator.decision.self_protection import ProtectionSettings, SelfProtection
from aggregator.decision.serve_view import NO_PROXY_STATES, judged, rejudged
from aggregator.decision.tracker import Observation, PodRecord, StateChange, Tracker
from aggregator.decision.transition_feed import TransitionFeed
from aggregator.metrics import Metrics
from aggregator.registry import PodRegistry, PodViewFacts
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.states import ServeState, label_value

log = logging.getLogger(__name__)


class NotAdmitted(Exception):
    """The registry refuses to track a pod an agent named."""


class PullTrigger(Protocol):
    """What the core asks of the pull fallback (:class:`aggregator.pull.puller.Puller`)."""

    def can_pull(self, key: PodKey) -> bool: ...

    def pull_now(self, keys: Iterable[PodKey]) -> object: ...

    def look(self, keys: Sequence[PodKey], on_looked: OnLooked) -> Callable[[], None]: ...


@dataclass(frozen=True, slots=True)
class CoreSettings:
    #: When a suspect failure may take a pod out of service (PANIC).
    protection: ProtectionSettings = field(default_factory=ProtectionSettings)
    #: With a backend that forgets departed pods (memory): how long a pod may stay SILENT
    #: before it is forgotten (its agent's stream is open but says nothing); 0: never.
    forget_silent_after: float = 30.0
    #: How often agents that report on change resync every pod.
    resync: ResyncSettings = field(default_factory=ResyncSettings)


@dataclass(frozen=True, slots=True)
class FleetSummary:
    """The fleet at a glance (GetSummary)."""

    counts: dict[ServeState, int]
    agents_connected: int
    panic: bool
    pods_in_pull_mode: int
    panic_held_writes: int


class Core:
    def __init__(
        self,
        tracker: Tracker,
        registry: PodRegistry,
        metrics: Metrics,
        pulls: PullTrigger,
        settings: CoreSettings,
    ) -> None:
        self._tracker = tracker
        self._registry = registry
        self._metrics = metrics
        self._protection = SelfProtection(
            tracker, pulls, registry.desire, metrics, settings.protection
        )
        self._pulls = pulls
        self._settings = settings
        self._feed = TransitionFeed(metrics.watchers.set)
        self._stream_ids = itertools.count(1)
        #: Open streams, and whether each one's agent reports on change (its stream keeps its
        #: pods alive) rather than sending heartbeats.
        self._agents: dict[int, bool] = {}
        self._resync = ResyncSchedule(settings.resync)
        tracker.allow_silence(self._resync.kept_ttl)
        metrics.track_pods(tracker.counts)
        metrics.track_pull_mode(self.pods_in_pull_mode)

    # -- agents -------------------------------------------------------------------------

    @property
    def agents_connected(self) -> int:
        return len(self._agents)

    def hello(self, pods: Iterable[PodInfo], *, reports_on_change: bool = False) -> int:
        """An agent opened a stream for ``pods``; returns the stream's id. ``reports_on_change``:
        the agent sends changes and resyncs, and its open stream keeps its pods alive."""
        for pod in pods:
            self._admit(pod)
        stream = next(self._stream_ids)
        self._agents[stream] = reports_on_change
        self._metrics.agents_connected.set(len(self._agents))
        return stream

    def fleet_size(self) -> int:
        """The fleet's size: the pods tracked, or the agents connected if more."""
        return max(len(self._tracker), len(self._agents))

    def resync_interval(self) -> float:
        """The resync interval for a stream opened now (it grows with :meth:`fleet_size`)."""
        interval = self._resync.for_fleet(self.fleet_size())
        self._tracker.allow_silence(self._resync.kept_ttl)
        return interval

    def _admit(self, pod: PodInfo) -> None:
        record = self._tracker.get(pod.key)
        if record is None:
            if not self._registry.admit(pod):
                raise NotAdmitted(
                    f"pod {pod.key} is not known to the {self._registry.name} backend "
                    "(not discovered yet, or not matched by the pod selector)"
                )
            log.info("tracking pod %s (node %s)", pod.key, pod.node_name or "?")
            self._tracker.register(pod.key, pod.uid, pod.node_name)
        elif pod.uid and record.uid and pod.uid != record.uid:
            if self._registry.seeds_from_cluster:  # the cluster knows which pod is current
                raise NotAdmitted(
                    f"pod {pod.key} has uid {record.uid} in the cluster, not {pod.uid} "
                    "(an agent of a replaced pod?)"
                )
            log.info("pod %s is a new pod (uid %s); starting over", pod.key, pod.uid)
            self._tracker.register(pod.key, pod.uid, pod.node_name)

    def report(self, stream: int, key: PodKey, observation: Observation) -> bool:
        """The hot path: one pod's report from the agent on ``stream``; True if it changed
        the pod's state. Raises NotAdmitted for a pod the registry does not know."""
        tracker = self._tracker
        if key not in tracker:
            self._admit(PodInfo(key))
        self._metrics.reports.inc()
        self._metrics.report_probe_latency.observe(observation.latency)
        observation = self._judged(key, observation)
        transition = tracker.observe(key, observation, stream, kept=self._agents.get(stream, False))
        if transition is None:
            return False
        self._apply(transition)
        return True

    def goodbye(self, stream: int, keys: Iterable[PodKey]) -> None:
        """The stream ended (agent gone, network, shutdown); its pods keep their state, and
        the puller (if it can reach them) asks their proxies at once. With a backend where
        nothing else can check on a pod (memory), its pods are forgotten instead (an agent that
        comes back registers its pod again)."""
        keys = list(keys)
        self._tracker.detach(keys, stream)
        self._agents.pop(stream, None)
        self._metrics.agents_connected.set(len(self._agents))
        if self._registry.forgets_departed:
            departed = [key for key in keys if (r := self._tracker.get(key)) and r.agent is None]
            self._forget(departed, "its agent's stream ended")
            return
        if not self._tracker.in_grace():
            self._pulls.pull_now(keys)  # is the proxy still there? ask it now

    # -- pods the registry discovers (PodSink) -------------------------------------------

    def pod_seen(self, pod: PodInfo, label: str | None, *, by_design: bool = False) -> None:
        """A discovered pod. A pod new to the tracker that already carries ``true`` starts as
        SERVING (source SEED): a restarted aggregator takes over without writing anything.
        ``by_design``: the pod carries the condition of a pod with no proxy by design (condition
        mode); it starts as NO_PROXY_BY_DESIGN, so that a restart writes nothing to it either."""
        new = pod.key not in self._tracker
        self._tracker.register(pod.key, pod.uid, pod.node_name)
        if new and label == "true":
            self._tracker.seed(pod.key, ServeState.SERVING)
        elif new and by_design:
            self._tracker.seed(
                pod.key,
                ServeState.NO_PROXY_BY_DESIGN,
                "Taken from the condition the pod carried at start (no proxy by design).",
            )

    def agent_wrote(self, key: PodKey, label: str | None) -> None:
        """An agent's fallback write, seen in the startup grace before any observation of the
        pod (its agent still reconnecting): newer than what the pod was seeded from, so it is
        seeded again from ``label``, what it carries now, rather than repaired back to an older
        view (issue 26, bug 4: no flap at the hand-over). Its first report decides after that."""
        record = self._tracker.get(key)
        if record is None or record.observed_at is not None or not self._tracker.in_grace():
            return
        state = ServeState.SERVING if label == "true" else ServeState.UNKNOWN
        self._tracker.seed(key, state, "Taken from an agent's fallback write (no report yet).")

    def pod_gone(self, key: PodKey) -> None:
        if key in self._tracker:
            log.info("pod %s deleted; forgetting it", key)
        self._tracker.forget(key)
        self._protection.forget(key)

    def _forget(self, keys: list[PodKey], why: str) -> None:
        """Forget pods the registry cannot check on (memory backend); PANIC is re-judged."""
        for key in keys:
            log.info("pod %s: %s; forgetting it (%s backend)", key, why, self._registry.name)
            self._tracker.forget(key)
            self._registry.forget(key)
            self._protection.forget(key)

    def desired_label(self, key: PodKey) -> str | None:
        """What the pod should carry (None: leave what it carries: not tracked, or its
        removal is held by PANIC or awaits a look's verdict)."""
        return self._protection.wanted(key)

    # -- time ---------------------------------------------------------------------------

    def expire(self) -> None:
        for transition in self._tracker.expire():
            self._apply(transition)
        self._protection.tick()
        forget_after = self._settings.forget_silent_after
        if self._registry.forgets_departed and forget_after > 0:
            horizon = self._tracker.now() - forget_after
            silent = [
                record.key
                for record in self._tracker.records()
                if record.state is ServeState.SILENT and record.state_since <= horizon
            ]
            self._forget(silent, f"SILENT for {forget_after:g}s")

    def hold_expiry(self, seconds: float) -> None:
        """No pod goes SILENT, and no pod is pulled, for ``seconds`` (the startup grace)."""
        self._tracker.hold_expiry(seconds)

    # -- pulls --------------------------------------------------------------------------

    def pulled(self, key: PodKey, observation: Observation, started: float) -> None:
        """A pull of ``key`` that began at ``started`` (tracker clock) found ``observation``.

        A push that arrived after the pull began is fresher: the pull result is dropped.
        """
        record = self._tracker.get(key)
        if record is None:
            return
        if record.pushed_at is not None and record.pushed_at > started:
            return
        observation = self._judged(key, observation)
        transition = self._tracker.observe(key, observation)
        if transition is not None:
            self._apply(transition)

    # -- pods with no proxy by design ---------------------------------------------------

    def _judged(self, key: PodKey, observation: Observation) -> Observation:
        """A NO_PROXY observation, judged by the Serve controller's view of the pod's node;
        any other, as it is."""
        record = self._tracker.get(key) if observation.state is ServeState.NO_PROXY else None
        if record is None:
            return observation
        return judged(observation, record, self._registry.proxy_meant(key))

    def proxy_views_changed(self, keys: Iterable[PodKey]) -> None:
        """The Serve controller's view of these pods' cluster changed: each is judged again
        (:func:`~aggregator.decision.serve_view.rejudged`), now rather than at its next report."""
        for key in keys:
            record = self._tracker.get(key)
            if record is None or record.state not in NO_PROXY_STATES:
                continue
            judged_again = rejudged(record, self._registry.proxy_meant(key))
            transition = judged_again and self._tracker.reclassify(key, *judged_again)
            if transition:
                self._apply(transition)

    def no_proxy_by_design(self, key: PodKey) -> bool:
        """Whether ``key`` has no Serve proxy by design (its condition says so)."""
        record = self._tracker.get(key)
        return record is not None and record.state is ServeState.NO_PROXY_BY_DESIGN

    # -- transitions --------------------------------------------------------------------

    def _apply(self, transition: StateChange) -> None:
        new_label = label_value(transition.new)
        source = transition.source.name.lower() if transition.source else "ttl"
        log.info(
            "pod %s: %s -> %s (source %s, label %s): %s",
            transition.key,
            transition.old.name,
            transition.new.name,
            source,
            new_label,
            transition.reason,
            extra={
                "pod": str(transition.key),
                "old": transition.old.name,
                "new": transition.new.name,
                "source": source,
                "reason": transition.reason,
                "label": new_label,
            },
        )
        self._metrics.transitions.labels(transition.old.name, transition.new.name, source).inc()
        if transition.label_changed:
            self._metrics.label_changes.labels(new_label).inc()
        key = transition.key
        if (transition.old in SUSPECT_BAD) != (transition.new in SUSPECT_BAD):
            self._protection.counts_changed()
        if transition.new is ServeState.SILENT and self._pulls.can_pull(key):
            self._pulls.pull_now([key])  # the label waits for what the pull finds
        elif transition.new in SUSPECT_BAD and new_label == "false":
            # A timeout or a silence may be the first of many (the aggregator's own trouble):
            # self-protection looks at other pods before this one leaves service.
            self._protection.remove(key, transition)
        else:
            self._protection.desire(key, new_label, transition)
        self._feed.publish(transition)

    # -- what others may read -------------------------------------------------------------

    @property
    def panic(self) -> bool:
        """PANIC: writes that would take pods out of service are being held."""
        return self._protection.held > 0

    def now(self) -> float:
        """The tracker's clock (monotonic): the time base of every record."""
        return self._tracker.now()

    def in_grace(self) -> bool:
        """Whether the startup grace still runs (agents reconnecting: nobody is pulled)."""
        return self._tracker.in_grace()

    def pod(self, key: PodKey) -> PodRecord | None:
        """The record of ``key`` (read it, never change it), or None if it is not tracked."""
        return self._tracker.get(key)

    def pods(self) -> Iterator[PodRecord]:
        """Every record (read them, never change them)."""
        return self._tracker.records()

    def tracked(self) -> int:
        return len(self._tracker)

    def counts(self) -> dict[ServeState, int]:
        """Pods per state; every state appears, zeros included."""
        return self._tracker.counts()

    def pod_info(self, key: PodKey) -> PodInfo | None:
        """What the registry knows of the pod: its node, address and Serve port."""
        return self._registry.pod(key)

    def pod_view(self, key: PodKey) -> PodViewFacts | None:
        """What the registry's watch last showed of the pod (None: a backend without one)."""
        return self._registry.view(key)

    def listen_to_views(self, listener: Callable[[PodKey], None]) -> None:
        """``listener`` hears the key of each pod whose :meth:`pod_view` may have changed."""
        self._registry.view_listener = listener

    def agent_speaks(self, record: PodRecord, now: float) -> bool:
        """Whether an agent is connected for ``record`` and pushed within the TTL."""
        return self._tracker.agent_speaks(record, now)

    def pods_in_pull_mode(self) -> int:
        """Pods the aggregator probes itself because no agent speaks for them (none without
        an address to probe, none in memory mode, none on a standby)."""
        tracker, pulls = self._tracker, self._pulls
        now = tracker.now()
        return sum(
            1
            for record in tracker.records()
            if not tracker.agent_speaks(record, now) and pulls.can_pull(record.key)
        )

    def summary(self) -> FleetSummary:
        return FleetSummary(
            self.counts(),
            self.agents_connected,
            self.panic,
            self.pods_in_pull_mode(),
            self._protection.held,
        )

    def watch(self, namespace: str = "") -> AsyncIterator[StateChange]:
        """Every transition from now on
        (:class:`~aggregator.decision.transition_feed.TransitionFeed`)."""
        return self._feed.watch(namespace)

    def close_watchers(self) -> None:
        self._feed.close()
