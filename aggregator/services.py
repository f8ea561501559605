"""gRPC servicers: thin translations between ``servehealth.v1`` and the core."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from aggregator import wire
from aggregator.core import Core, NotAdmitted, WatcherTooSlow
from aggregator.tracker import PodKey
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.states import ServeState

if TYPE_CHECKING:
    from aggregator.guard import Guard

log = logging.getLogger(__name__)

REPORT_METHOD = "Report"
#: Why a standby refuses a Report stream (UNAVAILABLE: agents try the next address).
STANDBY_MESSAGE = (
    "this aggregator is a standby (leader election): reports go to the leader; reconnect"
)


# What the deserializer hands over for bytes that are not an AgentMessage: one shared empty
# message, so it reads as "no kind", and only the error branch that follows asks whether it was
# this one (no cost to a good report).
UNDECODABLE = pb.AgentMessage()


def decode_agent_message(data: bytes) -> pb.AgentMessage:
    """``AgentMessage.FromString`` that never raises (gRPC would answer INTERNAL)."""
    try:
        return pb.AgentMessage.FromString(data)
    except DecodeError:
        return UNDECODABLE


def peer_host(peer: str) -> str:
    """The client address without its port: ``"ipv4:10.1.2.3:5000"`` -> ``"10.1.2.3"``.

    ``"ipv6:[::1]:5000"`` -> ``"::1"``; an IPv4-mapped address counts as its IPv4 one; anything
    else (``unix:...``) is kept whole.
    """
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = rest.rpartition(":")[0].strip("[]")
    return host.removeprefix("::ffff:")


class ReportService(pb_grpc.ReportServiceServicer):
    def __init__(
        self,
        core: Core,
        heartbeat_interval: float,
        ack_every: int = 1,
        *,
        max_streams_per_peer: int = 64,
        max_pods_per_stream: int = 512,
        max_reports_per_second: int = 50,
        hello_timeout: float = 10.0,
        guard: Guard | None = None,
    ) -> None:
        self._core = core
        #: --auth tokenreview: checks each stream's token against its hello (None: --auth none).
        self._guard = guard
        self._ack_every = ack_every
        self._max_streams_per_peer = max_streams_per_peer
        self._max_pods_per_stream = max_pods_per_stream
        self._max_reports_per_second = max_reports_per_second
        self._hello_timeout = hello_timeout
        self._streams_by_peer: dict[str, int] = {}
        self._clock = asyncio.get_running_loop().time
        self._draining: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: A standby (leader election) ends every Report stream at once with UNAVAILABLE.
        self.standby = False
        self._settings = pb.AggregatorMessage(
            settings=pb.AgentSettings(heartbeat_interval=wire.duration(heartbeat_interval))
        )

    def register(self, server: grpc.aio.Server) -> None:
        """Add the Report method to ``server``, with a deserializer that never raises.

        (The generated ``add_ReportServiceServicer_to_server`` uses ``FromString``: gRPC would
        end a stream of undecodable bytes with INTERNAL; here it gets INVALID_ARGUMENT.)
        """
        service = pb.DESCRIPTOR.services_by_name["ReportService"].full_name
        handlers = {
            REPORT_METHOD: grpc.stream_stream_rpc_method_handler(
                self.Report,
                request_deserializer=decode_agent_message,
                response_serializer=pb.AggregatorMessage.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
    ) -> None:
        self._core.metrics.streams_rejected.labels(code.name).inc()
        log.warning("rejecting report stream from %s: %s: %s", context.peer(), code.name, message)
        await context.abort(code, message)

    async def Report(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext,
    ) -> None:
        if self.standby:
            log.debug("refusing a report stream from %s: standby", context.peer())
            await context.abort(grpc.StatusCode.UNAVAILABLE, STANDBY_MESSAGE)
        # The stream is served in a task of its own so that a drain can end it with a
        # status (cancelling the handler itself would close it with no status at all).
        stream = asyncio.ensure_future(self._serve_stream(context))
        try:
            await asyncio.wait((stream, self._draining), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: gRPC cancels this handler
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await stream
            raise
        if not stream.done():
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "aggregator is shutting down; reconnect"
            )
        stream.result()  # re-raise the abort of a rejected stream

    def close_streams(self) -> None:
        """End every open Report stream now with UNAVAILABLE (drain); agents reconnect."""
        if not self._draining.done():
            self._draining.set_result(None)

    async def _serve_stream(self, context: grpc.aio.ServicerContext) -> None:
        peer = peer_host(context.peer())
        open_streams = self._streams_by_peer.get(peer, 0)
        if open_streams >= self._max_streams_per_peer:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many report streams from {peer}: {open_streams} are open "
                f"(--max-streams-per-peer {self._max_streams_per_peer})",
            )
        self._streams_by_peer[peer] = open_streams + 1
        try:
            # The only deadline of a stream: its token's expiry (set after the hello).
            async with asyncio.timeout(None) as token_expiry:
                await self._serve_counted_stream(context, token_expiry)
        except TimeoutError:
            if self._guard is None or not token_expiry.expired():
                raise
            await self._guard.expired(context)
        finally:
            left = self._streams_by_peer[peer] - 1
            if left:
                self._streams_by_peer[peer] = left
            else:
                del self._streams_by_peer[peer]

    async def _serve_counted_stream(
        self, context: grpc.aio.ServicerContext, token_expiry: asyncio.Timeout
    ) -> None:
        # The token first (no hello read for a stranger), then the hello, within its deadline.
        verified = await self._guard.authenticate(context) if self._guard is not None else None
        try:
            async with asyncio.timeout(self._hello_timeout):
                first = await context.read()
        except TimeoutError:
            await self._reject(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no hello within {self._hello_timeout:g}s of opening the stream (--hello-timeout)",
            )
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("kind") != "hello":
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "a message on this Report stream could not be decoded as an AgentMessage"
                if first is UNDECODABLE
                else "the first message on a Report stream must be a hello",
            )
        try:
            pods = wire.pods_from_hello(first.hello)
        except wire.InvalidMessage as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        check_pod = None  # a DaemonSet agent's token binds its reports to the token's node
        if self._guard is not None and verified is not None:
            grant = await self._guard.bind(context, verified, first.hello)
            token_expiry.reschedule(grant.deadline)
            if grant.node is not None:
                check_pod = functools.partial(self._guard.check_pod, context, grant.node)
        own_pod = pods[0].key if first.hello.mode == pb.AGENT_MODE_SIDECAR else None
        try:
            stream = self._core.hello(pods)
        except NotAdmitted as error:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, str(error))
        keys: set[PodKey] = {pod.key for pod in pods}
        log.info(
            "agent %s connected from %s (%s, node %s, version %s)",
            stream,
            context.peer(),
            pb.AgentMode.Name(first.hello.mode),
            first.hello.node_name or "?",
            first.hello.agent_version or "?",
        )
        report = self._core.report
        ack_every, unacked = self._ack_every, 0
        max_pods = self._max_pods_per_stream
        # Token bucket of --max-reports-per-second messages, burst = the rate, refilled lazily:
        # a message costs one integer decrement; the clock is read only when the budget is
        # spent (once every `rate` messages at most).
        clock, rate = self._clock, self._max_reports_per_second
        budget, refilled = rate, clock()
        try:
            await context.write(self._settings)
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                budget -= 1
                if budget < 0:
                    now = clock()
                    earned = int((now - refilled) * rate)
                    if earned < 1:
                        await self._reject(
                            context,
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"more than {rate} report messages per second on this stream "
                            "(--max-reports-per-second)",
                        )
                    if earned >= rate:  # the bucket filled up: it holds `rate` again
                        budget, refilled = rate - 1, now
                    else:
                        budget, refilled = earned - 1, refilled + earned / rate
                if message.WhichOneof("kind") != "reports":
                    await self._reject(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "a message on this Report stream could not be decoded as an AgentMessage"
                        if message is UNDECODABLE
                        else "expected reports: a hello may be sent only once per stream",
                    )
                sequence = 0
                changed = False
                for pod_report in message.reports.reports:
                    try:
                        key, observation = wire.observation_from_report(pod_report, own_pod)
                        if key not in keys:  # a pod new on this stream
                            # PERMISSION_DENIED for another node's pod; False: not on a node yet
                            if check_pod is not None and not await check_pod(key):
                                self._core.metrics.reports_ignored.labels("pod_unscheduled").inc()
                                continue
                            if len(keys) >= max_pods:
                                await self._reject(
                                    context,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"this stream reports for more than {max_pods} pods "
                                    "(--max-pods-per-stream)",
                                )
                        changed |= report(stream, key, observation)
                    except wire.InvalidMessage as error:
                        await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
                    except NotAdmitted as error:
                        if own_pod is not None:  # a sidecar for a pod we do not know: refuse
                            await self._reject(
                                context, grpc.StatusCode.FAILED_PRECONDITION, str(error)
                            )
                        # A DaemonSet agent may see a pod before we do, or one outside our
                        # selector: skip that report, keep the stream for the node's others.
                        self._core.metrics.reports_ignored.labels("unknown_pod").inc()
                        log.debug("ignoring a report: %s", error)
                        continue
                    keys.add(key)
                    sequence = max(sequence, pod_report.sequence)
                # Acks are cumulative: one for a report that changed something, otherwise one
                # every ack_every messages (each write costs as much as a read).
                unacked += 1
                if changed or unacked >= ack_every:
                    unacked = 0
                    await context.write(pb.AggregatorMessage(ack=pb.Ack(sequence=sequence)))
        finally:
            self._core.goodbye(stream, keys)
            log.info("agent %s disconnected (%d pods)", stream, len(keys))


class InspectionService(pb_grpc.InspectionServiceServicer):
    def __init__(
        self,
        core: Core,
        label_key: str,
        wall_clock: Callable[[], float] = time.time,
        *,
        guard: Guard | None = None,
    ) -> None:
        self._core = core
        self._label_key = label_key
        self._wall_clock = wall_clock
        #: --inspection-auth tokenreview: each call must carry a genuine token (None: open).
        self._guard = guard

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if self._guard is not None:
            await self._guard.admit_call(context, "inspection")

    def _clocks(self) -> tuple[float, float]:
        return self._core.tracker.now(), self._wall_clock()

    async def ListPods(
        self, request: pb.ListPodsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPodsResponse:
        await self._authenticate(context)
        states = set(request.states)
        now, wall = self._clocks()
        pods = [
            wire.pod_message(record, now, wall)
            for record in self._core.tracker.records()
            if (not request.namespace or record.key.namespace == request.namespace)
            and (not states or int(record.state) in states)
        ]
        pods.sort(key=lambda pod: (pod.namespace, pod.name))
        return pb.ListPodsResponse(pods=pods)

    async def GetPod(self, request: pb.GetPodRequest, context: grpc.aio.ServicerContext) -> pb.Pod:
        await self._authenticate(context)
        if not request.namespace or not request.name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "namespace and name are both required"
            )
        record = self._core.tracker.get(PodKey(request.namespace, request.name))
        if record is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.namespace}/{request.name} is not tracked",
            )
        return wire.pod_message(record, *self._clocks())

    async def GetSummary(
        self, request: pb.GetSummaryRequest, context: grpc.aio.ServicerContext
    ) -> pb.Summary:
        await self._authenticate(context)
        counts = self._core.tracker.counts()
        return pb.Summary(
            pods=sum(counts.values()),
            pods_by_state={pb.ServeState.Name(int(state)): counts[state] for state in ServeState},
            agents_connected=self._core.agents_connected,
            label_key=self._label_key,
            panic=self._core.panic,
            pods_in_pull_mode=self._core.pods_in_pull_mode(),
        )

    async def WatchTransitions(
        self, request: pb.WatchTransitionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Transition]:
        await self._authenticate(context)
        try:
            async for transition in self._core.watch(request.namespace):
                yield wire.transition_message(transition, *self._clocks())
        except WatcherTooSlow as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
