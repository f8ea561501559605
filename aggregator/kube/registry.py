"""The Kubernetes pod registry: discovery in, label (and condition) writes and events out.

A pod's ``ray-serve-health/override`` annotation (:mod:`aggregator.decision.override`) overrules
what its health wants: every write of the pod goes through :meth:`KubeRegistry.desired`, whatever
asked for it (a transition, the watch's drift repair, the end of PANIC), and an annotation
added, removed or changed is applied at once from the watch, PANIC or not."""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aggregator.decision.override import change
from aggregator.decision.serve_view import UNKNOWN, ProxyIntent, proxy_meant
from aggregator.decision.shadow import Target, WouldBeWrites
from aggregator.decision.tracker import StateChange
from aggregator.kube.api import KubeApi
from aggregator.kube.events import EventRecorder
from aggregator.kube.kubelet_probe import KubeletWarnings
from aggregator.kube.pod_view import pod_view
from aggregator.kube.pods import KubePod, parse_pod
from aggregator.kube.shadow import ShadowEvents, ShadowWriter
from aggregator.kube.writer import Writer, WriterSettings
from aggregator.metrics import Metrics
from aggregator.pull.serve_view_poller import (
    ClusterKey,
    ServeViewPoller,
    ServeViewSettings,
    dashboard_url,
)
from aggregator.registry import PodRegistry, PodSink, PodViewFacts
from servehealth_common import fallback_marks
from servehealth_common.kube.watch import PodWatch
from servehealth_common.override import NONE, Override
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.desired import Desired, Known, desired
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind
from servehealth_common.runtime import cancel_and_wait
from servehealth_common.states import ServeState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KubeSettings:
    namespaces: tuple[str, ...]
    pod_selector: str
    proxy_port: int
    label_key: str
    mode: str  # label | condition | both
    condition_type: str
    events: bool
    qps: float
    burst: int
    concurrency: int
    watch_timeout: int = 300
    #: Where Serve runs proxies, from each Ray cluster's dashboard (off by default here).
    serve_view: ServeViewSettings = field(default_factory=ServeViewSettings)
    #: Shadow mode: nothing is written (aggregator/kube/shadow.py); reads go on.
    dry_run: bool = False

    @property
    def writes_label(self) -> bool:
        return self.mode in ("label", "both")

    @property
    def writes_condition(self) -> bool:
        return self.mode in ("condition", "both")


class KubeRegistry(PodRegistry):
    name = "kubernetes"
    seeds_from_cluster = True

    def __init__(self, api: KubeApi, settings: KubeSettings, metrics: Metrics) -> None:
        self.api = api
        self.settings = settings
        self._metrics = metrics
        self._pods: dict[PodKey, KubePod] = {}
        #: Each pod's latest transition's message (its condition's), and the pods that had a
        #: transition (their condition is written even where they carry none yet).
        self._messages: dict[PodKey, str] = {}
        self._transitioned: set[PodKey] = set()
        #: Each pod's targets as last counted (:meth:`targets`), with what they came from: the
        #: pod's copy, its health and whether it has no proxy by design. The drift figures ask
        #: for every pod at each GetSummary and scrape; most have not changed since.
        self._counted: dict[PodKey, tuple[KubePod, str | None, bool, tuple[Target, ...]]] = {}
        self._kubelet = KubeletWarnings()
        metrics.pods_kubelet_checks_serve.set_function(self.pods_kubelet_checks_serve)
        self._sink: PodSink | None = None
        self.writer: Writer | ShadowWriter = Writer(
            api,
            WriterSettings(
                label_key=settings.label_key,
                condition_type=settings.condition_type,
                qps=settings.qps,
                burst=settings.burst,
                concurrency=settings.concurrency,
            ),
            metrics,
            self,
        )
        #: Discovery: Ray pods listed and watched, parsed once, watch restarts counted.
        self.discovery = PodWatch(
            api,
            namespaces=settings.namespaces,
            label_selector=settings.pod_selector,
            parse=functools.partial(parse_pod, default_port=settings.proxy_port),
            upsert=self._upsert,
            delete=lambda pod: self._delete(pod.key),
            on_restart=lambda reason: metrics.watch_restarts.labels(reason).inc(),
            watch_timeout=settings.watch_timeout,
        )
        self.events: EventRecorder | ShadowEvents | None = (
            EventRecorder(api, metrics) if settings.events else None
        )
        if settings.dry_run:  # shadow mode: the same decisions, counted instead of sent
            would_be = WouldBeWrites(lambda kind: metrics.would_be_writes.labels(kind).inc())
            self.writer = ShadowWriter(self, would_be)
            self.events = ShadowEvents(would_be) if settings.events else None
        self.serve_views = ServeViewPoller(
            settings.serve_view, self._heads, self._view_changed, metrics
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        metrics.track_writer(lambda: self.writer.pending)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, sink: PodSink) -> None:
        """List every pod (seeding the core from their labels), then watch and write."""
        self._sink = sink
        await self.discovery.list_all()
        self._tasks = [
            asyncio.create_task(self.discovery.watch_forever(), name="discovery"),
            asyncio.create_task(self.writer.run(), name="writer"),
        ]
        if self.settings.serve_view.enabled:
            # One round first (each GET has its deadline): agents' NO_PROXY reports, accepted
            # once this returns, are judged with the views already there.
            await self.serve_views.poll_all()
            self._tasks.append(asyncio.create_task(self.serve_views.run(), name="serve-views"))

    async def stop(self) -> None:
        """Stop discovery and every write (once; a second call does nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self.discovery.stop()
        await cancel_and_wait(*self._tasks)
        if self.events is not None:
            await self.events.stop()
        # Requests already sent land (or time out) before stop() returns: nothing this
        # registry wrote can arrive after it says it stopped.
        if not await self.api.drain(self.api.timeout):
            log.warning("Kubernetes API requests still in flight after %gs", self.api.timeout)
        self.api.close()

    # -- PodRegistry --------------------------------------------------------------------

    def admit(self, pod: PodInfo) -> bool:
        return pod.key in self._pods

    def desire(self, key: PodKey, value: str, transition: StateChange | None = None) -> None:
        """The core wants ``value`` for ``key`` (its health's label; the core's
        :meth:`~aggregator.registry.PodSink.desired_label` says the same): remember the
        transition's message for the condition, queue the pod for the writer, and record an
        Event if anything moves."""
        pod = self._pods.get(key)
        if pod is None:
            return
        if transition is not None:
            self._messages[key] = f"{transition.new.name}: {transition.reason}"
        self._transitioned.add(key)
        wanted = self._queue_write(key)
        if wanted.condition == NO_PROXY_BY_DESIGN and not self.settings.writes_label:
            self._kubelet.no_proxy_routed(key.namespace, pod.cluster, key.name, pod.writable.labels)
        # It moves something if the pod must be written, or a write of it is still under
        # way (the pod may never carry that write's value, but it was told it).
        moves = bool(wanted.writes) or self.writer.pending_for(key)
        if moves and self.events is not None and transition is not None and self._told(transition):
            self.events.record(pod.info, transition)

    def desired(self, key: PodKey) -> Desired:
        """What ``key`` should carry now (:class:`~aggregator.kube.writer.PodStates`): from the
        pod as the watch last showed it, the core's label for it, the latest transition's
        message; a condition nobody wrote yet waits for the pod's first transition."""
        pod = self._pods.get(key)
        if pod is None or self._sink is None:
            return Desired()
        health = self._sink.desired_label(key)
        message = self._messages.get(key)
        return self._desired(pod, health, message=message, repair=key not in self._transitioned)

    def _queue_write(self, key: PodKey) -> Desired:
        """Hand ``key`` to the writer, with what it should carry now (returned)."""
        wanted = self.desired(key)
        self.writer.enqueue(key, wanted)
        return wanted

    def _desired(
        self,
        pod: KubePod,
        health: str | None,
        *,
        message: str | None = None,
        repair: bool = False,
        by_design: bool | None = None,
    ) -> Desired:
        """What ``pod`` should carry when its health calls for ``health`` (None: leave it):
        :func:`~servehealth_common.pod_writes.desired.desired`, from the pod as the watch last
        showed it and the core's judgement of its proxy (``by_design``, if already asked)."""
        if by_design is None:
            by_design = self._by_design(pod.key)
        known = Known(
            health,
            writes_label=self.settings.writes_label,
            writes_condition=self.settings.writes_condition,
            gated=self.settings.condition_type in pod.writable.readiness_gates,
            override=pod.writable.override,
            by_design=by_design,
            label=pod.writable.carried(WriteKind.LABEL, self.settings.label_key),
            condition=pod.writable.carried(WriteKind.CONDITION, self.settings.condition_type),
            message=message,
            repair=repair,
        )
        return desired(known)

    def _by_design(self, key: PodKey) -> bool:
        return self._sink is not None and self._sink.no_proxy_by_design(key)

    def override(self, key: PodKey) -> Override:
        pod = self._pods.get(key)
        return pod.writable.override if pod is not None else NONE

    def overrides(self) -> dict[str, int]:
        """Pods whose override is honoured, by value."""
        values = (pod.writable.override.value for pod in self._pods.values())
        return dict(Counter(value for value in values if value is not None))

    def _told(self, transition: StateChange) -> bool:
        """Whether ``transition`` changes what the pod is told: its label, or its condition
        (NO_PROXY_BY_DESIGN's is True where other failures' is False)."""
        by_design = ServeState.NO_PROXY_BY_DESIGN
        return transition.label_changed or (
            self.settings.writes_condition
            and (transition.old is by_design) != (transition.new is by_design)
        )

    def changed_by_agents(self, since: datetime.datetime | None) -> int:
        """Pods whose fallback mark (an agent wrote them: servehealth_common.fallback_marks)
        is newer than ``since`` (None: any mark), compared at the mark's resolution."""
        return sum(
            1
            for pod in self._pods.values()
            if (mark := pod.writable.fallback_mark) is not None
            and (since is None or fallback_marks.written_after(mark, since))
        )

    def targets(self, key: PodKey, health: str | None) -> tuple[Target, ...]:
        """The label and, for a pod with the readiness gate, the condition, as the mode says:
        the pod's desired state when its health calls for ``health`` (the override first;
        none where nothing is wanted). Counted again only when the pod's copy, ``health`` or
        its proxy's judgement changed."""
        pod = self._pods.get(key)
        if pod is None:
            return ()
        by_design = self._by_design(key)
        counted = self._counted.get(key)
        if counted is not None and counted[0] is pod and counted[1:3] == (health, by_design):
            return counted[3]
        wanted = self._desired(pod, health, by_design=by_design)
        found = tuple((kind, self.carried(key, kind), value) for kind, value in wanted.targets())
        self._counted[key] = (pod, health, by_design, found)
        return found

    def pod(self, key: PodKey) -> PodInfo | None:
        pod = self._pods.get(key)
        return pod.info if pod else None

    def pods_kubelet_checks_serve(self) -> int:
        return sum(pod.kubelet_checks_serve for pod in self._pods.values())

    def view(self, key: PodKey) -> PodViewFacts | None:
        pod = self._pods.get(key)
        return pod_view(pod, self.settings.label_key, self.settings.condition_type) if pod else None

    def proxy_meant(self, key: PodKey) -> ProxyIntent:
        pod = self._pods.get(key)
        if pod is None or not pod.cluster:
            return UNKNOWN
        view = self.serve_views.view((key.namespace, pod.cluster))
        return proxy_meant(view, pod.info.pod_ip, head=pod.head)

    # -- the Ray clusters' dashboards (ServeViewPoller) ---------------------------------

    def _dashboard(self, pod: KubePod) -> str | None:
        port = pod.dashboard_port or self.settings.serve_view.dashboard_port
        return dashboard_url(pod.info.pod_ip, port) if pod.info.pod_ip else None

    def _heads(self) -> Mapping[ClusterKey, str | None]:
        """Each Ray cluster with tracked pods, and its head's dashboard (None: not known)."""
        heads: dict[ClusterKey, str | None] = {}
        for pod in self._pods.values():
            if not pod.cluster:
                continue
            cluster = (pod.key.namespace, pod.cluster)
            if pod.head:
                heads[cluster] = self._dashboard(pod)
            else:
                heads.setdefault(cluster, None)
        return heads

    def _view_changed(self, cluster: ClusterKey) -> None:
        if self._sink is not None:
            keys = [
                key for key, pod in self._pods.items() if (key.namespace, pod.cluster) == cluster
            ]
            self._sink.proxy_views_changed(keys)

    # -- discovery callbacks ------------------------------------------------------------

    def _upsert(self, pod: KubePod) -> None:
        known = self._pods.get(pod.key)
        if known is not None and pod.writable.earlier_than(known.writable):
            # A watch event of our own earlier write, arriving after the answer to a later
            # one (label and condition patches of one transition): it shows a state that is
            # already gone, and "repairing" it would be a spurious write.
            return
        self._keep(pod)
        self.views_changed(pod.key)
        self._kubelet.seen(pod.key.namespace, pod.cluster, pod.key.name, pod.kubelet_checks_serve)
        assert self._sink is not None
        gated = (
            self.settings.writes_condition
            and self.settings.condition_type in pod.writable.readiness_gates
        )
        condition = self.carried(pod.key, WriteKind.CONDITION) if gated else None
        by_design = condition == NO_PROXY_BY_DESIGN
        # Seeded SERVING only where everything this aggregator writes on the pod says so: in
        # condition mode the label is not ours (KubeRay puts ray.io/serve=true on a new worker,
        # whose condition must still be written once), and a gated pod's condition is.
        label_now = pod.writable.carried(WriteKind.LABEL, self.settings.label_key)
        said = [label_now] if self.settings.writes_label else []
        said += ["true" if condition == "True" else None] if gated else []
        label = "true" if said and all(value == "true" for value in said) else None
        self._sink.pod_seen(pod.info, label, by_design=by_design)
        mark = pod.writable.fallback_mark
        if known is not None and mark not in (None, known.writable.fallback_mark):
            self._sink.agent_wrote(pod.key, label)  # newer than the seed: no repair back
        if pod.head and pod.cluster:
            self.serve_views.head_seen((pod.key.namespace, pod.cluster), self._dashboard(pod))
        before = known.writable.override if known is not None else None
        # Level-triggered: whatever changed (someone else's write, an override added or
        # removed, our own write's echo), the writer compares what the pod should carry with
        # what it carries and writes the difference. A condition nobody wrote yet is not
        # drift: it is written with the pod's first transition (or its override).
        moves = bool(self._queue_write(pod.key).writes)
        if pod.writable.override != before:
            self._override_changed(pod, before, moves)

    def _override_changed(self, pod: KubePod, before: Override | None, moves: bool) -> None:
        """An Event and a log line for an override applied, removed or ignored. A pod seen for
        the first time (a restart) gets one only if its override moves something."""
        found = change(before or NONE, pod.writable.override)
        if found is None or (before is None and found.kind == "applied" and not moves):
            return
        log_at = logging.WARNING if found.warning else logging.INFO
        log.log(log_at, "pod %s: %s", pod.key, found.message)
        if self.events is not None:
            self.events.record_override(pod.info, found)

    def _delete(self, key: PodKey) -> None:
        self._pods.pop(key, None)
        self._messages.pop(key, None)
        self._transitioned.discard(key)
        self._counted.pop(key, None)
        self.writer.forget(key)
        if self._sink is not None:
            self._sink.pod_gone(key)

    # -- the pod copies the writer reads and updates (PodStates) --------------------------

    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        pod = self._pods.get(key)
        return pod.writable.carried(kind, self._name(kind)) if pod is not None else None

    def _name(self, kind: WriteKind) -> str:
        """The label key or condition type this aggregator writes for ``kind``."""
        return self.settings.label_key if kind is WriteKind.LABEL else self.settings.condition_type

    def marked(self, key: PodKey) -> bool:
        pod = self._pods.get(key)
        return pod is not None and pod.writable.fallback_annotated

    def written(self, key: PodKey, kind: WriteKind, value: str, body: dict[str, Any]) -> None:
        pod = self._pods.get(key)
        if pod is None:
            return
        if body.get("metadata"):
            written = parse_pod(body, self.settings.proxy_port)
            # (An answer older than the copy was overtaken by a later version of the pod, which
            # shows this write and anything after it, judged as drift by the watch.)
            self._keep(pod if written.writable.earlier_than(pod.writable) else written)
        else:
            carrying = pod.writable.carrying(kind, self._name(kind), value)
            self._keep(replace(pod, writable=carrying))
        self.views_changed(key)

    def _keep(self, pod: KubePod) -> None:
        """``pod`` is the copy now (its last count is forgotten: :meth:`targets` counts it
        again, and holds no earlier copy meanwhile)."""
        self._pods[pod.key] = pod
        self._counted.pop(pod.key, None)

    async def refresh(self, key: PodKey) -> None:
        body = await self.api.get_pod(key)
        self._upsert(parse_pod(body, self.settings.proxy_port))
