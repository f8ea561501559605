"""The Report stream to the aggregator, the same in both modes.

Probe loops put their results in an :class:`~node_agent.outbox.Outbox`; :class:`ReportClient`
says hello (``reports_on_change``), then sends a batch at once whenever a pod's state (or its
reason) changed (only the pods that changed, with the confirmations the aggregator asked for)
and, at the resync interval the aggregator asked for, a batch with every pod. The aggregator
knows the agent is alive from the connection (it pings it), so nothing is sent while nothing
changes. An aggregator older than 0.2.0 asks for no resync: then the agent sends every pod at
its heartbeat interval, as agents did before. A new stream starts with every pod's latest
result. It reconnects forever, with capped exponential backoff and jitter;
:class:`~node_agent.attempt_log.AttemptLog` keeps that quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import grpc

from node_agent.attempt_log import AttemptLog
from node_agent.flags import AgentFlags
from node_agent.outbox import Outbox
from node_agent.sink import NO_METRICS, MetricsSink
from node_agent.stream_listener import StreamListener
from node_agent.token import DEFAULT_TOKEN_FILE, TokenFile
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.backoff import Backoff, jittered, jittered_below
from servehealth_common.first_ends import ChildCancelled, cancels, reraise_cancel, until_first_ends
from servehealth_common.probe import ProbeResult
from servehealth_common.tls import channel_credentials
from servehealth_common.tokens import TOKEN_EXPIRED

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
#: Reports per message at most: 100 reports with 256-byte reasons stay far below the
#: aggregator's default --max-message-bytes (64 KiB), however many pods a node has.
MAX_BATCH_REPORTS = 100


#: Statuses of an aggregator that will not take this agent's reports (token, identity).
REFUSALS = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
#: After a hello refused with INVALID_ARGUMENT: retries wait up to this (at least --reconnect-max),
#: doubling up to PERMANENT_RETRY_MAX. Why not exit: see ReportClient._failed.
PERMANENT_RETRY_BASE = 10.0
PERMANENT_RETRY_MAX = 300.0


class StreamEnded(Exception):
    """The aggregator closed the stream without an error."""


async def connected(channel: grpc.aio.Channel) -> None:
    """Wait until ``channel`` is connected. A failed attempt (refused, unresolvable, a TLS
    handshake that failed) raises ConnectionError at once, rather than waiting out gRPC's own
    reconnection backoff: the agent's backoff (or the next ``--aggregator`` address) decides
    what comes next, so a failover costs milliseconds per dead address, not a timeout."""
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            raise ConnectionError("could not connect")  # the log line names the address
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


class ReportClient:
    """One agent's Report stream: ``hello`` first, then what ``outbox`` holds, forever."""

    def __init__(
        self,
        settings: AgentFlags,
        hello: pb.Hello,
        outbox: Outbox,
        *,
        who: str,
        rng: random.Random,
        batch_window: float = 0.0,
        metrics: MetricsSink = NO_METRICS,
        listener: StreamListener | None = None,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._listener = listener or StreamListener()
        #: After a first change, wait this long for others before sending (0: send at once).
        self._batch_window = batch_window
        self.outbox = outbox
        self.connected = asyncio.Event()
        #: How often every pod is sent (the probe interval until the aggregator says): the
        #: resync interval of an aggregator that wants changes, else its heartbeat interval.
        self.full_send_interval = settings.interval
        #: Whether the aggregator wants changes and resyncs (0.2.0 and later) or heartbeats.
        self.on_change = False
        hello.reports_on_change = True
        self._hello = pb.AgentMessage(hello=hello)
        self._who = who
        self._rng = rng
        self._sequence = 0
        self._backoff = Backoff(base=0.2, cap=settings.reconnect_max, rng=rng)
        #: After a refused hello (INVALID_ARGUMENT): see _failed.
        self._slow_backoff = Backoff(base=PERMANENT_RETRY_BASE, cap=PERMANENT_RETRY_MAX, rng=rng)
        self._hopeless = False  # a hello was refused in this round of addresses
        self._attempts = AttemptLog(log)
        #: --aggregator's addresses, tried in turn (a standby refuses with UNAVAILABLE).
        self._addresses = settings.aggregators or (settings.aggregator,)
        self._address = 0
        self._failed_in_round = 0
        #: The projected ServiceAccount token, read for every stream (None: never send one).
        self._token = (
            TokenFile(settings.token_file, required=settings.token_file != DEFAULT_TOKEN_FILE)
            if settings.token_file
            else None
        )
        self._warned_plaintext = False

    async def run(self) -> None:
        """Stream, and reconnect whenever the stream ends; never returns. Ends when its task
        is cancelled, even by a cancel that came with a stream's error."""
        since = cancels()
        while True:
            try:
                await self._stream_once()
            except Exception as error:  # never let one stream's surprise end the agent
                reraise_cancel(since, error)
                self._metrics.stream_failed()
                self._failed(error, was_connected=self.connected.is_set())
            finally:  # the stream is over (or never opened): was it accepted?
                was_connected = self.connected.is_set()
                if was_connected:
                    self.connected.clear()
                    self._metrics.connected(False)
                    self._listener.ended()
            if self._next_address(was_connected):
                log.debug("trying aggregator %s", self.address)
                continue
            if self._hopeless:
                delay = max(self._slow_backoff.next(), self.settings.reconnect_max)
                self._hopeless = False
            else:
                delay = self._backoff.next()
            log.debug("reconnecting in %.2fs", delay)
            await asyncio.sleep(delay)

    @property
    def address(self) -> str:
        """The aggregator address in use (or tried next)."""
        return self._addresses[self._address]

    def _next_address(self, was_connected: bool) -> bool:
        """Move on to the next address; True to try it at once, False to back off first
        (every address failed since the last stream that connected; with one address,
        every time, as before)."""
        if was_connected:
            self._failed_in_round = 0
        self._failed_in_round += 1
        self._address = (self._address + 1) % len(self._addresses)
        if self._failed_in_round < len(self._addresses):
            return True
        self._failed_in_round = 0
        return False

    def _failed(self, error: Exception, *, was_connected: bool) -> None:
        """Log a stream that ended or could not start, quietly (:class:`AttemptLog`). A hello
        refused with INVALID_ARGUMENT is permanent (the identity is checked at start: what is
        left is an aggregator of another version): one ERROR line, then retries minutes apart.
        Not an exit: a sidecar that exits crash-loops and makes its Ray pod not Ready, so a
        version skew in a rollout would empty every Service; alive, it needs no restart once the
        aggregator takes it, and the pull fallback probes its pod meanwhile. Token refusals keep
        the usual pace (tokens rotate, RBAC gets fixed)."""
        level, then = logging.WARNING, "retrying with backoff"
        if isinstance(error, grpc.aio.AioRpcError):
            code, details = error.code(), error.details() or ""
            condition = f"{code.name}: {details}"
            expired = code is grpc.StatusCode.UNAUTHENTICATED and details == TOKEN_EXPIRED
            if was_connected and expired:
                log.info("the stream's token expired; reconnecting with the current one")
                return
            if code in REFUSALS:
                level, condition = logging.ERROR, f"the aggregator refused this agent: {condition}"
                then = (
                    f"retrying with backoff (check --token-file {self.settings.token_file or '-'}"
                    " and the aggregator's --auth settings)"
                )
            elif code is grpc.StatusCode.INVALID_ARGUMENT and not was_connected:
                self._hopeless = True
                level = logging.ERROR
                condition = f"the aggregator refused this agent's hello: {condition}"
                then = (
                    "retrying will not help soon: retrying less and less often, every 5 minutes "
                    "at most (do the agent's and the aggregator's versions match?)"
                )
        elif isinstance(error, TimeoutError | OSError | StreamEnded):
            condition = str(error) or type(error).__name__
        else:
            unexpected = f"stream failed: {error!r}"
            self._attempts.failed(self.address, unexpected, level=logging.ERROR, exc_info=True)
            return
        if was_connected and level == logging.WARNING:
            condition = f"stream ended: {condition}"
        self._attempts.failed(self.address, condition, level=level, then=then)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The call metadata of a new stream: the current token, if there is one."""
        token = self._token.read() if self._token is not None else None
        if token is None:
            return None
        if not self.settings.tls_ca and not self._warned_plaintext:
            self._warned_plaintext = True
            log.warning(
                "sending the ServiceAccount token over a plaintext connection: anyone on the "
                "path can read it and report as this agent until it expires; use TLS (--tls-ca)"
            )
        return (("authorization", f"Bearer {token}"),)

    def _batch(self, items: list[tuple[pb.PodRef | None, ProbeResult]]) -> pb.AgentMessage:
        reports = []
        for pod, result in items:
            self._sequence += 1
            report = pb.PodReport(
                pod=pod,
                state=int(result.state),
                reason=result.reason,
                http_status=result.http_status,
                sequence=self._sequence,
            )
            report.probe_latency.FromNanoseconds(round(result.latency * 1e9))
            reports.append(report)
        return pb.AgentMessage(reports=pb.ReportBatch(reports=reports))

    def _channel(self) -> grpc.aio.Channel:
        """A new channel; over TLS its credentials are read from the files now (rotation)."""
        settings = self.settings
        if not settings.tls_ca:
            return grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        credentials = channel_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
        return grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)

    async def _stream_once(self) -> None:
        settings = self.settings
        async with self._channel() as channel:
            async with asyncio.timeout(settings.connect_timeout):
                await connected(channel)
                call = pb_grpc.ReportServiceStub(channel).Report(metadata=self._metadata())
                await call.write(self._hello)
                first = await call.read()
            try:
                self._apply(first)
                self._backoff.reset()
                self._slow_backoff.reset()
                self.connected.set()
                self._metrics.connected(True)
                self._listener.accepted()
                log.info(
                    "connected to aggregator %s as %s%s",
                    self.address,
                    self._who,
                    self._attempts.connected(self.address),
                )
                # Not a TaskGroup: see servehealth_common.first_ends (a lost SIGTERM).
                await until_first_ends(
                    self._read_forever(call), self._write_forever(call), names=("read", "write")
                )
            except ChildCancelled:  # gRPC cancelled the call under the reader, not us
                raise StreamEnded("the stream was cancelled") from None
            finally:
                call.cancel()

    def _apply(self, message: pb.AggregatorMessage | object) -> None:
        if message is grpc.aio.EOF:
            raise StreamEnded("aggregator closed the stream")
        assert isinstance(message, pb.AggregatorMessage)
        kind = message.WhichOneof("kind")
        if kind == "pod":
            self._listener.pod_view(message.pod)
        if kind != "settings":
            return  # an Ack, a pod's view, or a kind this agent does not know
        settings = message.settings
        self._listener.settings(settings.writes if settings.HasField("writes") else None)
        self._listener.fleet(settings.fleet_size)
        resync = settings.resync_interval.ToNanoseconds() / 1e9
        on_change = resync > 0
        interval = resync if on_change else settings.heartbeat_interval.ToNanoseconds() / 1e9
        # No interval (0) keeps the one before.
        interval = (
            max(interval, MIN_HEARTBEAT_INTERVAL) if interval > 0 else self.full_send_interval
        )
        per_change = max(1, settings.reports_per_change) if on_change else 1
        per_failure = max(1, settings.reports_per_failure or per_change) if on_change else 1
        outbox = self.outbox
        before = self.full_send_interval, self.on_change
        counts = outbox.reports_per_change, outbox.reports_per_failure
        if (interval, on_change, per_change, per_failure) == (*before, *counts):
            return
        self.full_send_interval, self.on_change = interval, on_change
        outbox.reports_per_change, outbox.reports_per_failure = per_change, per_failure
        if on_change:
            log.info(
                "aggregator asks for changes (%d reports each to serving, %d to failing) and a "
                "resync every %.3gs",
                per_change,
                per_failure,
                self.full_send_interval,
            )
        else:
            log.info("aggregator asks for a heartbeat every %.3gs", self.full_send_interval)

    async def _read_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            self._apply(await call.read())

    def _next_full_send(self, now: float, first: bool) -> float:
        """When to send every pod next: a heartbeat interval (jittered), or a resync interval
        jittered only shorter, the first at a random point of it (the agents that reconnect
        together after a restart do not resync together)."""
        interval = self.full_send_interval
        if not self.on_change:
            return now + jittered(interval, self._rng)
        if first:
            return now + self._rng.uniform(0.1, 1.0) * interval
        return now + jittered_below(interval, self._rng)

    async def _write_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        loop = asyncio.get_running_loop()
        outbox = self.outbox
        # A fresh stream starts with every latest result so the aggregator knows at once.
        outbox.resend_all()
        # The full send keeps its own deadline: changes of one pod never delay the others'.
        full_at = self._next_full_send(loop.time(), first=True)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(full_at):
                    await outbox.changed.wait()
            if self._batch_window and loop.time() < full_at:
                # A DaemonSet agent probes its pods in rounds: their changes go together.
                await asyncio.sleep(self._batch_window)
            outbox.changed.clear()
            everything = loop.time() >= full_at
            if everything:
                full_at = self._next_full_send(loop.time(), first=False)
            items = outbox.take(everything=everything)
            for start in range(0, len(items), MAX_BATCH_REPORTS):
                batch = self._batch(items[start : start + MAX_BATCH_REPORTS])
                async with asyncio.timeout(self.settings.connect_timeout):
                    await call.write(batch)
