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

from aggregator.metrics import Metrics
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


class Core:
    def __init__(self, tracker: Tracker, registry: PodRegistry, metrics: Metrics) -> None:
        self.tracker = tracker
        self.registry = registry
        self.metrics = metrics
        self._stream_ids = itertools.count(1)
        self._agents: set[int] = set()
        self._watchers: set[_Watcher] = set()
        self._reports = metrics.reports
        metrics.track_pods(tracker.counts)

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

    def report(self, stream: int, key: PodKey, observation: Observation) -> None:
        """The hot path: one pod's report from the agent on ``stream``."""
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
        if transition is not None:
            self._apply(transition)

    def goodbye(self, stream: int, keys: Iterable[PodKey]) -> None:
        """The stream ended (agent gone, network, shutdown); its pods keep their state until
        the heartbeat TTL says otherwise."""
        self.tracker.detach(keys, stream)
        self._agents.discard(stream)
        self.metrics.agents_connected.set(len(self._agents))

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
        )
        self.metrics.transitions.labels(transition.old.name, transition.new.name, source).inc()
        if transition.label_changed:
            self.metrics.label_changes.labels(new_label).inc()
        if self.registry.label(transition.key) != new_label:
            self.registry.desire(transition.key, new_label, transition)
        for watcher in self._watchers:
            if watcher.namespace and watcher.namespace != transition.key.namespace:
                continue
            try:
                watcher.queue.put_nowait(transition)
            except asyncio.QueueFull:
                watcher.overflowed = True

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
