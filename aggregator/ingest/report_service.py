"""The Report servicer: gRPC messages and statuses in and out, nothing else.

Per stream: refuse it if this replica does not serve reports, count it per client address,
check its token (:mod:`aggregator.guard`), read its hello within ``--hello-timeout``, validate
messages (:mod:`aggregator.ingest.wire`), and hand each report to the stream's
:class:`~aggregator.ingest.report_stream.ReportStream`, which applies the admission rules and calls
the core. Every refusal becomes a status through :data:`STATUS_OF`, and is logged once per client
address and kind of refusal (:class:`LoggedOnce`; later ones at debug level).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from aggregator.decision.core import Core, NotAdmitted
from aggregator.guard import Guard
from aggregator.ingest import wire
from aggregator.ingest.admission import (
    AdmissionSettings,
    Outcome,
    Refusal,
    StreamsPerPeer,
    peer_host,
    refused,
    unknown_pod,
)
from aggregator.ingest.call_bookkeeping import CallsInFlight, LoggedOnce
from aggregator.ingest.rate_limit import StreamRateLimit
from aggregator.ingest.report_stream import ReportStream, ViewWaiters
from aggregator.lifecycle import Phase
from aggregator.metrics import Metrics
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.runtime import cancel_and_wait

log = logging.getLogger(__name__)

REPORT_METHOD = "Report"
#: Why a standby refuses a Report stream (UNAVAILABLE: agents try the next address).
STANDBY_MESSAGE = (
    "this aggregator is a standby (leader election): reports go to the leader; reconnect"
)
#: Why an aggregator refuses one before its first pod list succeeded (without leader election).
STARTING_MESSAGE = (
    "this aggregator is starting: it has not listed the pods from the Kubernetes API yet "
    "(it retries until the API answers); reconnect"
)
#: Why a stopping (or stepping down) aggregator refuses one.
SHUTDOWN_MESSAGE = "aggregator is shutting down; reconnect"
#: How long a refusal before the hello waits for it (:meth:`ReportService._hello_sent`).
HELLO_GRACE = 2.0
#: Why a Report stream is refused (UNAVAILABLE) in each phase but LEADING.
REFUSED_IN = {Phase.STARTING: STARTING_MESSAGE, Phase.STANDBY: STANDBY_MESSAGE}
STATUS_OF = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NO_HELLO: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.UNKNOWN_POD: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.WRONG_NODE: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.TOO_MANY_STREAMS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.TOO_MANY_PODS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.TOO_FAST: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def unexpected(message: pb.AgentMessage, what: str) -> Outcome:
    """The refusal of a message of the wrong kind (or of bytes that were no message)."""
    return refused(Refusal.INVALID, wire.UNDECODABLE_TEXT if message is wire.UNDECODABLE else what)


@dataclass(frozen=True, slots=True)
class ReportSettings:
    #: For agents that send heartbeats (before 0.2.0).
    heartbeat_interval: float = 1.0
    #: For agents that report on change: reports in a row after a change to SERVING, and after
    #: one away from it (the thresholds).
    reports_per_change: int = 2
    reports_per_failure: int = 1
    ack_every: int = 1
    max_reports_per_second: int = 50
    hello_timeout: float = 10.0
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    #: What the aggregator writes, for agents in fallback (AgentSettings.writes).
    writes: pb.WriteSettings = field(default_factory=pb.WriteSettings)


class ReportService:
    def __init__(
        self,
        core: Core,
        metrics: Metrics,
        settings: ReportSettings,
        *,
        phase: Callable[[], Phase],
        guard: Guard | None = None,
    ) -> None:
        self._core = core
        self._metrics = metrics
        self._settings = settings
        #: The aggregator's phase: only the leader serves reports (others: UNAVAILABLE).
        self._phase = phase
        #: --auth tokenreview: checks each stream's token against its hello (None: --auth none).
        self._guard = guard
        self._peers = StreamsPerPeer(settings.admission.max_streams_per_peer)
        self._clock = asyncio.get_running_loop().time
        self._draining: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls = CallsInFlight()
        self._logged = LoggedOnce()
        self._heartbeat_interval = wire.duration(settings.heartbeat_interval)
        #: Sidecar streams, told when their pod's view changes (sent at once, not at the
        #: next report: the view after the aggregator's own write is the one that counts).
        self._views = ViewWaiters()
        core.listen_to_views(self._views.changed)

    def _agent_settings(self, reports_on_change: bool) -> pb.AggregatorMessage:
        """What a new stream's agent is asked to do: heartbeats (an agent before 0.2.0), or
        changes plus a resync at the interval the fleet's size calls for now (and that size:
        an agent in fallback spends its share of the fleet's API budget)."""
        settings = pb.AgentSettings(heartbeat_interval=self._heartbeat_interval)
        if reports_on_change:
            settings.resync_interval.CopyFrom(wire.duration(self._core.resync_interval()))
            settings.fleet_size = self._core.fleet_size()
            settings.reports_per_change = self._settings.reports_per_change
            settings.reports_per_failure = self._settings.reports_per_failure
            settings.writes.CopyFrom(self._settings.writes)
        return pb.AggregatorMessage(settings=settings)

    def register(self, server: grpc.aio.Server) -> None:
        """Add the Report method to ``server``, with a deserializer that never raises.

        (The generated ``add_ReportServiceServicer_to_server`` uses ``FromString``: gRPC would
        end a stream of undecodable bytes with INTERNAL; here it gets INVALID_ARGUMENT.)
        """
        service = pb.DESCRIPTOR.services_by_name["ReportService"].full_name
        handlers = {
            REPORT_METHOD: grpc.stream_stream_rpc_method_handler(
                self.Report,
                request_deserializer=wire.decode_agent_message,
                response_serializer=pb.AggregatorMessage.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)

    async def _refuse(self, context: grpc.aio.ServicerContext, outcome: Outcome) -> NoReturn:
        assert outcome.refusal is not None
        if outcome.cause is not None and self._guard is not None:
            await self._guard.refuse(context, "report", outcome.cause)
        code = STATUS_OF[outcome.refusal]
        self._metrics.streams_rejected.labels(code.name).inc()
        peer = context.peer()
        first = self._logged.first((peer_host(peer), outcome.refusal))
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "rejecting report stream from %s: %s: %s%s",
            peer,
            code.name,
            outcome.message,
            " (logged once per client address and kind of refusal)" if first else "",
        )
        await context.abort(code, outcome.message)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def Report(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext,
    ) -> None:
        self._calls.started(context)
        phase = self._phase()
        if phase is not Phase.LEADING:
            log.debug("refusing a report stream from %s: %s", context.peer(), phase.value)
            await self._hello_sent(context)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, REFUSED_IN.get(phase, SHUTDOWN_MESSAGE)
            )
        # The stream is served in a task of its own so that a drain can end it with a
        # status (cancelling the handler itself would close it with no status at all).
        stream = asyncio.ensure_future(self._serve_stream(context))
        try:
            await asyncio.wait((stream, self._draining), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: gRPC cancels this handler
            await cancel_and_wait(stream, ignore=(Exception,))
            raise
        if not stream.done():
            await cancel_and_wait(stream)
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        stream.result()  # re-raise the abort of a rejected stream

    def close_streams(self) -> None:
        """End every open Report stream now with UNAVAILABLE (drain); agents reconnect."""
        if not self._draining.done():
            self._draining.set_result(None)

    async def closed(self) -> None:
        """Until no Report call is left (after :meth:`close_streams`: each one's status sent)."""
        await self._calls.idle()

    async def _serve_stream(self, context: grpc.aio.ServicerContext) -> None:
        host = peer_host(context.peer())
        outcome = self._peers.open(host)
        if not outcome.admitted:
            await self._hello_sent(context)
            await self._refuse(context, outcome)
        try:
            # The only deadline of a stream: its token's expiry (set after the hello).
            async with asyncio.timeout(None) as token_expiry:
                await self._serve_counted_stream(context, token_expiry)
        except TimeoutError:
            if self._guard is None or not token_expiry.expired():
                raise
            await self._guard.expired(context)
        finally:
            self._peers.close(host)

    async def _hello_sent(self, context: grpc.aio.ServicerContext) -> None:
        """Before a refusal: wait (briefly) for the client's first message. A status sent
        while the client is still writing its hello races in gRPC's client (the write fails
        and the call ends INTERNAL "Internal error from Core" instead of our status): an agent
        would log a new condition for what is the same refusal."""
        with contextlib.suppress(TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
            async with asyncio.timeout(min(self._settings.hello_timeout, HELLO_GRACE)):
                await context.read()

    async def _first_message(self, context: grpc.aio.ServicerContext) -> pb.AgentMessage | object:
        """The stream's first message (``grpc.aio.EOF`` if closed first), within
        ``--hello-timeout``; a stream that sends none is refused."""
        timeout = self._settings.hello_timeout
        try:
            async with asyncio.timeout(timeout):
                return await context.read()
        except TimeoutError:
            why = f"no hello within {timeout:g}s of opening the stream (--hello-timeout)"
            await self._refuse(context, refused(Refusal.NO_HELLO, why))

    async def _serve_counted_stream(
        self, context: grpc.aio.ServicerContext, token_expiry: asyncio.Timeout
    ) -> None:
        # The hello's arrival first (see _hello_sent), then the token (a stranger's hello is not
        # looked at), then the hello, within its deadline.
        first = await self._first_message(context)
        verified = await self._guard.authenticate(context) if self._guard is not None else None
        if first is grpc.aio.EOF:  # the client closed it first
            return
        assert isinstance(first, pb.AgentMessage)
        if first.WhichOneof("kind") != "hello":
            why = "the first message on a Report stream must be a hello"
            await self._refuse(context, unexpected(first, why))
        hello = first.hello
        try:
            pods = wire.pods_from_hello(hello)
        except wire.InvalidMessage as error:
            await self._refuse(context, refused(Refusal.INVALID, str(error)))
        node = None  # a DaemonSet agent's token binds its reports to the token's node
        if self._guard is not None and verified is not None:
            grant = await self._guard.bind(context, verified, hello)
            token_expiry.reschedule(grant.deadline)
            node = grant.node
        on_change = hello.reports_on_change
        try:
            stream_id = self._core.hello(pods, reports_on_change=on_change)
        except NotAdmitted as error:
            await self._refuse(context, unknown_pod(True, str(error)))
        stream = ReportStream(
            self._core,
            self._metrics,
            stream_id=stream_id,
            own=pods[0] if hello.mode == pb.AGENT_MODE_SIDECAR else None,
            node=node,
            rate_limit=StreamRateLimit(self._settings.max_reports_per_second, self._clock),
            max_pods=self._settings.admission.max_pods_per_stream,
            ack_every=self._settings.ack_every,
            on_change=on_change,
        )
        log.info(
            "agent %s connected from %s (%s, node %s, version %s, %s)",
            stream_id,
            context.peer(),
            pb.AgentMode.Name(hello.mode),
            hello.node_name[:253] or "?",  # raw clients may send anything: cut for the log
            hello.agent_version[:64] or "?",
            "reports on change" if on_change else "heartbeats",
        )
        try:
            await context.write(self._agent_settings(on_change))
            await self._send_pod_view(context, stream)
            await self._serve_reports(context, stream)
        finally:
            stream.close()
            log.info("agent %s disconnected (%d pods)", stream_id, len(stream.pods))

    async def _serve_reports(self, context: grpc.aio.ServicerContext, stream: ReportStream) -> None:
        own = stream.own_pod
        if own is None:  # a DaemonSet agent: its messages, nothing else
            while (message := await context.read()) is not grpc.aio.EOF:
                await self._serve_message(context, stream, message)
            return
        # A sidecar: the next message, or its pod's view as soon as it changes (the view is then
        # sent: the aggregator's own write, an override added), whichever comes first.
        changed = self._views.open(own)
        reading: asyncio.Future[Any] | None = None
        try:
            while True:
                reading = reading or asyncio.ensure_future(context.read())
                waiting = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait((reading, waiting), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                if not reading.done():
                    changed.clear()
                    await self._send_pod_view(context, stream)  # if it was new
                    continue
                message, reading = reading.result(), None
                if message is grpc.aio.EOF:
                    return
                await self._serve_message(context, stream, message)
        finally:
            if reading is not None:
                reading.cancel()
            self._views.close(own, changed)

    async def _serve_message(
        self, context: grpc.aio.ServicerContext, stream: ReportStream, message: pb.AgentMessage
    ) -> None:
        """One message after the hello: its reports, then an ack and the pod's view if due."""
        outcome = stream.message()
        if not outcome.admitted:
            await self._refuse(context, outcome)
        if message.WhichOneof("kind") != "reports":
            why = "expected reports: a hello may be sent only once per stream"
            await self._refuse(context, unexpected(message, why))
        sequence = 0
        changed = False
        for pod_report in message.reports.reports:
            try:
                key, observation = wire.observation_from_report(pod_report, stream.own_pod)
            except wire.InvalidMessage as error:
                await self._refuse(context, refused(Refusal.INVALID, str(error)))
            outcome, moved = stream.report(key, observation)
            if outcome.refusal is not None:
                await self._refuse(context, outcome)
            if outcome.skip:
                continue
            changed |= moved
            sequence = max(sequence, pod_report.sequence)
        if stream.ack_due(changed):
            await context.write(pb.AggregatorMessage(ack=pb.Ack(sequence=sequence)))
        await self._send_pod_view(context, stream)

    async def _send_pod_view(self, context: grpc.aio.ServicerContext, stream: ReportStream) -> None:
        """A sidecar's pod, after its settings and after each reports message if the backend's
        view of it changed (only a backend that watches pods has one)."""
        view = stream.pod_view()
        if view is not None:
            await context.write(pb.AggregatorMessage(pod=wire.pod_view_message(view)))
