"""Ingest: N simulated sidecar agents against one aggregator process on one core.

Three processes on a 2-core machine:

- the **aggregator** (``python -m aggregator``, Kubernetes backend), pinned to core 0 with
  ``taskset -c 0``: the thing measured;
- the **Kubernetes API emulator** (tests/kube/emulator.py over real HTTP), pinned to core 1:
  holds the N pods and timestamps every label PATCH on arrival;
- the **load**, pinned to core 1: N agents, each its own ``Report`` stream (multiplexed over
  ``--channels`` gRPC channels), reporting at 1 Hz (each at its own phase), with a 1 % chance
  per report to turn NOT_READY (and back to SERVING 3 s later).

Measured over ``--duration`` seconds after ``--warmup``: reports/s the aggregator counted
(``serve_health_reports_total``), its CPU (share of one core) and RSS, memory per tracked pod
(RSS growth from an empty aggregator to one with N pods and N streams, divided by N), and the
latency from a state change leaving the agent to its label write (``false``) reaching the
emulator, p50/p99. Clocks: all three processes read the same CLOCK_MONOTONIC.

    python -m bench.ingest --agents 10000
    python -m bench.ingest --find-max            # 2,000 ... up: the largest N holding 1 Hz
                                                 # with p99 < 1 s

Writes bench/results/ingest.json. Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench import harness, procstat
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "ingest.json"
NAMESPACE = "bench"
LABEL = "ray.io/serve"
FLIP_CHANCE = 0.01
FLIP_BACK_AFTER = 3.0


# -- the emulator process -----------------------------------------------------------------


def emulator_main(conn: Connection, kubeconfig: str) -> None:
    """Serve the emulator; answer commands on ``conn`` until told to stop."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    asyncio.run(_emulator(conn, kubeconfig))


async def _emulator(conn: Connection, kubeconfig: str) -> None:
    import kmock

    from tests.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator

    loop = asyncio.get_running_loop()
    async with KubeEmulator() as kube, kmock.Server(kube):
        kube.write_kubeconfig(kubeconfig)
        conn.send("ready")
        while True:
            command, argument = await loop.run_in_executor(None, conn.recv)
            if command == "add":
                uids = []
                for i in range(argument):
                    pod = kube.add_pod(
                        NAMESPACE, f"pod-{i}", labels={**DEFAULT_POD_LABELS, LABEL: "true"}
                    )
                    uids.append(pod["metadata"]["uid"])
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
                conn.send(kube.checkpoint())
            elif command == "stop":
                await kube.close()
                conn.send("stopped")
                return


def labels_of(body: Any) -> dict[str, str]:
    return ((body or {}).get("metadata") or {}).get("labels") or {}


class Emulator:
    def __init__(self, kubeconfig: str) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=emulator_main, args=(child, kubeconfig), daemon=True)
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            raise RuntimeError("the emulator did not start")

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


# -- the aggregator process ---------------------------------------------------------------


def start_aggregator(log_dir: Path, kubeconfig: str, pin: bool) -> harness.AggregatorProcess:
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
    ]
    prefix = ["taskset", "-c", "0"] if pin else []
    log_path = log_dir / "aggregator.log"
    log = log_path.open("wb")
    popen = subprocess.Popen(
        [*prefix, sys.executable, *args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=harness.REPO_ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
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


# -- the load -----------------------------------------------------------------------------


@dataclass
class Load:
    sent: int = 0
    acked: int = 0
    late: int = 0  # ticks that went out more than 100 ms after their time
    max_lag: float = 0.0
    flips: list[tuple[str, float]] = field(default_factory=list)  # (pod, t0 monotonic)
    errors: int = 0
    reconnects: int = 0
    error_samples: list[str] = field(default_factory=list)


async def agent(
    channel: grpc.aio.Channel,
    name: str,
    uid: str,
    load: Load,
    start: float,
    stop: float,
    measure_from: float,
    rng: random.Random,
    connecting: asyncio.Semaphore,
) -> None:
    hello = pb.AgentMessage(
        hello=pb.Hello(
            mode=pb.AGENT_MODE_SIDECAR,
            pod=pb.PodRef(namespace=NAMESPACE, name=name, uid=uid),
            node_name="bench",
            agent_version="bench",
        )
    )
    # Connect a few hundred at a time, as a fleet does (thousands of RPCs opened in the same
    # instant fail in the client's gRPC core with INTERNAL); retry like an agent.
    for attempt in range(5):
        call = pb_grpc.ReportServiceStub(channel).Report()
        try:
            async with connecting:
                await call.write(hello)
                await call.read()  # settings
            break
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
            call.cancel()
            load.reconnects += 1
            if attempt == 4:
                load.errors += 1
                load.error_samples.append(f"connect: {error!r}"[:200])
                return
            await asyncio.sleep(0.2 * (attempt + 1))
    try:

        async def read_acks() -> None:
            while (await call.read()) is not grpc.aio.EOF:
                load.acked += 1

        reader = asyncio.create_task(read_acks())
        loop = asyncio.get_running_loop()
        tick = start + rng.random()
        sequence = 0
        serving_again_at = 0.0
        state = pb.SERVE_STATE_SERVING
        while tick < stop:
            delay = tick - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = loop.time() - tick
            if lag > 0.1:
                load.late += 1
            load.max_lag = max(load.max_lag, lag)
            sequence += 1
            now = time.monotonic()
            if state == pb.SERVE_STATE_SERVING and rng.random() < FLIP_CHANCE:
                state = pb.SERVE_STATE_NOT_READY
                serving_again_at = now + FLIP_BACK_AFTER
                if now >= measure_from:
                    load.flips.append((name, now))
            elif state == pb.SERVE_STATE_NOT_READY and now >= serving_again_at:
                state = pb.SERVE_STATE_SERVING
            await call.write(
                pb.AgentMessage(
                    reports=pb.ReportBatch(
                        reports=[pb.PodReport(state=state, sequence=sequence, http_status=200)]
                    )
                )
            )
            load.sent += 1
            tick += 1.0
        reader.cancel()
        # The end of the run, not an error; the call may have ended already (then grpc raises
        # its internal ExecuteBatchError, not an AioRpcError).
        with contextlib.suppress(Exception):
            await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
        load.errors += 1
        if len(load.error_samples) < 5:
            when = asyncio.get_running_loop().time() - start
            load.error_samples.append(f"{when:.1f}s: {error!r}"[:200])
    finally:
        call.cancel()


async def run_load(
    address: str, uids: list[str], channels: int, warmup: float, duration: float, seed: int
) -> Load:
    load = Load()
    rng = random.Random(seed)
    opened = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    loop = asyncio.get_running_loop()
    connecting = asyncio.Semaphore(200)
    start = loop.time() + 2.0
    measure_from = time.monotonic() + 2.0 + warmup
    stop = start + warmup + duration
    try:
        await asyncio.gather(
            *(
                agent(
                    opened[i % channels],
                    f"pod-{i}",
                    uid,
                    load,
                    start,
                    stop,
                    measure_from,
                    random.Random(rng.random()),
                    connecting,
                )
                for i, uid in enumerate(uids)
            )
        )
    finally:
        for channel in opened:
            await channel.close()
    return load


def load_main(conn: Connection, address: str, uids: list[str], options: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    load = asyncio.run(
        run_load(
            address,
            uids,
            options["channels"],
            options["warmup"],
            options["duration"],
            options["seed"],
        )
    )
    conn.send(asdict(load))


# -- one measurement ----------------------------------------------------------------------


@dataclass
class Result:
    agents: int
    duration_s: float
    reports_per_s: float
    reports_per_s_per_agent: float
    aggregator_cpu_percent: float
    aggregator_rss_mib: float
    rss_empty_mib: float
    bytes_per_pod: float
    flips: int
    flips_written: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    load_late_ticks: int
    load_max_lag_ms: float
    stream_errors: int
    error_samples: list[str]
    reconnects: int

    @property
    def holds(self) -> bool:
        return (
            self.reports_per_s_per_agent >= 0.97
            and self.latency_p99_ms is not None
            and self.latency_p99_ms < 1000
        )


def wait_for_pods(address: str, count: int, timeout: float = 120) -> None:
    """Until the aggregator tracks ``count`` pods (its watch delivered them)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        while time.monotonic() < deadline:
            if stub.GetSummary(pb.GetSummaryRequest(), timeout=10).pods >= count:
                return
            time.sleep(0.2)
    raise RuntimeError(f"the aggregator did not discover {count} pods in {timeout:g}s")


def measure(agents: int, options: dict[str, Any], pin: bool) -> Result:
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-ingest-"))
    kubeconfig = str(log_dir / "kubeconfig")
    emulator = Emulator(kubeconfig)
    aggregator = None
    try:
        aggregator = start_aggregator(log_dir, kubeconfig, pin)
        time.sleep(2)
        rss_empty = procstat.rss_bytes(aggregator.pid)
        uids = emulator.call("add", agents)
        wait_for_pods(aggregator.address, agents)  # the watch delivers them
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        load_process = context.Process(
            target=load_main, args=(child, aggregator.address, uids, options), daemon=True
        )
        load_process.start()
        window = procstat.CpuWindow(aggregator.pid)
        time.sleep(2.0 + options["warmup"])
        mark = emulator.call("mark")
        window.start()
        reports_before = reports_counted(aggregator)
        time.sleep(options["duration"])
        cpu = window.stop()
        reports_after = reports_counted(aggregator)
        rss = procstat.rss_bytes(aggregator.pid)
        if not parent.poll(options["duration"] + 60):
            raise RuntimeError("the load did not finish")
        load = parent.recv()
        load_process.join(10)
        time.sleep(2)  # the last writes land
        patches = emulator.call("patches", mark)
        return summarise(
            agents, options, load, patches, cpu, rss, rss_empty, reports_after - reports_before
        )
    finally:
        if aggregator is not None:
            aggregator.stop()
        emulator.stop()


def reports_counted(aggregator: harness.AggregatorProcess) -> float:
    """serve_health_reports_total, from the aggregator's /metrics."""
    value = harness.metric_value(aggregator.metrics_port, "serve_health_reports_total")
    return value or 0.0


def summarise(
    agents: int,
    options: dict[str, Any],
    load: dict[str, Any],
    patches: list[tuple[str, dict[str, str], float]],
    cpu: float,
    rss: int,
    rss_empty: int,
    reports: float,
) -> Result:
    first_false: dict[str, list[float]] = {}
    for name, labels, at in patches:
        if labels.get(LABEL) == "false":
            first_false.setdefault(name, []).append(at)
    latencies = []
    for name, t0 in load["flips"]:
        later = [at for at in first_false.get(name, []) if at >= t0]
        if later:
            latencies.append(min(later) - t0)
    latencies.sort()

    def percentile(q: float) -> float | None:
        if not latencies:
            return None
        return latencies[min(len(latencies) - 1, round(q * (len(latencies) - 1)))] * 1000

    duration = options["duration"]
    return Result(
        agents=agents,
        duration_s=duration,
        reports_per_s=round(reports / duration, 1),
        reports_per_s_per_agent=round(reports / duration / agents, 3),
        aggregator_cpu_percent=round(cpu * 100, 1),
        aggregator_rss_mib=round(rss / 2**20, 1),
        rss_empty_mib=round(rss_empty / 2**20, 1),
        bytes_per_pod=round((rss - rss_empty) / agents),
        flips=len(load["flips"]),
        flips_written=len(latencies),
        latency_p50_ms=round(statistics.median(latencies) * 1000, 1) if latencies else None,
        latency_p99_ms=round(percentile(0.99), 1) if latencies else None,
        load_late_ticks=load["late"],
        load_max_lag_ms=round(load["max_lag"] * 1000, 1),
        stream_errors=load["errors"],
        error_samples=load["error_samples"],
        reconnects=load["reconnects"],
    )


def tracked_pod_bytes(count: int = 10_000) -> float:
    """Python heap per tracked pod in the aggregator's own state (tracker record, registry
    entry, keys, last observation), by tracemalloc: what grows with the fleet, apart from
    each agent's gRPC stream (which the RSS figure above includes)."""
    import tracemalloc

    from aggregator.core import Core, CoreSettings
    from aggregator.metrics import Metrics
    from aggregator.puller import Puller, PullSettings
    from aggregator.registry import MemoryRegistry
    from aggregator.tracker import Observation, Tracker, TrackerSettings
    from servehealth_common.pod_identity import PodInfo, PodKey
    from servehealth_common.states import ServeState

    core = Core(
        Tracker(TrackerSettings(), time.monotonic),
        MemoryRegistry(LABEL),
        Metrics("b"),
        Puller(PullSettings(5.0, 0.5, 256, 3.0), Metrics("p")),  # not started: pulls nothing
        CoreSettings(),
    )
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(count):
        key = PodKey(NAMESPACE, f"raycluster-worker-{i:05d}")
        stream = core.hello([PodInfo(key, uid=f"{i:08d}-0000-0000-0000-000000000000")])
        core.report(stream, key, Observation(ServeState.SERVING, "success", 200, 0.002))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return grown / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--channels", type=int, default=200)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--find-max", action="store_true", help="step N up until it fails")
    parser.add_argument("--no-pin", action="store_true", help="do not pin to cores 0 and 1")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args()
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    options = vars(args)
    sizes = [2_000, 5_000, 7_500, 10_000, 15_000] if args.find_max else [args.agents]
    results = []
    for size in sizes:
        print(f"measuring {size} agents ...", flush=True)
        result = measure(size, options, pin)
        results.append(result)
        print(json.dumps(asdict(result), indent=2), flush=True)
        if args.find_max and not result.holds:
            break
    header = f"{'agents':>7} {'reports/s':>10} {'per agent':>9} {'CPU %':>6} {'RSS MiB':>8} "
    header += f"{'B/pod':>6} {'p50 ms':>7} {'p99 ms':>7} {'holds':>5}"
    print("\n" + header)
    for r in results:
        print(
            f"{r.agents:>7} {r.reports_per_s:>10} {r.reports_per_s_per_agent:>9} "
            f"{r.aggregator_cpu_percent:>6} {r.aggregator_rss_mib:>8} {r.bytes_per_pod:>6} "
            f"{r.latency_p50_ms!s:>7} {r.latency_p99_ms!s:>7} {'yes' if r.holds else 'no':>5}"
        )
    per_pod = tracked_pod_bytes()
    print(f"aggregator pinned to core 0, emulator and load to core 1: {pin}")
    print(f"tracked-pod state (tracemalloc, 10,000 pods): {per_pod:.0f} bytes per pod")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "pinned": pin,
                "tracked_pod_bytes": round(per_pod),
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
