"""The Report stream to the aggregator, the same in both modes.

Probe loops put their results in an :class:`Outbox`; :class:`ReportClient` says hello, then
sends a batch at once whenever a pod's state changed (only the pods that changed) and, at the
heartbeat interval the aggregator asked for, a batch with every pod. A new stream starts with
every pod's latest result. It reconnects forever, with capped exponential backoff and jitter;
:class:`AttemptLog` keeps that quiet (a condition is logged when it starts, changes and ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import grpc

from node_agent.flags import AgentFlags
from node_agent.token import DEFAULT_TOKEN_FILE, TokenFile
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.backoff import Backoff, jittered
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


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _count(number: int, what: str = "attempt") -> str:
    return f"{number} {what}{'' if number == 1 else 's'}"


_NEW_CONDITION = (
    "aggregator %s: %s%s; %s (logged again when this changes or ends; each attempt at debug level)"
)
_SAME_CONDITION = "aggregator %s: %s (attempt %d, for %s)"


@dataclass
class _Trouble:
    """One address's failures since its last stream connected."""

    condition: str  # the latest, since ``since`` (``attempts`` of them)
    since: float
    started: float  # the first failure (``total`` of them since)
    attempts: int = 1
    total: int = 1


class AttemptLog:
    """The reconnection loop's log, client-go's klog style: per aggregator address, a failure
    condition is logged when it starts, when it changes (at its own level) and when it ends
    (:meth:`connected`: how many attempts, how long); each attempt only at debug level. Each
    address has its own condition: rounds over a dead address and a standby are no changes."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._clock = logger, clock
        self._troubles: dict[str, _Trouble] = {}

    def failed(
        self,
        address: str,
        condition: str,
        *,
        level: int = logging.WARNING,
        then: str = "retrying with backoff",
        exc_info: bool = False,
    ) -> None:
        """One failed attempt on ``address`` (``condition`` says what happened)."""
        now, old = self._clock(), self._troubles.get(address)
        if old is not None and old.condition == condition:
            old.attempts += 1
            old.total += 1
            since = _seconds(now - old.since)
            self._log.debug(_SAME_CONDITION, address, condition, old.attempts, since)
            return
        new = self._troubles[address] = _Trouble(condition, now, old.started if old else now)
        was = ""
        if old is not None:
            new.total += old.total
            was = f" (was: {old.condition}, {_count(old.attempts)} in {_seconds(now - old.since)})"
        self._log.log(level, _NEW_CONDITION, address, condition, was, then, exc_info=exc_info)

    def connected(self, address: str) -> str:
        """A stream to ``address`` connected: the phrase that ends its condition, if any."""
        if (old := self._troubles.pop(address, None)) is None:
            return ""
        elapsed = _seconds(self._clock() - old.started)
        return f" after {_count(old.total, 'failed attempt')} in {elapsed} (last: {old.condition})"


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


class Outbox:
    """The latest result of every pod the agent speaks for, and which of them changed since
    they were last sent. :attr:`changed` is set when one did.

    ``pod`` is the PodRef a report names (None: the sidecar's own pod, left unset).
    """

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self._latest: dict[Hashable, tuple[pb.PodRef | None, ProbeResult]] = {}
        self._dirty: dict[Hashable, None] = {}  # an ordered set

    def put(self, key: Hashable, pod: pb.PodRef | None, result: ProbeResult, changed: bool) -> None:
        """A fresh result; ``changed`` (or a pod new here) sends it at once."""
        new = key not in self._latest
        self._latest[key] = (pod, result)
        if changed or new:
            self._dirty[key] = None
            self.changed.set()

    def discard(self, key: Hashable) -> None:
        """Stop reporting ``key`` (the pod is gone, or no longer probed)."""
        self._latest.pop(key, None)
        self._dirty.pop(key, None)

    def resend_all(self) -> None:
        """Every pod counts as changed (a new stream tells the aggregator everything at once)."""
        self._dirty = dict.fromkeys(self._latest)
        if self._dirty:
            self.changed.set()

    def take(self, everything: bool) -> list[tuple[pb.PodRef | None, ProbeResult]]:
        """What to send now: every pod (a heartbeat) or those changed since the last take."""
        keys = list(self._latest) if everything else list(self._dirty)
        self._dirty.clear()
        return [self._latest[key] for key in keys]

    def __len__(self) -> int:
        return len(self._latest)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._latest


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
    ) -> None:
        self.settings = settings
        self.outbox = outbox
        self.connected = asyncio.Event()
        #: The probe interval until the aggregator asks for something else.
        self.heartbeat_interval = settings.interval
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
        """Stream, and reconnect whenever the stream ends; never returns."""
        while True:
            try:
                await self._stream_once()
            except Exception as error:  # never let one stream's surprise end the agent
                self._failed(error, was_connected=self.connected.is_set())
            was_connected = self.connected.is_set()
            self.connected.clear()
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
                log.info(
                    "connected to aggregator %s as %s%s",
                    self.address,
                    self._who,
                    self._attempts.connected(self.address),
                )
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
        loop = asyncio.get_running_loop()
        outbox = self.outbox
        # A fresh stream starts with every latest result so the aggregator knows at once.
        outbox.resend_all()
        # The heartbeat keeps its own deadline: changes of one pod never delay the others'.
        heartbeat_at = loop.time() + jittered(self.heartbeat_interval, self._rng)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(heartbeat_at):
                    await outbox.changed.wait()
            outbox.changed.clear()
            heartbeat = loop.time() >= heartbeat_at
            if heartbeat:
                heartbeat_at = loop.time() + jittered(self.heartbeat_interval, self._rng)
            items = outbox.take(everything=heartbeat)
            for start in range(0, len(items), MAX_BATCH_REPORTS):
                batch = self._batch(items[start : start + MAX_BATCH_REPORTS])
                async with asyncio.timeout(self.settings.connect_timeout):
                    await call.write(batch)
