"""Ingest: N simulated sidecar agents, each on its own connection, against one aggregator core.

Processes on a 2-core machine:

- the **aggregator** (``python -m aggregator``, Kubernetes backend), pinned to core 0 with
  ``taskset -c 0``: the thing measured. ``--aggregator-root PATH`` runs it from another checkout
  (a ``git worktree`` of an older commit: ``PYTHONPATH=PATH:PATH/proto``, ``cwd=PATH``), so that
  before and after are measured by this same bench. ``--aggregator-arg`` passes it a flag
  (repeatable); by default none: its keepalive and other defaults are what is measured.
- the **Kubernetes API emulator** (testsupport/kube/emulator.py over real HTTP), pinned to core 1:
  holds the N pods and timestamps every label PATCH on arrival;
- the **load**: one or more processes (:mod:`bench.ingest_load`), pinned to core 1. Each agent
  is its own ``Report`` stream on its own gRPC channel, i.e. its own TCP connection, with the
  real agent's channel options (``node_agent.stream.CHANNEL_OPTIONS``: keepalive pings). The
  protocol (``--protocol``) is ``on-change`` (default: ``Hello.reports_on_change``, a change at
  once plus its confirmations, a resync per ``resync_interval``; heartbeats when the aggregator
  sends no resync interval) or ``heartbeat`` (agents before 0.2.0: every pod every
  ``heartbeat_interval``). 1 % of pods turn NOT_READY per second (per report with heartbeats),
  back to SERVING 3 s later.

Limits: this machine allows 20,000 open files per process (hard; it cannot be raised here).
The aggregator holds one per connection, so at most ``soft limit - 500`` connections are
opened; more agents share them round-robin (each still its own stream), which the run prints
and reports (``connections``). A load process holds at most 9,000 connections.

Measured over ``--duration`` seconds after ``--warmup`` (which starts once every agent is
connected): reports/s the aggregator counted (``serve_health_reports_total``) and messages/s
the load sent; the aggregator's CPU (share of one core) and RSS; bytes per agent (RSS with N
agents connected minus RSS empty, / N); the latency from a state change leaving the agent to its
label write (``false``) reaching the emulator, p50/p99; every stream that ended without the
load ending it; the load's own event-loop lag (a 100 ms ticker per process), its late sends
(> 100 ms) and CPU. A run whose load lagged (p99 > 50 ms or max > 500 ms) or used > 90 % of its
core is NOT A RESULT. To tell whose stall a latency outlier is: health checks of the aggregator
every 100 ms, and the emulator's own event-loop lag (its garbage collector is off during the
window: a full collection at 10,000 pods took a second and made the PATCHes arrive late).
Clocks: every process reads the same CLOCK_MONOTONIC.

    python -m bench.ingest --agents 10000
    python -m bench.ingest --agents 2000 --protocol heartbeat --aggregator-root ../old
    python -m bench.ingest --find-max   # 2,000, 5,000, 10,000, ... 30,000 until one fails

Holds: every flip written, p99 < 1 s, no stream ended by the server, aggregator CPU < 90 % of
its core, load not the bottleneck. Writes bench/results/ingest.json. Loopback only; every
process is stopped at the end. Runs above 2,000 agents: ``flock /tmp/bench.lock python -m ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import procstat
from bench.ingest_load import HEARTBEAT, NAMESPACE, ON_CHANGE, load_main
from bench.ingest_result import Result, summarise, table
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport import harness

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "ingest.json"
LABEL = "ray.io/serve"
FIND_MAX_SIZES = (2_000, 5_000, 10_000, 15_000, 20_000, 25_000, 30_000)
#: File descriptors the aggregator keeps for itself (listeners, epoll, logs, Kubernetes API).
FD_RESERVE = 500
#: Connections one load process holds at most (it needs one file descriptor each).
CONNECTIONS_PER_LOAD = 9_000
#: After the window, how long the last label writes get to land.
WRITE_GRACE = 3.0


# -- the emulator process -----------------------------------------------------------------


def emulator_main(conn: Connection, kubeconfig: str, pin: bool) -> None:
    """Serve the emulator; answer commands on ``conn`` until told to stop."""
    if pin:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {1})
    asyncio.run(_emulator(conn, kubeconfig))


async def _emulator(conn: Connection, kubeconfig: str) -> None:
    import kmock

    from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator

    loop = asyncio.get_running_loop()
    lags: list[tuple[float, float]] = []  # (when, how late a 100 ms sleep woke up)

    async def ticker() -> None:
        while True:
            due = time.monotonic() + 0.1
            await asyncio.sleep(0.1)
            lags.append((due, time.monotonic() - due))

    collections: list[tuple[int, float, float]] = []  # (generation, started, seconds)
    gc_started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.monotonic()
        else:
            now = time.monotonic()
            collections.append((info["generation"], gc_started[0], now - gc_started[0]))

    gc.callbacks.append(timed)
    async with KubeEmulator() as kube, kmock.Server(kube):
        kube.write_kubeconfig(kubeconfig)
        conn.send("ready")
        ticking = asyncio.create_task(ticker())
        while True:
            command, argument = await loop.run_in_executor(None, conn.recv)
            if command == "add":
                uids = []
                for i in range(argument):
                    pod = kube.add_pod(
                        NAMESPACE, f"pod-{i}", labels={**DEFAULT_POD_LABELS, LABEL: "true"}
                    )
                    uids.append(pod["metadata"]["uid"])
                # Its full collections then cover only what comes after the pods: at 10,000
                # pods one took a second, and stamped the PATCHes that waited for it a second
                # late. (The window itself runs with the collector off: see "mark".)
                gc.collect()
                gc.freeze()
                conn.send(uids)
            elif command == "patches":
                conn.send(
                    [
                        (
                            call.name,
                            (call.body or {}).get("metadata", {}).get("labels", {}),
                            call.at,
                        )
                        for call in kube.requests("PATCH", since=argument)
                    ]
                )
            elif command == "mark":
                lags.clear()
                collections.clear()
                gc.disable()  # until "lags": no collection pause in the window
                conn.send(kube.checkpoint())
            elif command == "lags":
                gc.enable()
                conn.send((list(lags), [c for c in collections if c[2] > 0.05]))
            elif command == "stop":
                ticking.cancel()
                await kube.close()
                conn.send("stopped")
                return


class Emulator:
    def __init__(self, kubeconfig: str, pin: bool) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=emulator_main, args=(child, kubeconfig, pin), daemon=True
        )
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            self._process.kill()
            raise RuntimeError("the emulator did not start")

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def call(self, command: str, argument: Any = None, timeout: float = 300) -> Any:
        self._conn.send((command, argument))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"emulator: no answer to {command}")
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call("stop", timeout=10)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


# -- the aggregator process ---------------------------------------------------------------


def start_aggregator(
    log_dir: Path, kubeconfig: str, pin: bool, root: Path | None, extra: list[str]
) -> harness.AggregatorProcess:
    port, metrics_port = harness.free_port(), harness.free_port()
    args = [
        "-m",
        "aggregator",
        "--listen",
        f"{harness.HOST}:{port}",
        "--metrics-listen",
        f"{harness.HOST}:{metrics_port}",
        "--kube-backend",
        "kubernetes",
        "--kubeconfig",
        kubeconfig,
        "--namespace",
        NAMESPACE,
        "--kube-qps",
        "1000",
        "--kube-burst",
        "1000",
        "--events",
        "false",
        # Every simulated agent connects from this one address.
        "--max-streams-per-peer",
        "100000",
        # The simulated agents carry no token: this measures reports, not TokenReviews.
        "--auth",
        "none",
        "--log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if root is not None:
        env["PYTHONPATH"] = f"{root}:{root / 'proto'}"
    prefix = ["taskset", "-c", "0"] if pin else []
    log_path = log_dir / "aggregator.log"
    log = log_path.open("wb")
    popen = subprocess.Popen(
        [*prefix, sys.executable, *args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root or harness.REPO_ROOT,
        start_new_session=True,
        env=env,
    )
    process = harness.AggregatorProcess(
        "aggregator", popen, log_path, log, port=port, metrics_port=metrics_port
    )
    # --log-level warning hides "listening on": wait for the port instead.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not process.alive:
            raise RuntimeError(f"aggregator exited\n{process.tail()}")
        with contextlib.suppress(OSError), socket.create_connection((harness.HOST, port), 0.2):
            break
        time.sleep(0.1)
    else:
        process.stop()
        raise RuntimeError("aggregator did not listen")
    return process


def wait_for_pods(address: str, count: int, timeout: float = 180) -> None:
    """Until the aggregator tracks ``count`` pods (its watch delivered them)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        while time.monotonic() < deadline:
            if stub.GetSummary(pb.GetSummaryRequest(), timeout=10).pods >= count:
                return
            time.sleep(0.2)
    raise RuntimeError(f"the aggregator did not discover {count} pods in {timeout:g}s")


class HealthChecks(threading.Thread):
    """``grpc.health.v1`` checks of the aggregator every 100 ms until ``until``: how long each
    took (seconds), with when it started. A stalled aggregator answers them late."""

    def __init__(self, address: str, until: float) -> None:
        super().__init__(name="health-checks", daemon=True)
        self.address, self.until = address, until
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while (started := time.monotonic()) < self.until:
                with contextlib.suppress(grpc.RpcError):
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                took = time.monotonic() - started
                self.samples.append((started, took))
                time.sleep(max(0.0, 0.1 - took))


def reports_counted(aggregator: harness.AggregatorProcess) -> float:
    """serve_health_reports_total, from the aggregator's /metrics."""
    value = harness.metric_value(aggregator.metrics_port, "serve_health_reports_total")
    return value or 0.0


# -- the load processes -------------------------------------------------------------------


def plan_connections(agents: int, requested: int | None, fd_limit: int) -> tuple[int, str]:
    """How many connections N agents get, and why fewer than N (empty: one each)."""
    allowed = fd_limit - FD_RESERVE
    connections = min(agents, allowed, requested or agents)
    if connections == agents:
        return connections, ""
    if requested is not None and requested < min(agents, allowed):
        why = f"--connections {requested}"
    else:
        why = (
            f"the aggregator holds one file descriptor per connection and may open {fd_limit:,} "
            f"(RLIMIT_NOFILE; the hard limit here, it cannot be raised), {FD_RESERVE} kept for "
            "itself"
        )
    return connections, why


def split_load(agents: int, connections: int) -> list[tuple[int, int, int]]:
    """(first agent, agents, connections) of each load process, as even as possible."""
    processes = math.ceil(connections / CONNECTIONS_PER_LOAD)
    shares = []
    first = 0
    for k in range(processes):
        count = agents * (k + 1) // processes - agents * k // processes
        held = connections * (k + 1) // processes - connections * k // processes
        shares.append((first, count, held))
        first += count
    return shares


class LoadProcess:
    """One load process and its pipe."""

    def __init__(self, address: str, pods: list[tuple[str, str]], options: dict[str, Any]) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=load_main, args=(child, address, pods, options), daemon=True
        )
        self.process.start()
        self.window = procstat.CpuWindow(self.pid)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def receive(self, expected: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"load process {self.pid}: no {expected!r} in {timeout:g}s")
        kind, value = self._conn.recv()
        if kind != expected:
            raise RuntimeError(f"load process {self.pid}: {kind!r}, not {expected!r}")
        return value

    def send(self, *message: Any) -> None:
        self._conn.send(message)

    def stop(self) -> dict[str, Any]:
        self.send("stop")
        stats = self.receive("done", 120)
        self.process.join(40)
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.send("stop")
            self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# -- one measurement ----------------------------------------------------------------------


def measure(agents: int, options: dict[str, Any], pin: bool, fd_limit: int) -> Result:
    connections, why = plan_connections(agents, options["connections"], fd_limit)
    if why:
        print(f"{agents:,} agents share {connections:,} connections round-robin: {why}")
    shares = split_load(agents, connections)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-ingest-"))
    kubeconfig = str(log_dir / "kubeconfig")
    root: Path | None = options["aggregator_root"]
    emulator = Emulator(kubeconfig, pin)
    aggregator = None
    loads: list[LoadProcess] = []
    try:
        aggregator = start_aggregator(
            log_dir, kubeconfig, pin, root, options["aggregator_arg"] or []
        )
        time.sleep(2)
        rss_empty = procstat.rss_bytes(aggregator.pid)
        uids = emulator.call("add", agents)
        wait_for_pods(aggregator.address, agents)  # the watch delivers them
        rss_pods = procstat.rss_bytes(aggregator.pid)
        pods = [(f"pod-{i}", uid) for i, uid in enumerate(uids)]
        connect_timeout = 60 + agents / 200
        for k, (first, count, held) in enumerate(shares):
            load_options = {
                "connections": held,
                "protocol": options["protocol"],
                "seed": options["seed"] * 1000 + k,
                "connect_timeout": connect_timeout,
                "pin": pin,
            }
            loads.append(LoadProcess(aggregator.address, pods[first : first + count], load_options))
        started = time.monotonic()
        connected = [load.receive("connected", connect_timeout + 60) for load in loads]
        print(
            f"  {sum(c['connected'] for c in connected):,} of {agents:,} agents connected over "
            f"{connections:,} connections ({len(loads)} load processes) in "
            f"{time.monotonic() - started:.1f}s",
            flush=True,
        )
        measure_from = time.monotonic() + options["warmup"]
        stop_at = measure_from + options["duration"]
        for load in loads:
            load.send("window", measure_from, stop_at)
        time.sleep(max(0.0, measure_from - time.monotonic()))
        mark = emulator.call("mark")
        windows = [procstat.CpuWindow(aggregator.pid), procstat.CpuWindow(emulator.pid)]
        windows += [load.window for load in loads]
        for window in windows:
            window.start()
        reports_before = reports_counted(aggregator)
        checks = HealthChecks(aggregator.address, stop_at)
        checks.start()
        time.sleep(max(0.0, stop_at - time.monotonic()))
        cpu = [window.stop() for window in windows]
        reports_after = reports_counted(aggregator)
        rss = procstat.rss_bytes(aggregator.pid)
        fds = procstat.open_fds(aggregator.pid)
        load_rss = [procstat.rss_bytes(load.pid) for load in loads]
        time.sleep(WRITE_GRACE)  # the last writes land
        patches = emulator.call("patches", mark)
        emulator_lags, slow_gc = emulator.call("lags")
        emulator_lags = [lag for lag in emulator_lags if lag[0] < stop_at]
        checks.join(15)
        stats = [load.stop() for load in loads]
        exited = not aggregator.alive
        return summarise(
            agents=agents,
            options=options,
            connections=connections,
            stats=stats,
            patches=patches,
            cpu=cpu,
            rss=(rss_empty, rss_pods, rss),
            load_rss=load_rss,
            fds=fds,
            reports=reports_after - reports_before,
            exited=exited,
            log_dir=str(log_dir),
            measure_from=measure_from,
            stalls=(checks.samples, emulator_lags, slow_gc),
        )
    finally:
        for load in loads:
            load.kill()
        if aggregator is not None:
            aggregator.stop()
        emulator.stop()


def tracked_pod_bytes(root: Path | None, protocol: str, count: int = 10_000) -> float | None:
    """bench/ingest_tracked.py against the measured checkout's aggregator (a subprocess)."""
    root = root or harness.REPO_ROOT
    script = Path(__file__).resolve().with_name("ingest_tracked.py")
    done = subprocess.run(
        [sys.executable, str(script), str(count), protocol],
        cwd=root,
        env={**os.environ, "PYTHONPATH": f"{root}:{root / 'proto'}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        print(f"tracked-pod state: not measured\n{done.stderr[-2000:]}")
        return None
    return float(done.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--protocol", choices=(ON_CHANGE, HEARTBEAT), default=ON_CHANGE)
    parser.add_argument(
        "--connections",
        "--channels",
        type=int,
        default=None,
        help="connections at most (default: one per agent, up to the file limit)",
    )
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--find-max", action="store_true", help="step N up until it fails")
    parser.add_argument("--no-pin", action="store_true", help="do not pin to cores 0 and 1")
    parser.add_argument(
        "--aggregator-root",
        type=Path,
        default=None,
        help="run the aggregator from this checkout (e.g. a git worktree of an older commit)",
    )
    parser.add_argument(
        "--aggregator-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra aggregator flag, e.g. --aggregator-arg=--keepalive-time=10s (repeatable)",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args()
    if args.aggregator_root is not None:
        args.aggregator_root = args.aggregator_root.resolve()
        if not (args.aggregator_root / "aggregator" / "__main__.py").exists():
            parser.error(f"--aggregator-root {args.aggregator_root}: no aggregator package")
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    fd_limit = procstat.raise_fd_limit()
    if pin:
        os.sched_setaffinity(0, {1})  # this process too stays off the aggregator's core
    options = vars(args)
    sizes = FIND_MAX_SIZES if args.find_max else (args.agents,)
    results: list[Result] = []
    for size in sizes:
        print(f"measuring {size:,} agents ({args.protocol}) ...", flush=True)
        result = measure(size, options, pin, fd_limit)
        results.append(result)
        print(json.dumps(result.as_dict(), indent=2), flush=True)
        if result.load_bottleneck:
            print("NOT A RESULT: the load generator was the bottleneck", flush=True)
        if args.find_max and not result.holds:
            break
    print("\n" + table(results))
    root = args.aggregator_root
    per_pod = tracked_pod_bytes(root, args.protocol)
    print(f"aggregator from {root or harness.REPO_ROOT}; pinned (0 / 1): {pin}")
    if per_pod is not None:
        print(f"tracked-pod state (tracemalloc, 10,000 pods): {per_pod:.0f} bytes per pod")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "pinned": pin,
                "fd_limit": fd_limit,
                "fd_hard_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                "aggregator_root": str(root or harness.REPO_ROOT),
                "protocol": args.protocol,
                "tracked_pod_bytes": None if per_pod is None else round(per_pod),
                "results": [r.as_dict() for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
