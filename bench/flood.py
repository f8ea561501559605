"""Connection flood: the aggregator process's memory under thousands of half-open connections
of each kind (bench/halfopen.py: silent, preface, settings, idle, hello, partial), while a live
agent keeps reporting.

For each kind and size (default 1,000, 5,000 and 10,000 connections), a fresh aggregator
process (``python -m aggregator``, memory backend, ``--auth none``, ``--ack-every 1`` so that
every report is acked, and deadlines long enough that none of the flood is closed while it is
measured) is flooded from a separate process. Measured: its RSS before, under the flood (after
``--hold`` seconds, and once RSS stopped growing) and after the flood's connections were reset;
the RSS each connection costs; whether grpc.health.v1 answers SERVING on a new connection
during the flood (and how long that takes); and the round trip (report -> ack) of a live
sidecar agent reporting every 50 ms, before and during the flood. Then (``--reap``, the
default) a flood of the smallest size per kind is left alone against an aggregator with default
settings, and the time until the server's own deadlines (--handshake-timeout; an unanswered
ping, --keepalive-time + --keepalive-timeout) closed all of it is reported.

    python -m bench.flood                     # 6 kinds x 1k, 5k, 10k, with --reap (~8 min)
    python -m bench.flood --sizes 1000 --kinds silent,hello

Writes bench/results/flood.json. Loopback only (127.0.0.0/8); every process is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import halfopen, procstat
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.states import ServeState
from testsupport import harness

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "flood.json"
LIVE_POD = harness.PodIdentity(name="live-pod")
#: Source addresses of the flood: 250 x 64 (--max-streams-per-peer) = 16,000 Report streams.
ADDRESSES = 250
REPORT_INTERVAL = 0.05
MiB = 2**20


# -- the flood process --------------------------------------------------------------------


def flood_main(conn: Connection, host: str, port: int) -> None:
    """Hold half-open connections to ``host:port``; answer commands on ``conn``."""
    procstat.raise_fd_limit()
    asyncio.run(_flood(conn, host, port))


async def _flood(conn: Connection, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    flood = halfopen.Flood(host, port)
    conn.send("ready")
    while True:
        command, argument = await loop.run_in_executor(None, conn.recv)
        if command == "open":
            kind, count = argument
            started = loop.time()
            await flood.open(kind, count, halfopen.sources(ADDRESSES))
            conn.send((len(flood), flood.failures[:3], len(flood.failures), loop.time() - started))
        elif command == "closed":
            conn.send(halfopen.count_closed(flood.sockets))
        elif command == "close":
            flood.close(reset=True)
            conn.send(None)
        elif command == "stop":
            flood.close(reset=True)
            conn.send(None)
            return


class FloodProcess:
    def __init__(self, host: str, port: int) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=flood_main, args=(child, host, port), daemon=True, name="flood"
        )
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            self.stop()
            raise harness.HarnessError("the flood process did not start")

    def call(self, command: str, argument: Any = None, timeout: float = 300) -> Any:
        self._conn.send((command, argument))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"flood process: no answer to {command}")
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call("stop", timeout=30)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# -- a live agent -------------------------------------------------------------------------


class LiveAgent:
    """A well-behaved sidecar agent on a thread of its own: a SERVING report every
    ``interval``, each acked (the aggregator runs with --ack-every 1); keeps the round trips."""

    def __init__(self, address: str, interval: float = REPORT_INTERVAL) -> None:
        self._interval = interval
        self._requests: queue.Queue[pb.AgentMessage | None] = queue.Queue()
        self._channel = grpc.insecure_channel(address)
        stub = pb_grpc.ReportServiceStub(self._channel)
        self._call = stub.Report(iter(self._requests.get, None))
        #: (monotonic time sent, seconds to its ack)
        self.round_trips: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-agent")

    def start(self) -> None:
        pod = pb.PodRef(namespace=LIVE_POD.namespace, name=LIVE_POD.name, uid=LIVE_POD.uid)
        self._requests.put(
            pb.AgentMessage(
                hello=pb.Hello(mode=pb.AGENT_MODE_SIDECAR, pod=pod, agent_version="bench")
            )
        )
        first = next(self._call)
        if first.WhichOneof("kind") != "settings":
            raise harness.HarnessError(f"live agent: expected settings, got {first}")
        self._thread.start()

    def _run(self) -> None:
        sequence = 0
        while not self._stop.is_set():
            sequence += 1
            sent = time.monotonic()
            report = pb.PodReport(state=pb.SERVE_STATE_SERVING, sequence=sequence)
            self._requests.put(pb.AgentMessage(reports=pb.ReportBatch(reports=[report])))
            try:
                reply = next(self._call)
            except (grpc.RpcError, StopIteration) as error:
                if not self._stop.is_set():
                    self.errors.append(repr(error))
                return
            if reply.ack.sequence != sequence:
                self.errors.append(f"ack {reply.ack.sequence} for report {sequence}")
            self.round_trips.append((sent, time.monotonic() - sent))
            self._stop.wait(self._interval)

    def between(self, start: float, end: float) -> list[float]:
        return [seconds for sent, seconds in self.round_trips if start <= sent < end]

    def stop(self) -> None:
        self._stop.set()
        self._call.cancel()
        self._requests.put(None)
        self._thread.join(10)
        self._channel.close()


def percentiles_ms(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def health_check(address: str) -> tuple[str, float]:
    """grpc.health.v1 Check on a new connection: (status or error, seconds)."""
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.RpcError as error:
            status = f"error {error.code().name}"
    return status, time.monotonic() - started


def hold_until_settled(pid: int, hold: float, most: float = 30.0) -> list[int]:
    """RSS samples of ``pid`` every 250 ms for ``hold`` seconds, and on until it grew by less
    than 1 MiB in the last second (the server may still be busy with the flood's streams), or
    ``most`` seconds."""
    started = time.monotonic()
    samples: list[int] = []
    while True:
        time.sleep(0.25)
        samples.append(procstat.rss_bytes(pid))
        elapsed = time.monotonic() - started
        settled = len(samples) > 4 and samples[-1] - samples[-5] < MiB
        if elapsed >= most or (elapsed >= hold and settled):
            return samples


def wait_until(check: Any, within: float, interval: float = 0.25) -> float | None:
    """Seconds until ``check()`` is true; None if not within ``within``."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > within:
            return None
        time.sleep(interval)


#: While a flood is measured, the server's deadlines must not close any of it.
PATIENT = ("--handshake-timeout", "120s", "--keepalive-time", "2h", "--keepalive-timeout", "2m")


@contextlib.contextmanager
def aggregator_with_agent(
    log_dir: Path, flags: tuple[str, ...] = ()
) -> Iterator[tuple[harness.AggregatorProcess, LiveAgent]]:
    aggregator = harness.start_aggregator(log_dir, extra_args=["--ack-every", "1", *flags])
    agent = None
    try:
        agent = LiveAgent(aggregator.address)
        agent.start()
        yield aggregator, agent
    finally:
        if agent is not None:
            agent.stop()
        aggregator.stop()


def measure(kind: str, size: int, hold: float, log_dir: Path) -> dict[str, Any]:
    """One flood of ``size`` connections of ``kind``, held, then reset (deadlines: PATIENT)."""
    with aggregator_with_agent(log_dir / f"{kind}-{size}", PATIENT) as (aggregator, agent):
        pid = aggregator.pid
        time.sleep(2.0)  # past start-up; the agent reports
        rss_before, fds_before = procstat.rss_bytes(pid), procstat.open_fds(pid)
        quiet_end = time.monotonic()
        flood = FloodProcess(harness.HOST, aggregator.port)
        try:
            flood_start = time.monotonic()
            opened, first_failures, failures, open_s = flood.call("open", (kind, size))
            samples = hold_until_settled(pid, hold)
            fds_during = procstat.open_fds(pid)
            health, health_s = health_check(aggregator.address)
            flood_end = time.monotonic()
            closed_by_server = flood.call("closed")
            flood.call("close")
        finally:
            flood.stop()
        fds_back = wait_until(lambda: procstat.open_fds(pid) <= fds_before + 2, within=30)
        time.sleep(1.0)
        rss_after = procstat.rss_bytes(pid)
        with harness.Inspector(aggregator.address) as inspector:
            pod = inspector.get_pod(LIVE_POD)
    rss_during = max(samples)
    return {
        "kind": kind,
        "connections": size,
        "opened": opened,
        "open_failures": failures,
        "first_failures": first_failures,
        "open_seconds": round(open_s, 2),
        "held_seconds": round(flood_end - flood_start - open_s, 1),
        "rss_before_mib": round(rss_before / MiB, 1),
        "rss_during_mib": round(rss_during / MiB, 1),
        "rss_after_mib": round(rss_after / MiB, 1),
        "bytes_per_connection": round((rss_during - rss_before) / max(opened, 1)),
        "fds_before": fds_before,
        "fds_during": fds_during,
        "fds_back_after_s": None if fds_back is None else round(fds_back, 2),
        "closed_by_server_while_held": closed_by_server,
        "health_during": health,
        "health_seconds": round(health_s, 3),
        "live_before": percentiles_ms(agent.between(0, quiet_end)),
        "live_during": percentiles_ms(agent.between(flood_start, flood_end)),
        "live_reports_during": len(agent.between(flood_start, flood_end)),
        "live_errors": agent.errors[:3],
        "live_pod_state": ServeState(pod.state).name if pod is not None else "not tracked",
    }


def reaping(kind: str, size: int, log_dir: Path) -> dict[str, Any]:
    """A flood left alone against the default deadlines: seconds until the server closed all
    of it, and whether the live agent survived (it answers pings)."""
    with aggregator_with_agent(log_dir / f"{kind}-{size}-reap") as (aggregator, agent):
        pid = aggregator.pid
        time.sleep(1.0)
        fds_before = procstat.open_fds(pid)
        flood = FloodProcess(harness.HOST, aggregator.port)
        try:
            opened, _, _, _ = flood.call("open", (kind, size))
            opened_at = time.monotonic()
            done = wait_until(lambda: flood.call("closed") >= opened, within=120)
            reaped_after = None if done is None else time.monotonic() - opened_at
            closed = flood.call("closed")
        finally:
            flood.stop()
        fds_back = wait_until(lambda: procstat.open_fds(pid) <= fds_before + 2, within=10)
        with harness.Inspector(aggregator.address) as inspector:
            pod = inspector.get_pod(LIVE_POD)
    return {
        "kind": kind,
        "connections": opened,
        "closed_by_server": closed,
        "all_closed_after_s": None if reaped_after is None else round(reaped_after, 1),
        "server_fds_back": fds_back is not None,
        "live_errors": agent.errors[:3],
        "live_pod_state": ServeState(pod.state).name if pod is not None else "not tracked",
    }


def print_row(result: dict[str, Any]) -> None:
    during = result["live_during"]
    print(
        f"  {result['kind']:<9} {result['opened']:>6,}/{result['connections']:<6,} "
        f"RSS {result['rss_before_mib']:6.1f} -> {result['rss_during_mib']:6.1f} MiB "
        f"({result['bytes_per_connection'] / 1024:5.1f} KiB/conn), after reset "
        f"{result['rss_after_mib']:6.1f} MiB; health {result['health_during']} "
        f"({result['health_seconds'] * 1000:.0f} ms); live agent p50 {during['p50_ms']} ms "
        f"p99 {during['p99_ms']} ms ({result['live_reports_during']} reports, "
        f"{len(result['live_errors'])} errors), pod {result['live_pod_state']}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(halfopen.KINDS))
    parser.add_argument("--sizes", default="1000,5000,10000")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds under the flood, at least")
    parser.add_argument(
        "--reap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the server's own deadlines on the smallest size",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args()
    kinds = [kind for kind in args.kinds.split(",") if kind]
    sizes = sorted(int(size) for size in args.sizes.split(","))
    unknown = set(kinds) - set(halfopen.KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; from {', '.join(halfopen.KINDS)}")
    procstat.raise_fd_limit(max(sizes) + 1000)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-flood-"))
    results = []
    for kind in kinds:
        print(f"{kind}:", flush=True)
        for size in sizes:
            results.append(measure(kind, size, args.hold, log_dir))
            print_row(results[-1])
    reaped = []
    if args.reap:
        print(f"reaping, default deadlines, {sizes[0]:,} connections of each kind:", flush=True)
        for kind in kinds:
            reaped.append(reaping(kind, sizes[0], log_dir))
            after = reaped[-1]["all_closed_after_s"]
            print(
                f"  {kind:<9} {reaped[-1]['closed_by_server']:,}/{reaped[-1]['connections']:,} "
                f"closed by the server, all after {after} s; live agent "
                f"{len(reaped[-1]['live_errors'])} errors, pod {reaped[-1]['live_pod_state']}",
                flush=True,
            )
    report = {
        "hold_s": args.hold,
        "live_report_interval_s": REPORT_INTERVAL,
        "deadlines_while_measuring": list(PATIENT),
        "results": results,
        "reaping": reaped,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    bad = [
        f"{r['kind']} x {r['connections']}"
        for r in [*results, *reaped]
        if r.get("health_during", "SERVING") != "SERVING"
        or r["live_errors"]
        or r["live_pod_state"] != "SERVING"
        or r.get("all_closed_after_s", 0) is None
    ]
    if bad:
        print(f"health, live agent, its pod or reaping not as expected under: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
