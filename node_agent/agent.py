"""The sidecar agent: a probe loop and a stream to the aggregator, joined by "the latest result".

The probe loop keeps :attr:`Agent.latest` fresh and raises :attr:`Agent.changed` when the state
differs from the last one; the stream loop sends a report at once on a change, otherwise one
heartbeat per interval the aggregator asked for, and reconnects forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import grpc

from node_agent import __version__
from node_agent.identity import Identity
from node_agent.settings import Settings
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.backoff import Backoff, jittered
from servehealth_common.probe import Prober, ProbeResult

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    # Notice a dead aggregator (or a dead network path) within ~15 s even when idle.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Our own backoff decides when to reconnect.
    ("grpc.enable_retries", 0),
)


#: A heartbeat interval the aggregator asks for is never taken below this (no busy loop).
MIN_HEARTBEAT_INTERVAL = 0.05


class StreamEnded(Exception):
    """The aggregator closed the stream without an error."""


class Agent:
    def __init__(
        self,
        settings: Settings,
        identity: Identity,
        prober: Prober,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.prober = prober
        self.rng = rng or random.Random()
        self.latest: ProbeResult | None = None
        self.changed = asyncio.Event()
        self.connected = asyncio.Event()
        self.heartbeat_interval = settings.interval
        self._sequence = 0
        self._backoff = Backoff(base=0.2, cap=settings.reconnect_max, rng=self.rng)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.probe_forever(), name="probe")
            group.create_task(self.stream_forever(), name="stream")

    # -- probing ------------------------------------------------------------------------

    async def probe_once(self) -> ProbeResult:
        """One probe; a failure that would change the state is confirmed by a second one."""
        previous = self.latest.state if self.latest is not None else None
        return await self.prober.probe_confirmed(
            self.settings.proxy_url, previous, self.settings.confirm_delay
        )

    async def probe_forever(self) -> None:
        while True:
            result = await self.probe_once()
            previous, self.latest = self.latest, result
            if previous is None or previous.state is not result.state:
                log.info(
                    "proxy %s: %s (HTTP %s, %s)",
                    self.settings.proxy_url,
                    result.state.name,
                    result.http_status or "-",
                    result.reason,
                )
                self.changed.set()
            await asyncio.sleep(jittered(self.settings.interval, self.rng))

    # -- streaming ----------------------------------------------------------------------

    async def stream_forever(self) -> None:
        while True:
            try:
                await self._stream_once()
            except grpc.aio.AioRpcError as error:
                log.warning(
                    "stream to %s ended: %s: %s",
                    self.settings.aggregator,
                    error.code().name,
                    error.details(),
                )
            except (TimeoutError, OSError, StreamEnded) as error:
                detail = str(error) or type(error).__name__
                log.warning("stream to %s ended: %s", self.settings.aggregator, detail)
            except Exception:  # never let one stream's surprise end the agent
                log.exception("stream to %s failed", self.settings.aggregator)
            self.connected.clear()
            delay = self._backoff.next()
            log.info("reconnecting in %.2fs", delay)
            await asyncio.sleep(delay)

    def _hello(self) -> pb.AgentMessage:
        identity = self.identity
        return pb.AgentMessage(
            hello=pb.Hello(
                mode=pb.AGENT_MODE_SIDECAR,
                pod=pb.PodRef(namespace=identity.namespace, name=identity.name, uid=identity.uid),
                node_name=identity.node_name,
                agent_version=__version__,
            )
        )

    def _report(self, result: ProbeResult) -> pb.AgentMessage:
        self._sequence += 1
        report = pb.PodReport(
            state=int(result.state),
            reason=result.reason,
            http_status=result.http_status,
            sequence=self._sequence,
        )
        report.probe_latency.FromNanoseconds(round(result.latency * 1e9))
        return pb.AgentMessage(reports=pb.ReportBatch(reports=[report]))

    async def _stream_once(self) -> None:
        settings = self.settings
        async with grpc.aio.insecure_channel(
            settings.aggregator, options=CHANNEL_OPTIONS
        ) as channel:
            async with asyncio.timeout(settings.connect_timeout):
                await channel.channel_ready()
                call = pb_grpc.ReportServiceStub(channel).Report()
                await call.write(self._hello())
                first = await call.read()
            try:
                self._apply(first)
                self._backoff.reset()
                self.connected.set()
                log.info("connected to aggregator %s as %s", settings.aggregator, self.identity)
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._read_forever(call))
                    group.create_task(self._write_forever(call))
            except* (StreamEnded, grpc.aio.AioRpcError, TimeoutError, OSError) as group_error:
                raise group_error.exceptions[0] from None
            finally:
                call.cancel()

    def _apply(self, message: pb.AggregatorMessage | object) -> None:
        if message is grpc.aio.EOF:
            raise StreamEnded("aggregator closed the stream")
        assert isinstance(message, pb.AggregatorMessage)
        if message.WhichOneof("kind") == "settings":
            interval = message.settings.heartbeat_interval.ToNanoseconds() / 1e9
            interval = max(interval, MIN_HEARTBEAT_INTERVAL) if interval > 0 else 0
            if interval and interval != self.heartbeat_interval:
                log.info("aggregator asks for a heartbeat every %.3gs", interval)
                self.heartbeat_interval = interval

    async def _read_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            self._apply(await call.read())

    async def _write_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        # A fresh stream starts with the latest result (if any) so the aggregator knows at once.
        if self.latest is not None:
            self.changed.set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(jittered(self.heartbeat_interval, self.rng)):
                    await self.changed.wait()
            self.changed.clear()
            if self.latest is None:
                continue
            async with asyncio.timeout(self.settings.connect_timeout):
                await call.write(self._report(self.latest))
