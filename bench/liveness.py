"""Liveness in the transport (issue 14): how soon the aggregator learns that an agent is gone,
from its connection alone, and pulls the agent's pod itself.

Real processes against the Kubernetes API emulator, as ``bench.detection`` runs them: one
aggregator (``python -m aggregator``, kubernetes backend on the emulator's kubeconfig, ``--auth
none``, pinned to CPU 0 with ``taskset -c 0`` when there are two CPUs or more; every other
setting its default, or what ``--aggregator-arg`` passes), and real sidecar agents
(``python -m node_agent``, ``harness.start_agent``) on ``FakeServeProxy`` instances. Each pod
carries its address (127.0.0.1 and its proxy's port), so the aggregator can probe it. This
process (emulator, proxies, relay) and the agents run on CPU 1.

Each scenario runs ``--rounds`` times (20), each round on a fresh pod, proxy and agent. Once
the aggregator's ``GetPod`` shows the pod pushed by its connected agent, the bench waits a
random 0 to ``--phase-spread`` seconds (4; seeded by ``--seed``), breaks the agent at t0
(``time.monotonic``) and polls ``GetPod`` every 10 ms (1 s deadline per call) for two moments:

- **disconnected**: ``agent_connected`` is false (the stream ended: out of push mode);
- **first pull**: ``source`` is ``SOURCE_PULL`` (the aggregator probed the pod itself).

The random pause matters: the aggregator pings a connection that has sent nothing for
``--keepalive-time``, so with a fixed delay after the agent's first push every round meets the
timer at the same phase (every freeze round took 1.08 s that way, never up to the 3 s that
2 s + 1 s allows).

Scenarios, and the target for the time until ``agent_connected: false`` (p99):

1. ``kill`` (<= 0.5 s): SIGKILL the agent; the kernel closes its connection.
2. ``freeze`` (<= 3 s): SIGSTOP the agent (SIGCONT and stop it afterwards); its connection
   stays open and unanswered: only HTTP/2 keepalive PINGs (``--keepalive-time`` and
   ``--keepalive-timeout`` of the aggregator) can tell.
3. ``blackhole`` (<= 3 s): the agent talks to the aggregator through a TCP relay on loopback
   (``bench.relay``, in this process); at t0 the relay stops forwarding in both directions
   but keeps both sockets open (and reads and drops what arrives).
4. ``stall`` (<= 5 s): the agent's event loop is stuck while its process lives (its gRPC core
   still answers PINGs). Its stderr is a pipe this bench holds both ends of; its proxy answers
   healthy and 503 in turn, one probe cycle each, so the agent logs a state change at INFO at
   every probe. At t0 the bench stops reading and fills the pipe itself (non-blocking writes
   on a descriptor of its own until EAGAIN): the agent's next log write blocks its event loop.
   Only the agent itself can notice (a watchdog that ends its stream or exits). Also recorded:
   when the agent's main thread was first seen blocked in ``pipe_write`` (/proc wchan),
   whether the agent exited and its exit code. A round that sees nothing within its bounded
   wait is recorded as a timeout, not an error.
5. ``proxy-fail-10k`` (p99 <= 1.5 s from the flip to the label write): liveness must not
   cost detection at scale. ``--simulated-agents`` (10,000) agents of ``bench.ingest``'s load
   (its processes, one connection per agent, on-change protocol, pinned to CPU 1) and its
   emulator process, ``bench.ingest``'s aggregator (``--log-level warning``, qps 1000, namespace
   ``bench``), plus ``--real-agents`` (20) real agents on ``FakeServeProxy`` instances. Their
   proxies turn to ``503 No replicas`` one at a time, each at a random moment (0.5-2.5 s after
   the previous write; a pod that failed before is healed and back in service first): the
   time from the flip (this process's ``time.monotonic``) to the arrival of the pod's label
   ``false`` PATCH at the emulator (its ``loop.time()``, the same CLOCK_MONOTONIC), one flip
   per round. The flips start once the aggregator's writer has caught up with the start
   (``serve_health_writes_pending`` <= 20 for 5 s; the label writes of the start, while
   10,000 agents connect, are counted). Also recorded, to tell where the time went: when the
   agent logged the change and when the aggregator's pod turned NOT_READY (``state_since``),
   the writes pending at each flip and every 100 ms, the longest pauses between PATCH
   arrivals, the CPU of the aggregator, emulator and load, the load's event-loop lag (a load
   that lags is flagged as the bottleneck, as bench.ingest does) and its stream errors.

A round's wait is bounded (``--max-wait``; by default 10 s for kill, 45 s for freeze and
blackhole, enough for the keepalive the aggregator had before 2 s + 1 s: 30 s + 10 s; 15 s for
stall). Percentiles count a timed-out round as infinitely late: a p99 of "timeout" means at
least one round in a hundred saw nothing. Before the first round the bench waits
``--startup-wait`` (8 s) after the aggregator started: during its startup grace (twice the 3 s
heartbeat TTL) it pulls nothing.

    flock /tmp/bench.lock .venv/bin/python -m bench.liveness [--rounds 20]
        [--scenarios kill,freeze,blackhole,stall,proxy-fail-10k]
        [--aggregator-arg=--keepalive-time=1s --aggregator-arg=--keepalive-timeout=500ms]

Prints a table and writes bench/results/liveness.json. Loopback only; every process started
is stopped at the end (a stopped agent gets SIGCONT first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import kmock

from bench import ingest, ingest_result, procstat
from bench.ingest_load import NAMESPACE as LOAD_NAMESPACE
from bench.relay import Relay
from servehealth.v1 import servehealth_pb2 as pb
from testsupport import harness
from testsupport.fakes import HEALTHY, NO_REPLICAS, FakeServeProxy
from testsupport.kube.emulator import KubeEmulator

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "liveness.json"
HOST = harness.HOST
NAMESPACE = "default"
AGENT_SCENARIOS = ("kill", "freeze", "blackhole", "stall")
SCENARIOS = (*AGENT_SCENARIOS, "proxy-fail-10k")
#: p99 targets in seconds: agent_connected false (1-4), label write after a flip (5).
TARGETS = {"kill": 0.5, "freeze": 3.0, "blackhole": 3.0, "stall": 5.0, "proxy-fail-10k": 1.5}
#: How long a round waits for both moments (s), unless --max-wait says otherwise.
WAITS = {"kill": 10.0, "freeze": 45.0, "blackhole": 45.0, "stall": 15.0}
POLL_INTERVAL = 0.01
CALL_TIMEOUT = 1.0
#: A stall round: after the disconnection, how long to wait for the agent to exit.
EXIT_WAIT = 2.0
#: After a 503, the agent re-probes 100 ms later (--confirm-delay); a request this long after
#: the previous one starts a new probe cycle.
CYCLE_GAP = 0.3
_LISTENING = re.compile(r"listening on (?P<host>\S+):(?P<port>\d+)")
LABEL = "ray.io/serve"
#: proxy-fail-10k: a flip whose ``false`` write has not arrived after this long is a timeout.
FLIP_WAIT = 10.0
#: proxy-fail-10k: how long a healed pod gets before its agent's proxy may fail again.
HEAL_SETTLE = 3.0


# -- pieces --------------------------------------------------------------------------------


@dataclass
class AlternatingProxy(FakeServeProxy):
    """A proxy whose /-/healthz answers healthy and ``503 No replicas`` in turn, one probe
    cycle each (a request more than ``CYCLE_GAP`` after the previous one starts a cycle; the
    agent's confirmation re-probe and its /-/routes get the same answer as their cycle): every
    probe of the agent is a state change, which it logs at INFO."""

    _last_request: float = field(default=0.0, repr=False)

    async def _answer(self, answer: tuple[int, str]) -> Any:
        now = time.monotonic()
        if answer == self.healthz and now - self._last_request > CYCLE_GAP:
            self.healthz = NO_REPLICAS if self.healthz == HEALTHY else HEALTHY
            answer = self.healthz
        self._last_request = now
        return await super()._answer(answer)


def start_aggregator(
    log_dir: Path, kubeconfig: str, pin: bool, extra: Sequence[str]
) -> harness.AggregatorProcess:
    """``python -m aggregator`` on the emulator (``taskset -c 0`` if ``pin``); returns once it
    logged "listening on" (HarnessError otherwise)."""
    port = harness.free_port()
    args = [
        "-m", "aggregator",
        "--listen", f"{HOST}:{port}",
        "--metrics-listen", f"{HOST}:0",
        "--kube-backend", "kubernetes",
        "--kubeconfig", kubeconfig,
        "--auth", "none",
        *extra,
    ]  # fmt: skip
    prefix = ["taskset", "-c", "0"] if pin else []
    log_path = log_dir / "aggregator.log"
    log = log_path.open("wb")
    try:
        popen = subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=harness.REPO_ROOT,
            start_new_session=True,
        )
    except BaseException:
        log.close()
        raise
    aggregator = harness.AggregatorProcess("aggregator", popen, log_path, log, port=port)
    try:
        aggregator.wait_for_log(_LISTENING, 30)
    except BaseException:
        aggregator.stop()
        raise
    return aggregator


@dataclass
class StderrPipe:
    """The agent's stderr: a pipe whose both ends this process holds. While ``reading``, what
    arrives goes to the agent's log file (for ``wait_for_log``)."""

    read_fd: int
    write_fd: int
    log: IO[bytes]
    reading: bool = False

    @classmethod
    def open(cls, log_path: Path) -> StderrPipe:
        read_fd, write_fd = os.pipe()  # not inherited: the agent gets only its stderr
        return cls(read_fd, write_fd, log_path.open("ab", buffering=0))

    def _on_readable(self) -> None:
        with contextlib.suppress(BlockingIOError):
            data = os.read(self.read_fd, 65536)
            if not self.log.closed:
                self.log.write(data.replace(b"\0", b""))  # the filler is NUL bytes

    def start_reading(self) -> None:
        if not self.reading:
            asyncio.get_running_loop().add_reader(self.read_fd, self._on_readable)
            self.reading = True

    def stop_reading(self) -> None:
        if self.reading:
            asyncio.get_running_loop().remove_reader(self.read_fd)
            self.reading = False

    def fill(self, limit: int = 1 << 22) -> int:
        """Write to the pipe until it is full (EAGAIN); the bytes written. The writes go
        through a descriptor of their own (opened again from /proc): O_NONBLOCK on the one the
        agent shares would make the agent's writes fail instead of block."""
        fd = os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK)
        written = 0
        try:
            for size in (65536, 4096, 1):  # then no room is left for even one byte
                chunk = b"\0" * size
                while written < limit:
                    try:
                        written += os.write(fd, chunk)
                    except BlockingIOError:
                        break
        finally:
            os.close(fd)
        return written

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_reading()
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.log.close()


def spawn_piped_agent(
    log_dir: Path, address: str, serve_port: int, pod: harness.PodIdentity, name: str
) -> tuple[harness.Process, StderrPipe]:
    """``harness.start_agent``'s agent, with stdout and stderr on a :class:`StderrPipe`;
    returns at once (the pipe must be read for it to start)."""
    log_path = log_dir / f"{name}.log"
    command = [
        sys.executable, "-m", "node_agent",
        "--aggregator", address,
        "--proxy-url", harness.proxy_url(serve_port),
        "--interval", harness.AGENT_INTERVAL,
        "--probe-timeout", harness.AGENT_PROBE_TIMEOUT,
    ]  # fmt: skip
    pipe = StderrPipe.open(log_path)
    # The Process closes its own handle when it stops; the pipe's reader keeps its own.
    handle = log_path.open("ab")
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=pipe.write_fd,
            stderr=pipe.write_fd,
            env=harness.agent_environ(pod),
            cwd=harness.REPO_ROOT,
            start_new_session=True,
        )
    except BaseException:
        handle.close()
        pipe.close()
        raise
    return harness.Process(name, popen, log_path, handle), pipe


def main_thread_wchan(pid: int) -> str:
    """Where the kernel has the process's main thread waiting ("pipe_write", ...); "" if gone."""
    try:
        with open(f"/proc/{pid}/wchan") as wchan:
            return wchan.read().strip()
    except OSError:
        return ""


def blocked_on_pipe(wchan: str) -> bool:
    """A wchan of a thread waiting to write to a full pipe ("anon_pipe_write" on Linux 6.x,
    "pipe_write" or "pipe_wait" on older kernels)."""
    return "pipe" in wchan and "read" not in wchan


def stop_agent(agent: harness.Process) -> int | None:
    """SIGCONT (it may be stopped), then SIGTERM, SIGKILL after 10 s; its exit code."""
    if agent.alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGCONT)
    return agent.stop()


# -- one round -----------------------------------------------------------------------------


@dataclass
class Observed:
    disconnected_s: float | None = None
    first_pull_s: float | None = None
    stalled_s: float | None = None  # stall: main thread first seen blocked on the pipe
    exited_s: float | None = None  # stall: the agent process was gone
    exit_code: int | None = None
    polls: int = 0
    poll_errors: int = 0
    last_state: str = ""


def observe(
    inspector: harness.Inspector,
    pod: harness.PodIdentity,
    t0: float,
    wait: float,
    agent: harness.Process | None = None,
) -> Observed:
    """Poll GetPod from ``t0`` until the pod is seen disconnected and pulled (and, with
    ``agent``, it exited or ``EXIT_WAIT`` passed since the disconnection), or ``wait`` passed.
    Blocking: runs on a thread."""
    seen = Observed()
    deadline = t0 + wait
    while True:
        try:
            pod_view = inspector.get_pod(pod, timeout=CALL_TIMEOUT)
        except grpc.RpcError:
            pod_view = None
            seen.poll_errors += 1
        now = time.monotonic()
        seen.polls += 1
        if pod_view is not None:
            seen.last_state = harness.state_name(pod_view.state)
            if seen.disconnected_s is None and not pod_view.agent_connected:
                seen.disconnected_s = now - t0
            if seen.first_pull_s is None and pod_view.source == pb.SOURCE_PULL:
                seen.first_pull_s = now - t0
        if agent is not None:
            if seen.exited_s is None and not agent.alive:
                seen.exited_s = now - t0
                seen.exit_code = agent.popen.returncode
            if seen.stalled_s is None and blocked_on_pipe(main_thread_wchan(agent.pid)):
                seen.stalled_s = now - t0
        done = seen.disconnected_s is not None and seen.first_pull_s is not None
        if done and agent is not None and seen.exited_s is None:
            done = now - t0 - seen.disconnected_s >= EXIT_WAIT  # type: ignore[operator]
        if done or now >= deadline:
            return seen
        time.sleep(POLL_INTERVAL)


@dataclass
class Setup:
    kube: KubeEmulator
    aggregator: harness.AggregatorProcess
    inspector: harness.Inspector
    log_dir: Path
    rng: random.Random
    phase_spread: float


def get_pod(inspector: harness.Inspector, pod: harness.PodIdentity) -> pb.Pod | None:
    """GetPod with a ``CALL_TIMEOUT`` deadline; None if not tracked or the call failed (a busy
    aggregator can miss a deadline: the caller polls again)."""
    try:
        return inspector.get_pod(pod, timeout=CALL_TIMEOUT)
    except grpc.RpcError:
        return None


async def wait_for_pod(
    inspector: harness.Inspector,
    pod: harness.PodIdentity,
    check: Callable[[pb.Pod], bool],
    what: str,
    within: float,
    logs: Sequence[harness.Process] = (),
) -> None:
    """Poll GetPod (every 20 ms, failed calls included) until ``check``; HarnessError after
    ``within`` seconds."""
    deadline = time.monotonic() + within
    seen = None
    while True:
        seen = await asyncio.to_thread(get_pod, inspector, pod)
        if seen is not None and check(seen):
            return
        if time.monotonic() > deadline:
            state = "not tracked" if seen is None else harness.state_name(seen.state)
            details = "\n".join(process.tail() for process in logs)
            raise harness.HarnessError(
                f"pod {pod} not {what} within {within:g}s (last seen: {state})\n{details}"
            )
        await asyncio.sleep(0.02)


async def wait_tracked(setup: Setup, pod: harness.PodIdentity, within: float = 20.0) -> None:
    """Until the aggregator tracks ``pod`` (its pod watch delivered it)."""
    await wait_for_pod(setup.inspector, pod, lambda _: True, "tracked", within)


async def run_round(setup: Setup, scenario: str, number: int, wait: float) -> dict[str, Any]:
    name = f"{scenario}-{number:02d}"
    proxy = AlternatingProxy() if scenario == "stall" else FakeServeProxy()
    await proxy.start()
    agent: harness.Process | None = None
    relay: Relay | None = None
    pipe: StderrPipe | None = None
    added = False
    extra: dict[str, Any] = {}
    try:
        created = setup.kube.add_pod(NAMESPACE, name, pod_ip=HOST, serve_port=proxy.port)
        added = True
        pod = harness.PodIdentity(NAMESPACE, name, created["metadata"]["uid"], "node-1")
        await wait_tracked(setup, pod)
        address = setup.aggregator.address
        if scenario == "blackhole":
            relay = await Relay((HOST, setup.aggregator.port)).start()
            address = relay.address
        if scenario == "stall":
            agent, pipe = spawn_piped_agent(
                setup.log_dir, address, proxy.port, pod, f"agent-{name}"
            )
            pipe.start_reading()
            await asyncio.to_thread(harness.wait_connected, agent)
        else:
            agent = await asyncio.to_thread(
                harness.start_agent, setup.log_dir, address, proxy.port, pod, name=f"agent-{name}"
            )
        await wait_for_pod(
            setup.inspector,
            pod,
            lambda p: p.agent_connected and p.source == pb.SOURCE_PUSH,
            "pushed by a connected agent",
            20.0,
            logs=[agent],
        )
        if scenario == "stall":
            await asyncio.sleep(1.0)  # a few state changes logged: the agent is at work
        # A random moment: the break meets the connection's keepalive timer at any phase.
        pause = setup.rng.uniform(0.0, setup.phase_spread)
        extra["pause_s"] = round(pause, 3)
        await asyncio.sleep(pause)

        t0 = time.monotonic()
        if scenario == "kill":
            os.kill(agent.pid, signal.SIGKILL)
        elif scenario == "freeze":
            os.kill(agent.pid, signal.SIGSTOP)
        elif scenario == "blackhole":
            assert relay is not None
            relay.blackhole()
        elif scenario == "stall":
            assert pipe is not None
            pipe.stop_reading()
            extra["filled_bytes"] = pipe.fill()
        watched = agent if scenario == "stall" else None
        seen = await asyncio.to_thread(observe, setup.inspector, pod, t0, wait, watched)
        if relay is not None:
            extra["relay_dropped_bytes"] = {
                "to_aggregator": relay.dropped_to_upstream,
                "to_agent": relay.dropped_to_client,
            }
            extra["relay_connections"] = relay.connections
        if scenario == "stall":
            extra.update(
                agent_stalled_s=_rounded(seen.stalled_s),
                agent_exited=seen.exited_s is not None,
                agent_exited_s=_rounded(seen.exited_s),
                agent_exit_code=seen.exit_code,
            )
        return {
            "round": number,
            "pod": name,
            "disconnected_s": _rounded(seen.disconnected_s),
            "first_pull_s": _rounded(seen.first_pull_s),
            "state_at_end": seen.last_state,
            "polls": seen.polls,
            "poll_errors": seen.poll_errors,
            **extra,
        }
    finally:
        if pipe is not None:
            pipe.start_reading()  # drain: a blocked agent goes on, and can hear SIGTERM
        if agent is not None:
            await asyncio.to_thread(stop_agent, agent)
        if pipe is not None:
            pipe.close()
        if relay is not None:
            await relay.close()
        if added:
            setup.kube.delete_pod(NAMESPACE, name)
        await proxy.stop()


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# -- figures -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(values: Sequence[float | None]) -> dict[str, Any]:
    """p50/p99/max over the rounds; a timed-out round (None) counts as infinitely late, and a
    figure it decides is None ("timeout")."""
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None, "timeouts": 0, "values_s": []}
    filled = [math.inf if v is None else v for v in values]

    def finite(x: float) -> float | None:
        return None if math.isinf(x) else round(x, 3)

    return {
        "p50_s": finite(percentile(filled, 0.5)),
        "p99_s": finite(percentile(filled, 0.99)),
        "max_s": finite(max(filled)),
        "timeouts": sum(v is None for v in values),
        "values_s": list(values),
    }


def summarise(scenario: str, rounds: list[dict[str, Any]], wait: float) -> dict[str, Any]:
    disconnected = figures([r["disconnected_s"] for r in rounds])
    target = TARGETS[scenario]
    result: dict[str, Any] = {
        "scenario": scenario,
        "rounds": len(rounds),
        "wait_s": wait,
        "target_p99_s": target,
        "target_applies_to": "agent_connected false",
        "disconnected": disconnected,
        "first_pull": figures([r["first_pull_s"] for r in rounds]),
        "meets_target": disconnected["p99_s"] is not None and disconnected["p99_s"] <= target,
    }
    if scenario == "stall":
        codes = [r["agent_exit_code"] for r in rounds if r["agent_exited"]]
        result["agent_stalled"] = figures([r["agent_stalled_s"] for r in rounds])
        result["agent_exited"] = figures([r["agent_exited_s"] for r in rounds])
        result["agents_exited"] = len(codes)
        result["exit_codes"] = sorted(set(codes))
    result["round_details"] = rounds
    return result


# -- proxy-fail-10k -------------------------------------------------------------------------


#: The agent's log line of a change to NOT_READY (node_agent.probing), with its local time.
AGENT_NOT_READY = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: \S+ \S+: NOT_READY ", re.MULTILINE
)


def agent_log_time(text: str, pattern: re.Pattern[str], after_wall: float) -> float | None:
    """The wall-clock time of the first line matching ``pattern`` at or after ``after_wall``
    (the log's stamps are local time, to the millisecond); None if there is none."""
    for match in pattern.finditer(text):
        stamp = datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stamp >= after_wall - 0.001:
            return stamp
    return None


#: proxy-fail-10k: how often the aggregator's serve_health_writes_pending is sampled (s).
PENDING_EVERY = 0.1
#: proxy-fail-10k: before the flips, wait (at most this long) for the writer to catch up:
#: SETTLED_PENDING writes pending or fewer for SETTLED_FOR seconds.
SETTLE_WITHIN = 120.0
SETTLED_PENDING = 20
SETTLED_FOR = 5.0


async def wait_writes_settled(metrics_port: int, within: float) -> float | None:
    """Seconds until label writes pending stayed at ``SETTLED_PENDING`` or fewer for
    ``SETTLED_FOR`` s; None if that did not happen within ``within``."""
    started = time.monotonic()
    calm_since: float | None = None
    while time.monotonic() - started < within:
        value = await asyncio.to_thread(
            harness.metric_value, metrics_port, "serve_health_writes_pending"
        )
        now = time.monotonic()
        if value is not None and value <= SETTLED_PENDING:
            calm_since = now if calm_since is None else calm_since
            if now - calm_since >= SETTLED_FOR:
                return now - started
        else:
            calm_since = None
        await asyncio.sleep(0.2)
    return None


async def sample_pending(metrics_port: int, since: float, into: list[tuple[float, int]]) -> None:
    """Append (seconds since ``since``, label writes pending) every ``PENDING_EVERY`` until
    cancelled: when the writer falls behind, and how fast it catches up."""
    while True:
        started = time.monotonic()
        value = await asyncio.to_thread(
            harness.metric_value, metrics_port, "serve_health_writes_pending"
        )
        if value is not None:
            into.append((round(started - since, 2), int(value)))
        await asyncio.sleep(max(0.0, started + PENDING_EVERY - time.monotonic()))


def arrival_gaps(
    patches: list[tuple[str, dict[str, str], float]], since: float, top: int = 5
) -> list[list[float]]:
    """The longest pauses between consecutive PATCH arrivals at the emulator: [start (s since
    ``since``), length s]. A writer that keeps sending leaves none longer than milliseconds."""
    arrivals = sorted(at for _, _, at in patches)
    gaps = sorted(((b - a, a) for a, b in itertools.pairwise(arrivals)), reverse=True)
    gaps = gaps[:top]
    return [[round(a - since, 2), round(length, 3)] for length, a in gaps]


@dataclass
class FleetOptions:
    simulated: int
    real: int
    flips: int
    seed: int
    aggregator_args: Sequence[str]
    pin: bool


async def wait_pushed(
    inspector: harness.Inspector, pod: harness.PodIdentity, within: float
) -> None:
    """Until ``pod`` is SERVING, pushed by its connected agent, labelled true by the aggregator."""
    await wait_for_pod(
        inspector,
        pod,
        lambda p: (
            p.agent_connected
            and p.source == pb.SOURCE_PUSH
            and p.state == pb.SERVE_STATE_SERVING
            and p.desired_label == "true"
        ),
        "SERVING, pushed, label true",
        within,
    )


async def run_proxy_fail(options: FleetOptions, log_dir: Path) -> dict[str, Any]:
    """``options.simulated`` agents of bench.ingest's load (one connection each, on change) in
    the background, ``options.real`` real agents; their proxies fail one at a time."""
    fd_limit = procstat.raise_fd_limit()
    connections, why = ingest.plan_connections(options.simulated, None, fd_limit)
    if why:
        print(f"  {options.simulated:,} simulated agents share {connections:,} connections: {why}")
    shares = ingest.split_load(options.simulated, connections)
    kubeconfig = str(log_dir / "kubeconfig-10k")
    rng = random.Random(options.seed)
    emulator = await asyncio.to_thread(ingest.Emulator, kubeconfig, options.pin)
    proxies: list[FakeServeProxy] = []
    aggregator: harness.AggregatorProcess | None = None
    inspector: harness.Inspector | None = None
    loads: list[ingest.LoadProcess] = []
    agents: list[harness.Process] = []
    try:
        for _ in range(options.real):
            proxies.append(await FakeServeProxy().start())
        aggregator = await asyncio.to_thread(
            ingest.start_aggregator,
            log_dir,
            kubeconfig,
            options.pin,
            None,
            list(options.aggregator_args),
        )
        inspector = harness.Inspector(aggregator.address)
        total = options.simulated + options.real
        start_mark = await asyncio.to_thread(emulator.call, "mark")
        uids = await asyncio.to_thread(emulator.call, "add", total)
        await asyncio.to_thread(ingest.wait_for_pods, aggregator.address, total)
        pods = [(f"pod-{i}", uid) for i, uid in enumerate(uids)]
        connect_timeout = 60 + options.simulated / 200
        started = time.monotonic()
        for k, (first, count, held) in enumerate(shares):
            load_options = {
                "connections": held,
                "protocol": ingest.ON_CHANGE,
                "seed": options.seed * 1000 + k,
                "connect_timeout": connect_timeout,
                "pin": options.pin,
            }
            loads.append(
                ingest.LoadProcess(aggregator.address, pods[first : first + count], load_options)
            )
        connected = 0
        for load in loads:
            answer = await asyncio.to_thread(load.receive, "connected", connect_timeout + 60)
            connected += answer["connected"]
        print(
            f"  {connected:,} of {options.simulated:,} simulated agents connected over "
            f"{connections:,} connections in {time.monotonic() - started:.1f} s",
            flush=True,
        )
        identities = [
            harness.PodIdentity(LOAD_NAMESPACE, name, uid, "node-1")
            for name, uid in pods[options.simulated :]
        ]
        for i, identity in enumerate(identities):
            agents.append(
                await asyncio.to_thread(
                    harness.start_agent,
                    log_dir,
                    aggregator.address,
                    proxies[i].port,
                    identity,
                    name=f"agent-10k-{i:02d}",
                )
            )
        for identity in identities:
            await wait_pushed(inspector, identity, 60.0)
        print(f"  {len(agents)} real agents pushing", flush=True)
        # The start's writes first (while 10,000 agents connect, pods not yet reconnected can
        # go SILENT after the startup grace): flips are measured once the writer has caught up.
        settled_in = await wait_writes_settled(aggregator.metrics_port, SETTLE_WITHIN)
        startup = await asyncio.to_thread(emulator.call, "patches", start_mark, 120)
        startup_writes = {
            value: sum(1 for _, labels, _ in startup if labels.get(LABEL) == value)
            for value in ("false", "true")
        }
        caught_up = (
            f"after {settled_in:.1f} s"
            if settled_in is not None
            else f"NOT within {SETTLE_WITHIN:g} s (measuring anyway)"
        )
        print(
            f"  label writes since the pods were added: {startup_writes}; writer caught up "
            f"{caught_up}",
            flush=True,
        )

        window_from = time.monotonic()
        for load in loads:
            load.send("window", window_from, math.inf)
        windows = {
            "aggregator": procstat.CpuWindow(aggregator.pid),
            "emulator": procstat.CpuWindow(emulator.pid),
            "load": [load.window for load in loads],
        }
        for window in [windows["aggregator"], windows["emulator"], *windows["load"]]:
            window.start()
        first_mark = await asyncio.to_thread(emulator.call, "mark")
        backlog: list[tuple[float, int]] = []  # (s since window_from, writes pending)
        sampler = asyncio.create_task(sample_pending(aggregator.metrics_port, window_from, backlog))
        healed_at = [0.0] * options.real
        flips: list[dict[str, Any]] = []
        for number in range(1, options.flips + 1):
            i = (number - 1) % options.real
            identity = identities[i]
            await asyncio.sleep(max(0.0, healed_at[i] + HEAL_SETTLE - time.monotonic()))
            if number > options.real:  # this agent's pod failed before: back in service?
                await wait_pushed(inspector, identity, 30.0)
            await asyncio.sleep(rng.uniform(0.5, 2.5))  # a random moment
            pending = await asyncio.to_thread(
                harness.metric_value, aggregator.metrics_port, "serve_health_writes_pending"
            )
            mark = await asyncio.to_thread(emulator.call, "mark")
            flipped, flipped_wall = time.monotonic(), time.time()
            proxies[i].set(NO_REPLICAS)
            written = None
            while time.monotonic() < flipped + FLIP_WAIT:
                patches = await asyncio.to_thread(emulator.call, "patches", mark, 30)
                arrivals = [
                    at
                    for name, labels, at in patches
                    if name == identity.name and labels.get(LABEL) == "false" and at >= flipped
                ]
                if arrivals:
                    written = min(arrivals) - flipped
                    break
                await asyncio.sleep(0.02)
            seen = await asyncio.to_thread(get_pod, inspector, identity)
            proxies[i].set(HEALTHY)
            healed_at[i] = time.monotonic()
            # Where the time went: the agent's log line of the change, the aggregator's
            # state_since (both wall clocks of this machine).
            state_at = None
            if seen is not None and seen.state == pb.SERVE_STATE_NOT_READY:
                state_at = seen.state_since.ToDatetime(tzinfo=UTC).timestamp() - flipped_wall
            detected = agent_log_time(agents[i].log_text(), AGENT_NOT_READY, flipped_wall)
            flips.append(
                {
                    "flip": number,
                    "at_s": round(flipped - window_from, 2),
                    "pod": identity.name,
                    "written_s": _rounded(written),
                    "agent_logged_s": _rounded(
                        None if detected is None else detected - flipped_wall
                    ),
                    "aggregator_state_s": _rounded(state_at),
                    "writes_pending_at_flip": None if pending is None else int(pending),
                }
            )
            print(f"  {json.dumps(flips[-1])}", flush=True)
        flips_took = time.monotonic() - window_from
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        aggregator_cpu = windows["aggregator"].stop()
        emulator_cpu = windows["emulator"].stop()
        load_cpu = sum(window.stop() for window in windows["load"])
        patched = await asyncio.to_thread(emulator.call, "patches", first_mark, 120)
        stats = [await asyncio.to_thread(load.stop) for load in loads]
        loads.clear()
        lags = sorted(lag for one in stats for lag in one["lags"])
        lag_p99 = ingest_result.percentile(lags, 0.99) if lags else None
        lag_max = lags[-1] if lags else None
        written_s = [f["written_s"] for f in flips]
        result = figures(written_s)
        logged = [f["agent_logged_s"] for f in flips if f["agent_logged_s"] is not None]
        decided = [f["aggregator_state_s"] for f in flips if f["aggregator_state_s"] is not None]
        target = TARGETS["proxy-fail-10k"]
        return {
            "scenario": "proxy-fail-10k",
            "rounds": len(flips),
            "wait_s": FLIP_WAIT,
            "target_p99_s": target,
            "target_applies_to": "proxy 503 -> label false PATCH at the emulator",
            "flip_to_false_write": result,
            "flip_to_agent_log_p50_s": round(statistics.median(logged), 3) if logged else None,
            "flip_to_aggregator_state_p50_s": (
                round(statistics.median(decided), 3) if decided else None
            ),
            "meets_target": result["p99_s"] is not None and result["p99_s"] <= target,
            "simulated_agents": options.simulated,
            "simulated_connected": connected,
            "connections": connections,
            "load_processes": len(stats),
            "real_agents": options.real,
            "aggregator_cpu_percent": round(aggregator_cpu * 100, 1),
            "emulator_cpu_percent": round(emulator_cpu * 100, 1),
            "load_cpu_percent": round(load_cpu * 100, 1),
            "label_patches_per_s": round(len(patched) / flips_took, 1),
            "startup_label_writes": startup_writes,
            "writer_caught_up_after_s": None if settled_in is None else round(settled_in, 1),
            "patch_arrival_gaps": arrival_gaps(patched, window_from),
            "writes_pending_max": max((n for _, n in backlog), default=None),
            "writes_pending_over_50_s": round(
                sum(1 for _, n in backlog if n > 50) * PENDING_EVERY, 1
            ),
            "writes_pending_series": backlog,
            "writes_pending_at_flips": sorted(
                f["writes_pending_at_flip"]
                for f in flips
                if f["writes_pending_at_flip"] is not None
            ),
            "load_stream_errors": sum(one["stream_errors"] for one in stats),
            "load_error_samples": [x for one in stats for x in one["error_samples"]][:5],
            "load_lag_p99_ms": None if lag_p99 is None else round(lag_p99 * 1000, 1),
            "load_lag_max_ms": None if lag_max is None else round(lag_max * 1000, 1),
            "load_lag_median_ms": round(statistics.median(lags) * 1000, 1) if lags else None,
            "load_bottleneck": lag_p99 is None
            or lag_p99 > ingest_result.LAG_P99_LIMIT
            or (lag_max is not None and lag_max > ingest_result.LAG_MAX_LIMIT),
            "round_details": flips,
        }
    finally:
        for agent in agents:
            await asyncio.to_thread(agent.stop)
        for load in loads:
            await asyncio.to_thread(load.kill)
        if inspector is not None:
            inspector.close()
        if aggregator is not None:
            await asyncio.to_thread(aggregator.stop)
        await asyncio.to_thread(emulator.stop)
        for proxy in proxies:
            await proxy.stop()


# -- the run -------------------------------------------------------------------------------


async def run_agent_scenarios(
    scenarios: Sequence[str],
    rounds: int,
    waits: dict[str, float],
    aggregator_args: Sequence[str],
    pin: bool,
    startup_wait: float,
    log_dir: Path,
    rng: random.Random,
    phase_spread: float,
    results: list[dict[str, Any]],
) -> None:
    """Run ``scenarios``, appending each one's summary to ``results`` as it completes (what
    was measured survives a failure later on)."""
    async with KubeEmulator() as kube, kmock.Server(kube):
        aggregator: harness.AggregatorProcess | None = None
        inspector: harness.Inspector | None = None
        try:
            kubeconfig = kube.write_kubeconfig(log_dir / "kubeconfig")
            aggregator = await asyncio.to_thread(
                start_aggregator, log_dir, str(kubeconfig), pin, aggregator_args
            )
            started = time.monotonic()
            inspector = harness.Inspector(aggregator.address)
            setup = Setup(kube, aggregator, inspector, log_dir, rng, phase_spread)
            print(f"aggregator pid {aggregator.pid} on {aggregator.address}, logs in {log_dir}")
            await asyncio.sleep(max(0.0, started + startup_wait - time.monotonic()))
            for scenario in scenarios:
                print(f"{scenario}: {rounds} rounds (wait up to {waits[scenario]:g} s)", flush=True)
                done = []
                for number in range(1, rounds + 1):
                    outcome = await run_round(setup, scenario, number, waits[scenario])
                    done.append(outcome)
                    print(f"  {json.dumps(outcome)}", flush=True)
                    if not aggregator.alive:
                        raise harness.HarnessError(f"the aggregator exited\n{aggregator.tail()}")
                results.append(summarise(scenario, done, waits[scenario]))
        finally:
            if inspector is not None:
                inspector.close()
            if aggregator is not None:
                await asyncio.to_thread(aggregator.stop)
            await kube.close()


def print_table(results: list[dict[str, Any]]) -> None:
    def cell(value: float | None) -> str:
        return "timeout" if value is None else f"{value:.3f}"

    def three(f: dict[str, Any]) -> str:
        return f"{cell(f['p50_s']):>8} {cell(f['p99_s']):>9} {cell(f['max_s']):>9}"

    print(
        f"\n{'scenario':>14} {'rounds':>6}  {'disconnected p50/p99/max s':>28}  "
        f"{'first pull p50/p99/max s':>28}  {'target':>6} {'met':>4}"
    )
    for r in results:
        met = "yes" if r["meets_target"] else "NO"
        if r["scenario"] == "proxy-fail-10k":
            f = r["flip_to_false_write"]
            print(
                f"{r['scenario']:>14} {r['rounds']:>6}  503 -> label false written: {three(f)}"
                f"  {r['target_p99_s']:>6g} {met:>4}"
            )
            print(
                f"{'':>14} {r['simulated_connected']:,} simulated agents on "
                f"{r['connections']:,} connections, {r['real_agents']} real; aggregator CPU "
                f"{r['aggregator_cpu_percent']} %; load lag p99 {r['load_lag_p99_ms']} ms, max "
                f"{r['load_lag_max_ms']} ms{' (LOAD WAS THE BOTTLENECK)' * r['load_bottleneck']}"
                f"; {f['timeouts']} flips not written within {r['wait_s']:g} s"
            )
            pending = r["writes_pending_at_flips"] or [0]
            print(
                f"{'':>14} writes pending (sampled every {PENDING_EVERY:g} s): max "
                f"{r['writes_pending_max']}, over 50 for {r['writes_pending_over_50_s']} s; "
                f"longest pauses between PATCH arrivals [at s, length s]: "
                f"{r['patch_arrival_gaps'][:3]}"
            )
            print(
                f"{'':>14} flip -> agent's log line p50 {r['flip_to_agent_log_p50_s']} s, -> "
                f"aggregator NOT_READY p50 {r['flip_to_aggregator_state_p50_s']} s; label "
                f"writes pending at the flips: median {statistics.median(pending):g}, max "
                f"{max(pending)}; {r['label_patches_per_s']} PATCH/s reached the emulator "
                f"(its CPU {r['emulator_cpu_percent']} %, load processes "
                f"{r['load_cpu_percent']} %)"
            )
            continue
        d, p = r["disconnected"], r["first_pull"]
        print(
            f"{r['scenario']:>14} {r['rounds']:>6}  {three(d)}  {three(p)}  "
            f"{r['target_p99_s']:>6g} {met:>4}"
        )
        if d["timeouts"] or p["timeouts"]:
            print(
                f"{'':>14} timeouts after {r['wait_s']:g} s: {d['timeouts']} not disconnected, "
                f"{p['timeouts']} not pulled"
            )
        if r["scenario"] == "stall":
            print(
                f"{'':>14} agent blocked writing to its stderr pipe after (p50) "
                f"{cell(r['agent_stalled']['p50_s'])} s; exited in {r['agents_exited']} of "
                f"{r['rounds']} rounds (exit codes {r['exit_codes']}) after (p50) "
                f"{cell(r['agent_exited']['p50_s'])} s"
            )
    print(
        "(targets: p99 of the time until GetPod shows agent_connected false; proxy-fail-10k: "
        "until the label write reaches the emulator)"
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM runs the clean-up (agents, aggregator stopped), as Ctrl-C does."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per scenario (20)")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--aggregator-arg",
        action="append",
        default=[],
        help="passed to the aggregator (repeatable), e.g. --aggregator-arg=--keepalive-time=2s",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=None,
        help="a round's longest wait, every scenario (default: kill 10 s, freeze and "
        "blackhole 45 s, stall 15 s)",
    )
    parser.add_argument(
        "--startup-wait",
        type=float,
        default=8.0,
        help="after the aggregator starts, wait this long (its startup grace) before round 1",
    )
    parser.add_argument(
        "--simulated-agents",
        type=int,
        default=10_000,
        help="proxy-fail-10k: bench.ingest's simulated agents in the background (10000)",
    )
    parser.add_argument(
        "--real-agents", type=int, default=20, help="proxy-fail-10k: real agents (20)"
    )
    parser.add_argument(
        "--phase-spread",
        type=float,
        default=4.0,
        help="each break comes at a random moment up to this long after the agent was seen "
        "pushing (4 s: any phase of a 2 s keepalive timer)",
    )
    parser.add_argument("--seed", type=int, default=14, help="random seed (14)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin to CPUs 0 and 1")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown or not chosen:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    waits = {s: args.max_wait or WAITS[s] for s in AGENT_SCENARIOS}

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2 and not args.no_pin
    if pin:
        os.sched_setaffinity(0, {cpus[1]})  # this process, its threads and the agents
    procstat.raise_fd_limit()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-liveness-"))
    started = time.monotonic()
    where = f"pinned to CPU {cpus[0]}, the rest to CPU {cpus[1]}" if pin else "not pinned"
    print(
        f"liveness: {', '.join(chosen)}; {args.rounds} rounds each; aggregator {where}; "
        f"aggregator args {args.aggregator_arg or '(defaults)'}",
        flush=True,
    )
    agent_scenarios = [s for s in chosen if s in AGENT_SCENARIOS]
    results: list[dict[str, Any]] = []
    error = None
    try:
        if agent_scenarios:
            asyncio.run(
                run_agent_scenarios(
                    agent_scenarios,
                    args.rounds,
                    waits,
                    args.aggregator_arg,
                    pin,
                    args.startup_wait,
                    log_dir,
                    random.Random(args.seed),
                    args.phase_spread,
                    results,
                )
            )
    except Exception as failure:  # recorded; whatever was measured is still written
        error = f"{type(failure).__name__}: {failure}"
        print(f"FAILED: {error}", file=sys.stderr)
    if "proxy-fail-10k" in chosen and error is None:
        fleet = FleetOptions(
            simulated=args.simulated_agents,
            real=args.real_agents,
            flips=args.rounds,
            seed=args.seed,
            aggregator_args=args.aggregator_arg,
            pin=pin,
        )
        print(
            f"proxy-fail-10k: {fleet.simulated:,} simulated agents, {fleet.real} real, "
            f"{fleet.flips} flips",
            flush=True,
        )
        try:
            results.append(asyncio.run(run_proxy_fail(fleet, log_dir)))
        except Exception as failure:  # recorded; the other scenarios' results are kept
            error = f"proxy-fail-10k: {type(failure).__name__}: {failure}"
            print(f"FAILED: {error}", file=sys.stderr)
    print_table(results)
    output = {
        "benchmark": "liveness",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": harness.code_version(exclude=("bench",)),
        "python": platform.python_version(),
        "cpus": len(cpus),
        "pinned": pin,
        "aggregator_args": args.aggregator_arg,
        "agent_args": {
            "interval": harness.AGENT_INTERVAL,
            "probe_timeout": harness.AGENT_PROBE_TIMEOUT,
        },
        "poll_interval_s": POLL_INTERVAL,
        "results": results,
        "error": error,
        "logs": str(log_dir),
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.output} ({output['wall_time_s']} s)")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
