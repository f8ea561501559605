"""The sidecar agent: one probe loop for the local proxy and one Report stream.

The probe loop (:class:`~node_agent.probing.PodProbe`) keeps :attr:`Agent.latest` fresh and
raises :attr:`Agent.changed` when the state differs from the last one; the stream
(:class:`~node_agent.stream.ReportClient`) sends a report at once on a change, otherwise one
heartbeat per interval the aggregator asked for, and reconnects forever. The DaemonSet agent
(:mod:`node_agent.daemonset`) is built from the same two pieces.
"""

from __future__ import annotations

import asyncio
import functools
import random

from node_agent import __version__
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from node_agent.probing import PodProbe
from node_agent.stream import Outbox, ReportClient
from servehealth.v1 import servehealth_pb2 as pb
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
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.prober = prober
        self.rng = rng or random.Random()
        self.outbox = Outbox()
        self.probe = PodProbe(
            settings.proxy_url,
            prober,
            interval=settings.interval,
            confirm_delay=settings.confirm_delay,
            on_result=functools.partial(self.outbox.put, OWN_POD, None),
            rng=self.rng,
            name=f"proxy {settings.proxy_url}",
        )
        hello = pb.Hello(
            mode=pb.AGENT_MODE_SIDECAR,
            pod=pb.PodRef(namespace=identity.namespace, name=identity.name, uid=identity.uid),
            node_name=identity.node_name,
            agent_version=__version__,
        )
        self.stream = ReportClient(settings, hello, self.outbox, who=str(identity), rng=self.rng)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.probe_forever(), name="probe")
            group.create_task(self.stream_forever(), name="stream")

    # -- the parts ------------------------------------------------------------------------

    @property
    def latest(self) -> ProbeResult | None:
        return self.probe.latest

    @latest.setter
    def latest(self, result: ProbeResult | None) -> None:
        self.probe.latest = result

    @property
    def changed(self) -> asyncio.Event:
        return self.outbox.changed

    @property
    def connected(self) -> asyncio.Event:
        return self.stream.connected

    @property
    def heartbeat_interval(self) -> float:
        return self.stream.heartbeat_interval

    async def probe_once(self) -> ProbeResult:
        """One probe; a failure that would change the state is confirmed by a second one."""
        return await self.probe.probe_once()

    async def probe_forever(self) -> None:
        await self.probe.run()

    async def stream_forever(self) -> None:
        await self.stream.run()
