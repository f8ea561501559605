"""The sidecar agent: one probe loop for the local proxy and one Report stream.

The probe loop (:class:`~node_agent.probing.PodProbe`, :attr:`Agent.probe`) keeps the proxy's
latest result and puts every result in an :class:`~node_agent.outbox.Outbox`, which raises
its ``changed`` event when the state differs from the last one; the stream
(:class:`~node_agent.stream.ReportClient`, :attr:`Agent.stream`) sends a report at once on a
change, otherwise a resync per interval the aggregator asked for, and reconnects forever.
The DaemonSet agent (:mod:`node_agent.daemonset`) is built from the same two pieces. Both
tell a :class:`~node_agent.sink.MetricsSink` what they do (``--metrics-listen``), and both
write for their own pods when no aggregator accepts their stream for ``--fallback-after``
(:class:`~node_agent.fallback.runner.FallbackRunner`, :attr:`Agent.fallback`): the sidecar
loads the Kubernetes client only then.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import random

from node_agent import __version__
from node_agent.fallback.decider import Fallback
from node_agent.fallback.ports import WriterLike
from node_agent.fallback.rules import WhosePods
from node_agent.fallback.runner import FallbackRunner
from node_agent.fallback.setup import fallback_core
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from node_agent.outbox import Outbox
from node_agent.probing import PodProbe
from node_agent.sink import NO_METRICS, MetricsSink
from node_agent.stream import ReportClient
from node_agent.watchdog import Watchdog
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, ProbeResult

#: The sidecar's one pod in its outbox (its reports leave ``pod`` unset: the hello names it).
OWN_POD = "own pod"


class Agent:
    def __init__(
        self,
        settings: AgentFlags,
        identity: SidecarPod,
        prober: Prober,
        *,
        rng: random.Random | None = None,
        watchdog: Watchdog | None = None,
        metrics: MetricsSink = NO_METRICS,
    ) -> None:
        rng = rng or random.Random()
        self.outbox = outbox = Outbox()
        self._identity = identity
        self._metrics = metrics
        self._settings = settings
        self._key = key = PodKey(identity.namespace, identity.name)
        self._who = f"{identity} (sidecar)"
        core = fallback_core(settings, WhosePods(pod=key, uid=identity.uid), rng)
        self.fallback = FallbackRunner(core, self._open_writer, metrics=metrics, own_pod=key)
        grpc_address = settings.grpc_proxy_address
        self.probe = PodProbe(
            settings.proxy_url,
            prober,
            interval=settings.interval,
            confirm_delay=settings.confirm_delay,
            on_result=self._result,
            rng=rng,
            name=f"proxy {settings.proxy_url}"
            + (f" and gRPC proxy {grpc_address}" if grpc_address else ""),
            grpc_address=grpc_address,
            watchdog=watchdog,
            on_turn=functools.partial(metrics.probed, OWN_POD),
        )
        hello = pb.Hello(
            mode=pb.AGENT_MODE_SIDECAR,
            pod=pb.PodRef(namespace=identity.namespace, name=identity.name, uid=identity.uid),
            node_name=identity.node_name,
            agent_version=__version__,
        )
        self.stream = ReportClient(
            settings,
            hello,
            outbox,
            who=str(identity),
            rng=rng,
            metrics=metrics,
            listener=self.fallback,
        )

    def not_ready(self) -> str | None:
        """Why the agent is not ready (``/readyz``): never, since a sidecar knows its one proxy
        from its flags. Whether the aggregator is reachable does not count."""
        return None

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.probe_forever(), name="probe")
            group.create_task(self.stream.run(), name="stream")
            group.create_task(self.fallback.run(), name="fallback")

    # -- the parts ------------------------------------------------------------------------

    def _result(self, result: ProbeResult, changed: bool) -> None:
        self.outbox.put(OWN_POD, None, result, changed)
        self.fallback.observe(self._key, result)

    async def _open_writer(self, core: Fallback) -> WriterLike | None:
        """The fallback's writer and its Kubernetes client, loaded only now (~30 MiB; the
        import takes a second or more, so in a thread: the event loop keeps running)."""
        module = await asyncio.to_thread(importlib.import_module, "node_agent.fallback.writer")
        opened: WriterLike | None = await module.open_sidecar_writer(
            self._settings, core, who=self._who, metrics=self._metrics
        )
        return opened

    async def probe_forever(self) -> None:
        identity = self._identity
        self._metrics.probing(OWN_POD, identity.namespace, identity.name)
        try:
            await self.probe.run()
        finally:
            self._metrics.not_probing(OWN_POD)
