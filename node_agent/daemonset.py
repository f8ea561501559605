"""The DaemonSet agent: probes every Ray pod on its node and reports them all on one stream.

It lists and watches the pods of its node (field selector ``spec.nodeName=<NODE_NAME>``, the
``--pod-selector`` labels, every namespace or the ``--namespace`` ones): the only Kubernetes
calls it makes while an aggregator answers (``list`` and ``watch`` on pods). In fallback (no
aggregator accepted its stream for ``--fallback-after``) it writes for the pods on its node
what the aggregator would (:mod:`node_agent.fallback.runner`), with what the watch shows them
to carry. Each pod with an IP gets its own
:class:`~node_agent.probing.PodProbe` of ``http://<pod IP>:<serve port>/-/healthz`` (all over
one HTTP session, at most ``--probe-concurrency`` probes in flight); a pod that vanishes, ends
(phase Succeeded or Failed) or loses its IP stops being probed and reported. Results go into
one :class:`~node_agent.outbox.Outbox`, which one :class:`~node_agent.stream.ReportClient`
(hello in ``AGENT_MODE_DAEMONSET`` with the node's name) sends to the aggregator. The agent
is ready (``/readyz``) once its first pod list succeeded: it knows what to probe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from node_agent import __version__
from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import PodFacts, WhosePods
from node_agent.fallback.runner import FallbackRunner
from node_agent.fallback.setup import fallback_core
from node_agent.fallback.writer import FallbackWriter
from node_agent.flags import AgentFlags
from node_agent.outbox import Outbox
from node_agent.probing import PodProbe
from node_agent.sink import NO_METRICS, MetricsSink
from node_agent.stream import ReportClient
from node_agent.watchdog import Watchdog
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.kube.client import KubeClient
from servehealth_common.kube.pods import (
    SERVE_GRPC_PORT_NAME,
    grpc_address,
    healthz_url,
    named_port,
    serve_port,
)
from servehealth_common.kube.watch import PodWatch
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, ProbeResult

log = logging.getLogger(__name__)

#: After a first change in a round of probes, how long the stream waits for the others of the
#: round (healthy answers take milliseconds; confirmed failures end together too).
BATCH_WINDOW = 0.05
#: Phases after which a pod's containers are gone for good.
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class PodTarget:
    """A Ray pod on this node, as far as probing it goes (labels and the rest do not matter:
    a change of them alone leaves the pod's probe running); ``facts``, what the pod carries
    (for fallback writes), is not compared."""

    namespace: str
    name: str
    uid: str
    pod_ip: str
    serve_port: int
    finished: bool
    grpc_port: int = 0  # 0: no gRPC ingress
    facts: PodFacts | None = field(default=None, compare=False)

    @classmethod
    def from_pod(
        cls, pod: dict[str, Any], default_port: int, default_grpc_port: int = 0
    ) -> PodTarget:
        metadata = pod.get("metadata") or {}
        status = pod.get("status") or {}
        return cls(
            namespace=metadata.get("namespace", ""),
            name=metadata.get("name", ""),
            uid=metadata.get("uid", ""),
            pod_ip=status.get("podIP", "") or "",
            serve_port=serve_port(pod, default_port),
            finished=status.get("phase") in FINISHED_PHASES,
            grpc_port=named_port(pod, SERVE_GRPC_PORT_NAME, default_grpc_port),
            facts=PodFacts.from_pod(pod),
        )

    @property
    def key(self) -> PodKey:
        return PodKey(self.namespace, self.name)

    @property
    def probeable(self) -> bool:
        return bool(self.pod_ip) and not self.finished

    @property
    def url(self) -> str:
        return healthz_url(self.pod_ip, self.serve_port)

    @property
    def grpc_address(self) -> str | None:
        return grpc_address(self.pod_ip, self.grpc_port) if self.grpc_port else None

    @property
    def ref(self) -> pb.PodRef:
        return pb.PodRef(namespace=self.namespace, name=self.name, uid=self.uid)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class _Probing(NamedTuple):
    target: PodTarget
    task: asyncio.Task[None]


class NodeAgent:
    """``await run()`` until cancelled. Each pod probed logs ``pod <ns>/<name>: probing <url>``
    when its probe starts, and ``... no longer probed ...`` when it stops."""

    def __init__(
        self,
        settings: AgentFlags,
        node_name: str,
        prober: Prober,
        client: KubeClient,
        *,
        rng: random.Random | None = None,
        watchdog: Watchdog | None = None,
        metrics: MetricsSink = NO_METRICS,
    ) -> None:
        self.settings = settings
        self.watchdog = watchdog
        self.metrics = metrics
        self.node_name = node_name
        self.prober = prober
        self.rng = rng or random.Random()
        self.outbox = Outbox()
        hello = pb.Hello(
            mode=pb.AGENT_MODE_DAEMONSET, node_name=node_name, agent_version=__version__
        )
        core = fallback_core(settings, WhosePods(node_name=node_name), self.rng)
        self._client = client
        self.fallback = FallbackRunner(core, self._open_writer, metrics=metrics)
        self.stream = ReportClient(
            settings,
            hello,
            self.outbox,
            who=f"node {node_name}",
            rng=self.rng,
            batch_window=BATCH_WINDOW,
            metrics=metrics,
            listener=self.fallback,
        )
        #: The node's probe grid (each agent its own phase: nodes do not probe in step).
        self._grid_phase = self.rng.uniform(0, settings.interval)
        self.watch = PodWatch(
            client,
            namespaces=settings.namespace,
            label_selector=settings.pod_selector,
            field_selector=f"spec.nodeName={node_name}",
            parse=functools.partial(
                PodTarget.from_pod,
                default_port=settings.proxy_port,
                default_grpc_port=settings.grpc_proxy_port,
            ),
            upsert=self._seen,
            delete=self._gone,
        )
        self._probing: dict[PodKey, _Probing] = {}
        self._group: asyncio.TaskGroup | None = None
        #: Whether the first pod list succeeded (every namespace asked for).
        self.listed = False

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self.stream.run(), name="stream")
                group.create_task(self._watch_pods(), name="pods")
                group.create_task(self.fallback.run(), name="fallback")
        finally:
            # The group has cancelled every probe; let the watch threads go too.
            self._group = None
            for key in self._probing:
                self.metrics.not_probing(key)
            self._probing.clear()
            self.watch.stop()

    async def _open_writer(self, core: Fallback) -> FallbackWriter:
        """The fallback's writer, on the agent's own client (its watch's)."""
        who = f"node {self.node_name} (DaemonSet)"
        return FallbackWriter(self._client, core, who=who, metrics=self.metrics, rng=self.rng)

    def not_ready(self) -> str | None:
        """Why the agent is not ready (``/readyz``): until its first pod list succeeded, it
        does not know what to probe. Whether the aggregator is reachable does not count (a
        DaemonSet waiting for it would block its rollouts while the aggregator is down)."""
        if self.listed:
            return None
        return f"the first list of the Ray pods of node {self.node_name} has not succeeded yet"

    async def _watch_pods(self) -> None:
        await self.watch.list_all()
        self.listed = True
        await self.watch.watch_forever()

    # -- what the watch tells -------------------------------------------------------------

    def _seen(self, target: PodTarget) -> None:
        self._probe(target)
        if target.facts is not None:
            self.fallback.pod_seen(target.facts)  # what it carries now

    def _probe(self, target: PodTarget) -> None:
        current = self._probing.get(target.key)
        if current is not None and current.target == target:
            return  # labels or status changed, not what the probe needs
        if current is not None:
            self._stop(target.key)
        if not target.probeable:
            if current is not None:
                log.info("pod %s: no longer probed (%s)", target, _why_not(target))
            else:
                log.debug("pod %s: not probed yet (%s)", target, _why_not(target))
            return
        self._start(target)

    def _gone(self, target: PodTarget) -> None:
        if target.key in self._probing:
            self._stop(target.key)
            log.info("pod %s: gone from node %s, no longer probed", target, self.node_name)
        self.fallback.pod_gone(target.key)

    def _result(self, target: PodTarget, result: ProbeResult, changed: bool) -> None:
        self.outbox.put(target.key, target.ref, result, changed)
        self.fallback.observe(target.key, result)

    def _start(self, target: PodTarget) -> None:
        assert self._group is not None, "pods are seen only while the agent runs"
        probe = PodProbe(
            target.url,
            self.prober,
            interval=self.settings.interval,
            confirm_delay=self.settings.confirm_delay,
            on_result=functools.partial(self._result, target),
            rng=self.rng,
            name=f"pod {target} ({target.url})",
            grid_phase=self._grid_phase,
            grpc_address=target.grpc_address,
            watchdog=self.watchdog,
            on_turn=functools.partial(self.metrics.probed, target.key),
        )
        task = self._group.create_task(probe.run(), name=f"probe {target}")
        self._probing[target.key] = _Probing(target, task)
        self.metrics.probing(target.key, target.namespace, target.name)
        grpc = f" and gRPC {target.grpc_address}" if target.grpc_address else ""
        log.info("pod %s: probing %s%s", target, target.url, grpc)

    def _stop(self, key: PodKey) -> None:
        probing = self._probing.pop(key)
        probing.task.cancel()
        self.outbox.discard(key)
        self.metrics.not_probing(key)
        self.fallback.pod_gone(key)  # its probe results (the pod is seen again after this)


def _why_not(target: PodTarget) -> str:
    return "finished" if target.finished else "no pod IP yet"
