"""What happens when an agent says hello, reports, or goes away: the aggregator's one story.

The core owns the tracker and acts on its transitions (label, log line, metrics, watchers).
It knows nothing of gRPC: servicers translate messages into calls here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from aggregator.metrics import Metrics
from aggregator.protection import Protection
from aggregator.registry import PodInfo, PodRegistry
from aggregator.tracker import Observation, PodKey, Tracker, Transition
from servehealth_common.states import ServeState, label_value

log = logging.getLogger(__name__)

#: Transitions buffered per watcher before a slow watcher is cut off.
WATCH_QUEUE_SIZE = 1024


class NotAdmitted(Exception):
    """The registry refuses to track a pod an agent named."""


class WatcherTooSlow(Exception):
    """A WatchTransitions client fell more than WATCH_QUEUE_SIZE transitions behind."""


@dataclass(eq=False)
class _Watcher:
    namespace: str
    queue: asyncio.Queue[Transition | None] = field(
        default_factory=lambda: asyncio.Queue(WATCH_QUEUE_SIZE)
    )
    overflowed: bool = False


class Puller(Protocol):
    """What the core asks of the pull fallback (aggregator.puller.Puller)."""

    def can_pull(self, key: PodKey) -> bool: ...

    def pull_now(self, keys: Iterable[PodKey]) -> None: ...


#: Failures a blind aggregator would also see; the only ones that count towards PANIC.
SUSPECT_BAD = frozenset({ServeState.UNHEALTHY, ServeState.SILENT})


class Core:
    def __init__(
        self,
        tracker: Tracker,
        registry: PodRegistry,
        metrics: Metrics,
        protection: Protection | None = None,
        *,
        panic_settle: float = 0.0,
        panic_min_pods: int = 3,
    ) -> None:
        self.tracker = tracker
        self.registry = registry
        self.metrics = metrics
        self.protection = protection or Protection(1.0, tracker.settings.heartbeat_ttl, tracker.now)
        self.panic_settle = panic_settle
        self.panic_min_pods = panic_min_pods
        self.puller: Puller | None = None
        self._held: set[PodKey] = set()
        self._stream_ids = itertools.count(1)
        self._agents: set[int] = set()
        self._watchers: set[_Watcher] = set()
        self._reports = metrics.reports
        metrics.track_pods(tracker.counts)
        metrics.track_pull_mode(self.pods_in_pull_mode)

    # -- agents -------------------------------------------------------------------------

    @property
    def agents_connected(self) -> int:
        return len(self._agents)

    def hello(self, pods: Iterable[PodInfo]) -> int:
        """An agent opened a stream for ``pods``; returns the stream's id."""
        for pod in pods:
            self.admit(pod)
        stream = next(self._stream_ids)
        self._agents.add(stream)
        self.metrics.agents_connected.set(len(self._agents))
        return stream

    def admit(self, pod: PodInfo) -> None:
        record = self.tracker.get(pod.key)
        if record is None:
            if not self.registry.admit(pod):
                raise NotAdmitted(
                    f"pod {pod.key} is not known to the {self.registry.name} backend "
                    "(not discovered yet, or not matched by the pod selector)"
                )
            log.info("tracking pod %s (node %s)", pod.key, pod.node_name or "?")
            self.tracker.register(pod.key, pod.uid, pod.node_name)
        elif pod.uid and record.uid and pod.uid != record.uid:
            if self.registry.seeds_from_cluster:  # the cluster knows which pod is current
                raise NotAdmitted(
                    f"pod {pod.key} has uid {record.uid} in the cluster, not {pod.uid} "
                    "(an agent of a replaced pod?)"
                )
            log.info("pod %s is a new pod (uid %s); starting over", pod.key, pod.uid)
            self.tracker.register(pod.key, pod.uid, pod.node_name)

    def report(self, stream: int, key: PodKey, observation: Observation) -> bool:
        """The hot path: one pod's report from the agent on ``stream``; True if it changed
        the pod's state."""
        tracker = self.tracker
        record = tracker.get(key)
        if record is None:
            self.admit(PodInfo(key))
            record = tracker.get(key)
            assert record is not None
        if record.agent != stream:
            record.agent = stream
        self._reports.inc()
        transition = tracker.observe(key, observation)
        if transition is None:
            return False
        self._apply(transition)
        return True

    def goodbye(self, stream: int, keys: Iterable[PodKey]) -> None:
        """The stream ended (agent gone, network, shutdown); its pods keep their state, and
        the puller (if it can reach them) asks their proxies at once."""
        keys = list(keys)
        self.tracker.detach(keys, stream)
        self._agents.discard(stream)
        self.metrics.agents_connected.set(len(self._agents))
        if self.puller is not None and not self.tracker.in_grace():
            self.puller.pull_now(keys)  # is the proxy still there? ask it now

    # -- pods the registry discovers (PodSink) -------------------------------------------

    def pod_seen(self, pod: PodInfo, label: str | None) -> None:
        """A discovered pod. A pod new to the tracker that already carries ``true`` starts as
        SERVING (source SEED): a restarted aggregator takes over without writing anything."""
        new = pod.key not in self.tracker
        self.tracker.register(pod.key, pod.uid, pod.node_name)
        if new and label == "true":
            self.tracker.seed(pod.key, ServeState.SERVING)

    def pod_gone(self, key: PodKey) -> None:
        if key in self.tracker:
            log.info("pod %s deleted; forgetting it", key)
        self.tracker.forget(key)

    def desired_label(self, key: PodKey) -> str | None:
        record = self.tracker.get(key)
        return record.desired_label if record is not None else None

    # -- time ---------------------------------------------------------------------------

    def expire(self) -> None:
        for transition in self.tracker.expire():
            self._apply(transition)

    # -- transitions --------------------------------------------------------------------

    def _apply(self, transition: Transition) -> None:
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
        self.metrics.transitions.labels(transition.old.name, transition.new.name, source).inc()
        if transition.label_changed:
            self.metrics.label_changes.labels(new_label).inc()
        key = transition.key
        was_bad, is_bad = transition.old in SUSPECT_BAD, transition.new in SUSPECT_BAD
        if is_bad and not was_bad:
            self.protection.turned_bad()
        if is_bad != was_bad:
            self._update_panic()
        puller = self.puller
        if transition.new is ServeState.SILENT and puller is not None and puller.can_pull(key):
            puller.pull_now([key])  # the label waits for what the pull finds
        elif is_bad and new_label == "false" and self._panic_possible():
            # A timeout or a silence may be the first of many (the aggregator's own trouble):
            # let a mass failure show itself before the pod leaves service.
            loop = asyncio.get_running_loop()
            loop.call_later(self.panic_settle, self._settled, key, transition)
        else:
            self._desire(key, new_label, transition)
        for watcher in self._watchers:
            if watcher.namespace and watcher.namespace != transition.key.namespace:
                continue
            try:
                watcher.queue.put_nowait(transition)
            except asyncio.QueueFull:
                watcher.overflowed = True

    def _desire(self, key: PodKey, label: str, transition: Transition | None = None) -> None:
        """Ask the registry for ``label`` on ``key`` unless PANIC holds a removal."""
        if label == "false" and self.protection.panic:
            self._held.add(key)
            return
        self._held.discard(key)
        if self.registry.label(key) != label:
            self.registry.desire(key, label, transition)

    def _panic_possible(self) -> bool:
        """Whether waiting ``panic_settle`` could matter: a fleet too small to panic skips it."""
        return self.panic_settle > 0 and len(self.tracker) >= self.panic_min_pods

    def _settled(self, key: PodKey, transition: Transition) -> None:
        record = self.tracker.get(key)
        if record is not None:
            self._desire(key, record.desired_label, transition)

    def _update_panic(self) -> None:
        counts = self.tracker.counts()
        bad = sum(counts[state] for state in SUSPECT_BAD)
        tracked = len(self.tracker) - counts[ServeState.UNKNOWN]
        if bad < self.panic_min_pods and not self.protection.panic:
            return
        if not self.protection.update(bad, tracked):
            return
        self.metrics.panic.set(int(self.protection.panic))
        if self.protection.panic:
            log.warning(
                "PANIC: %d of %d pods turned UNHEALTHY or SILENT within %gs; suspecting the "
                "aggregator itself (partition, API or DNS trouble): holding every write that "
                "would take a pod out of service until the share falls to %.0f%% or below",
                bad,
                tracked,
                self.protection.window,
                self.protection.threshold * 100,
            )
            return
        held, self._held = self._held, set()
        log.warning(
            "panic over: %d of %d pods UNHEALTHY or SILENT; applying %d held writes",
            bad,
            tracked,
            len(held),
        )
        for key in held:
            record = self.tracker.get(key)
            if record is not None:
                self._desire(key, record.desired_label)

    @property
    def panic(self) -> bool:
        return self.protection.panic

    def pods_in_pull_mode(self) -> int:
        """Pods no agent speaks for: without one, or with a silent one."""
        tracker = self.tracker
        now = tracker.now()
        return sum(1 for record in tracker.records() if not tracker.agent_speaks(record, now))

    # -- pulls --------------------------------------------------------------------------

    def pulled(self, key: PodKey, observation: Observation, started: float) -> None:
        """A pull of ``key`` that began at ``started`` (tracker clock) found ``observation``.

        A push that arrived after the pull began is fresher: the pull result is dropped.
        """
        record = self.tracker.get(key)
        if record is None:
            return
        if record.pushed_at is not None and record.pushed_at > started:
            return
        transition = self.tracker.observe(key, observation)
        if transition is not None:
            self._apply(transition)

    async def watch(self, namespace: str = "") -> AsyncIterator[Transition]:
        """Every transition from now on, until :meth:`close_watchers`.

        Raises WatcherTooSlow when the consumer falls behind (it would otherwise hold memory
        without bound).
        """
        watcher = _Watcher(namespace)
        self._watchers.add(watcher)
        self.metrics.watchers.set(len(self._watchers))
        try:
            while True:
                if watcher.overflowed:
                    raise WatcherTooSlow(
                        f"more than {WATCH_QUEUE_SIZE} transitions behind; reconnect and re-list"
                    )
                transition = await watcher.queue.get()
                if transition is None:
                    return
                yield transition
        finally:
            self._watchers.discard(watcher)
            self.metrics.watchers.set(len(self._watchers))

    def close_watchers(self) -> None:
        for watcher in self._watchers:
            try:
                watcher.queue.put_nowait(None)
            except asyncio.QueueFull:
                watcher.overflowed = True
