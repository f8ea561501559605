"""The load of :mod:`bench.ingest`: one process holding a share of the simulated sidecar agents.

Each agent is one pod's sidecar: its own ``Report`` stream, on its own gRPC channel (one TCP
connection: ``grpc.use_local_subchannel_pool``, the real agent's ``CHANNEL_OPTIONS`` with
their keepalive pings) unless the process was given fewer connections than agents; then agents
share them round-robin. Two protocols:

- ``on-change``: ``Hello.reports_on_change``. A pod's probes run every 0.75 s (each agent at its
  own phase); the pod turns NOT_READY with a chance of 1 % per second (a Poisson process, the
  change seen at the next probe) and back to SERVING 3 s (four probes) later. A change is sent
  at once, then the pod's next probe results until ``reports_per_change`` reports in a row have
  gone; besides, the pod's latest report goes once per ``resync_interval`` (90-100 % of it, the
  first at a random phase). An aggregator that sends no ``resync_interval`` gets heartbeats
  instead, every ``heartbeat_interval`` +/- 10 %, as the real agent sends them.
- ``heartbeat``: an agent before 0.2.0. A report every ``heartbeat_interval`` from a random
  phase; each report turns NOT_READY with a chance of 1 %, and SERVING again at the first report
  3 s later.

The latency of a flip is measured only if its pod had been SERVING for 3 s (label ``true``
again); the few that turn NOT_READY sooner are load, not samples.

Every stream notices when it ends (keepalive timeout, reset, an error or EOF from the server):
it is counted with a sample of the error, and the agent reconnects with backoff. A 100 ms
ticker measures this process's event-loop lag; a send that goes out more than 100 ms after its
time is late. Counters cover the measurement window the parent announces; times are
``time.monotonic()`` (CLOCK_MONOTONIC, the same in every process).

The parent talks to this process over a pipe: it answers ``("connected", info)`` once every
agent opened its stream (or the connect deadline passed), takes ``("window", from, to)``, and
on ``("stop",)`` ends every stream and answers ``("done", stats)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc

from bench import procstat
from node_agent.stream import CHANNEL_OPTIONS, MIN_HEARTBEAT_INTERVAL, connected
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.backoff import Backoff, jittered

ON_CHANGE = "on-change"
HEARTBEAT = "heartbeat"
NAMESPACE = "bench"
#: The agent's default --interval: one probe per pod this often.
PROBE_INTERVAL = 0.75
#: On change: chance per second that a serving pod turns NOT_READY. Heartbeat: per report.
FLIP_CHANCE = 0.01
FLIP_BACK_AFTER = 3.0
#: A flip is measured only when its pod has been SERVING this long: its label is "true" again
#: (a pod that turns NOT_READY before the aggregator put it back gets no new write).
SETTLED = 3.0
#: A send this much after its time is late; the lag ticker's period.
LATE = 0.1
TICK = 0.1
#: Streams of one process opening at once (thousands opened in the same instant fail in the
#: client's gRPC core with INTERNAL).
CONNECTING = 200
CONNECT_TIMEOUT = 30.0
ERROR_SAMPLES = 10
NEVER = math.inf

SERVING = pb.SERVE_STATE_SERVING
NOT_READY = pb.SERVE_STATE_NOT_READY
#: What a probe reports in each state (the real agent's reason and HTTP status).
ANSWERS = {SERVING: ("success", 200), NOT_READY: ("No replicas are available yet.", 503)}


class StreamEnded(Exception):
    """The aggregator ended the stream without an error status (EOF)."""


@dataclass(frozen=True)
class Settings:
    """What the aggregator asked for (``AgentSettings``), in seconds."""

    heartbeat_interval: float
    resync_interval: float
    reports_per_change: int
    reports_per_failure: int = 0  # 0: reports_per_change (as the agent reads it)

    @classmethod
    def of(cls, message: pb.AgentSettings) -> Settings:
        heartbeat = message.heartbeat_interval.ToNanoseconds() / 1e9
        return cls(
            max(heartbeat, MIN_HEARTBEAT_INTERVAL) if heartbeat > 0 else 1.0,
            max(message.resync_interval.ToNanoseconds() / 1e9, 0.0),
            message.reports_per_change,
            message.reports_per_failure,
        )

    def values(self) -> tuple[float, float, int]:
        return (self.heartbeat_interval, self.resync_interval, self.reports_per_change)


@dataclass
class Stats:
    """What one load process saw; counters marked (window) count only inside the window."""

    agents: int = 0
    connections: int = 0
    connected: int = 0  # agents whose first stream opened
    connect_retries: int = 0  # first streams that failed to open and were tried again
    connect_seconds: float = 0.0
    sent: int = 0
    sent_in_window: int = 0  # (window)
    late_sends: int = 0  # (window)
    acks: int = 0
    flips: list[tuple[str, float]] = field(default_factory=list)  # (window) pod, t0
    stream_errors: int = 0  # streams that ended without the load ending them
    reconnects: int = 0  # streams opened again after one ended
    error_samples: list[str] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)  # (window) the ticker's lag, seconds
    # The settings each agent had last: (heartbeat, resync, reports_per_change, agents).
    settings: list[tuple[float, float, int, int]] = field(default_factory=list)

    def sample(self, text: str) -> None:
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(text[:240])


def describe(error: BaseException) -> str:
    """``RESOURCE_EXHAUSTED: details`` for a gRPC status, the repr otherwise."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error)


class Load:
    """This process's agents, channels, window and counters."""

    def __init__(self, address: str, connections: int, protocol: str, seed: int) -> None:
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self.channels = [
            grpc.aio.insecure_channel(address, options=options) for _ in range(connections)
        ]
        self.stubs = [pb_grpc.ReportServiceStub(channel) for channel in self.channels]
        self.protocol = protocol
        self.rng = random.Random(seed)
        self.stats = Stats(connections=connections)
        self.measure_from = NEVER
        self.stop_at = NEVER
        self.stopping = False
        self.connecting = asyncio.Semaphore(CONNECTING)
        self.started = time.monotonic()

    def inside(self, now: float) -> bool:
        return self.measure_from <= now < self.stop_at

    def ended(self, agent: Agent, error: BaseException, *, opened: bool) -> None:
        """A stream ended (``opened``) or could not open, without the load ending it."""
        when = time.monotonic() - self.started
        if opened:
            self.stats.stream_errors += 1
            self.stats.sample(f"{when:.1f}s {agent.name} stream ended: {describe(error)}")
        elif agent.ever_opened:
            self.stats.stream_errors += 1
            self.stats.sample(f"{when:.1f}s {agent.name} reconnect failed: {describe(error)}")
        else:
            self.stats.connect_retries += 1
            self.stats.sample(f"{when:.1f}s {agent.name} connect: {describe(error)}")

    async def ticker(self) -> None:
        """The event loop's lag: how late a 100 ms sleep wakes up."""
        while True:
            due = time.monotonic() + TICK
            await asyncio.sleep(TICK)
            now = time.monotonic()
            if self.inside(now):
                self.stats.lags.append(now - due)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30):
                await asyncio.gather(*(channel.close() for channel in self.channels))


class Agent:
    """One simulated sidecar: its pod's state, schedule and stream."""

    def __init__(self, load: Load, index: int, name: str, uid: str) -> None:
        self.load = load
        self.name = name
        self.channel = index % len(load.channels)
        self.rng = random.Random(load.rng.random())
        self.on_change = load.protocol == ON_CHANGE
        self.hello = pb.AgentMessage(
            hello=pb.Hello(
                mode=pb.AGENT_MODE_SIDECAR,
                pod=pb.PodRef(namespace=NAMESPACE, name=name, uid=uid),
                node_name="bench",
                agent_version="bench",
                reports_on_change=self.on_change,
            )
        )
        self.settings = Settings(1.0, 0.0, 0)
        self.state = SERVING
        self.sequence = 0
        self.phase = self.rng.uniform(0, PROBE_INTERVAL)  # its probes: phase + k * 0.75
        now = time.monotonic()
        self.change_at = self._next_flip(now) if self.on_change else NEVER  # on change
        self.serving_at = NEVER  # heartbeat: when NOT_READY ends
        self.serving_since = -NEVER  # its label is "true" from the start
        self.confirm_at = NEVER  # the next probe result sent after a change
        self.confirms_left = 0
        self.periodic_at = NEVER  # the next resync or heartbeat
        self.ever_opened = False
        self.opened_once = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # Set by the reader for the writer: the stream ended; the schedule must change.
        self.failure: BaseException | None = None
        self.reschedule = False
        self.sleeping = False
        self.interrupted = False

    # -- the pod's schedule ---------------------------------------------------------------

    def _on_grid(self, moment: float) -> float:
        """The first probe of this agent at or after ``moment``."""
        steps = math.ceil((moment - self.phase) / PROBE_INTERVAL)
        return self.phase + steps * PROBE_INTERVAL

    def _next_flip(self, after: float) -> float:
        return self._on_grid(after + self.rng.expovariate(FLIP_CHANCE))

    def _resyncs(self) -> bool:
        return self.on_change and self.settings.resync_interval > 0

    def _start_periodic(self, now: float) -> None:
        """A new stream (or new settings): the first resync or heartbeat."""
        heartbeat = self.settings.heartbeat_interval
        if self._resyncs():
            self.periodic_at = now + self.rng.uniform(0, self.settings.resync_interval)
        elif self.on_change:  # an aggregator that wants heartbeats: as the real agent
            self.periodic_at = now + jittered(heartbeat, self.rng)
        else:
            self.periodic_at = now + self.rng.random() * heartbeat

    def _advance_periodic(self, now: float) -> None:
        heartbeat = self.settings.heartbeat_interval
        if self._resyncs():
            self.periodic_at = now + self.rng.uniform(0.9, 1.0) * self.settings.resync_interval
        elif self.on_change:
            self.periodic_at = now + jittered(heartbeat, self.rng)
        else:
            self.periodic_at += heartbeat  # fixed ticks, as the bench always sent them

    def _change(self) -> bool:
        """The due change of state (on change); True for a flip to NOT_READY that is measured."""
        at = self.change_at
        settled = at - self.serving_since >= SETTLED
        if self.state == SERVING:
            self.state, self.change_at = NOT_READY, at + FLIP_BACK_AFTER
        else:
            self.state, self.change_at, self.serving_since = SERVING, self._next_flip(at), at
        settings = self.settings
        reports = (
            settings.reports_per_change
            if self.state == SERVING
            else settings.reports_per_failure or settings.reports_per_change
        )
        self.confirms_left = max(reports - 1, 0)
        self.confirm_at = at + PROBE_INTERVAL if self.confirms_left else NEVER
        return self.state == NOT_READY and settled

    def _catch_up(self, now: float) -> None:
        """Changes that fell while no stream was open: the new stream sends the result."""
        if self.on_change:
            while self.change_at <= now:
                self._change()
        elif self.state == NOT_READY and now >= self.serving_at:
            self.state, self.serving_since = SERVING, now
        self.confirm_at, self.confirms_left = NEVER, 0

    def _due(self) -> float:
        return min(self.change_at, self.confirm_at, self.periodic_at)

    def _fire(self, now: float) -> bool:
        """Everything due by ``now`` goes in one report; True for a measured flip."""
        flip = False
        if self.on_change:
            if self.change_at <= now:
                flip = self._change()
            elif self.confirm_at <= now:
                self.confirms_left -= 1
                self.confirm_at = self.confirm_at + PROBE_INTERVAL if self.confirms_left else NEVER
            if self.periodic_at <= now:
                self._advance_periodic(now)
        else:
            self._advance_periodic(now)
            if self.state == NOT_READY and now >= self.serving_at:
                self.state, self.serving_since = SERVING, now
            elif self.state == SERVING and self.rng.random() < FLIP_CHANCE:
                flip = now - self.serving_since >= SETTLED
                self.state, self.serving_at = NOT_READY, now + FLIP_BACK_AFTER
        return flip

    # -- the stream -----------------------------------------------------------------------

    async def run(self) -> None:
        """Stream, and open a new stream whenever one ends, until the load stops."""
        self.task = asyncio.current_task()
        backoff = Backoff(base=0.2, cap=5.0, rng=self.rng)
        while not self.load.stopping:
            opened = False
            try:
                call = await self._open()
                opened = True
                if self.ever_opened:
                    self.load.stats.reconnects += 1
                self.ever_opened = True
                self.opened_once.set()
                backoff.reset()
                await self._stream(call)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # every way a stream ends is counted, never hidden
                if self.load.stopping:
                    return
                self.load.ended(self, error, opened=opened)
            await asyncio.sleep(backoff.next())

    async def _open(self) -> grpc.aio.StreamStreamCall:
        load = self.load
        async with load.connecting, asyncio.timeout(CONNECT_TIMEOUT):
            await connected(load.channels[self.channel])
            call = load.stubs[self.channel].Report()
            try:
                await call.write(self.hello)
                first = await call.read()
            except BaseException:
                call.cancel()
                raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "settings":
            call.cancel()
            raise StreamEnded(f"no settings after the hello: {first!r}")
        self.settings = Settings.of(first.settings)
        return call

    async def _stream(self, call: grpc.aio.StreamStreamCall) -> None:
        self.failure, self.reschedule = None, False
        reader = asyncio.create_task(self._read(call))
        try:
            now = time.monotonic()
            self._catch_up(now)
            self._start_periodic(now)
            await self._send(call, now, flip=False)  # a new stream starts with the latest
            while True:
                due = self._due()
                if due > time.monotonic():
                    await self._sleep(due - time.monotonic())
                if self.failure is not None:
                    raise self.failure
                if self.reschedule:
                    self.reschedule = False
                    self._start_periodic(time.monotonic())
                    continue
                now = time.monotonic()
                if now < due:
                    continue
                await self._send(call, due, flip=self._fire(now))
        except Exception:
            if self.failure is not None:  # the reader saw why first: that is the cause
                raise self.failure from None
            raise
        finally:
            reader.cancel()
            call.cancel()

    async def _sleep(self, delay: float) -> None:
        """Sleep; the reader may cut it short (the stream ended, or new settings)."""
        self.sleeping = True
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.load.stopping or not self.interrupted or task is None:
                raise
            task.uncancel()
        finally:
            self.sleeping = self.interrupted = False

    def _interrupt(self) -> None:
        if self.sleeping and not self.interrupted and self.task is not None:
            self.interrupted = True
            self.task.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise StreamEnded("the aggregator ended the stream (EOF)")
                if message.WhichOneof("kind") == "settings":
                    settings = Settings.of(message.settings)
                    if settings != self.settings:
                        self.settings, self.reschedule = settings, True
                        self._interrupt()
                else:
                    self.load.stats.acks += 1
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.failure = error
            self._interrupt()

    async def _send(self, call: grpc.aio.StreamStreamCall, due: float, *, flip: bool) -> None:
        load, stats = self.load, self.load.stats
        self.sequence += 1
        reason, status = ANSWERS[self.state]
        report = pb.PodReport(
            state=self.state, reason=reason, http_status=status, sequence=self.sequence
        )
        report.probe_latency.FromNanoseconds(2_000_000)
        message = pb.AgentMessage(reports=pb.ReportBatch(reports=[report]))
        now = time.monotonic()  # the change leaves the agent
        inside = load.inside(now)
        if flip and inside:
            stats.flips.append((self.name, now))
        await call.write(message)
        stats.sent += 1
        if inside:
            stats.sent_in_window += 1
            if now - due > LATE:
                stats.late_sends += 1


async def run_load(
    conn: Connection, address: str, pods: list[tuple[str, str]], options: dict[str, Any]
) -> Stats:
    loop = asyncio.get_running_loop()
    load = Load(address, options["connections"], options["protocol"], options["seed"])
    load.stats.agents = len(pods)
    agents = [Agent(load, i, name, uid) for i, (name, uid) in enumerate(pods)]
    ticker = asyncio.create_task(load.ticker())
    tasks = [asyncio.create_task(agent.run()) for agent in agents]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(options["connect_timeout"]):
                for agent in agents:
                    await agent.opened_once.wait()
        load.stats.connected = sum(agent.ever_opened for agent in agents)
        load.stats.connect_seconds = round(time.monotonic() - load.started, 1)
        conn.send(("connected", {"connected": load.stats.connected}))
        while True:
            command, *arguments = await loop.run_in_executor(None, conn.recv)
            if command == "window":
                load.measure_from, load.stop_at = arguments
            elif command == "stop":
                break
    finally:
        load.stopping = True
        ticker.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(ticker, *tasks, return_exceptions=True)
    seen = Counter(agent.settings.values() for agent in agents if agent.ever_opened)
    load.stats.settings = [(*values, count) for values, count in seen.items()]
    conn.send(("done", asdict(load.stats)))
    await load.close()
    return load.stats


def load_main(
    conn: Connection, address: str, pods: list[tuple[str, str]], options: dict[str, Any]
) -> None:
    """The load process (multiprocessing ``spawn`` target), pinned to core 1 with ``pin``."""
    if options["pin"]:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {1})
    procstat.raise_fd_limit()
    asyncio.run(run_load(conn, address, pods, options))
