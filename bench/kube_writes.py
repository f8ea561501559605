"""How many Kubernetes API writes does the aggregator make, and how fast can it make them?

Everything runs in one process on 127.0.0.1: the Kubernetes API emulator of the tests
(``testsupport/kube/emulator.py``, kmock over real HTTP), an in-process aggregator with the
``kubernetes`` backend pointed at it through a kubeconfig, and one DaemonSet-mode report stream
over gRPC that speaks for every pod. Writes are counted where an API server would count them:
PATCH requests arriving at the emulator. Three scenarios, each with a fresh emulator and
aggregator:

a. steady state: 1,000 pods labelled ``true`` (seeded SERVING, as after a restart), then 60
   rounds of one SERVING heartbeat per pod; the tracker runs on a fake clock advanced 1 s per
   round, so 60 s of heartbeats take a second or two. Expected API writes: 0.
b. flapping: one pod whose proxy alternates UNHEALTHY/SERVING every 500 ms for 30 s (60
   reports, fake clock advanced 0.5 s each; every write is let through before the next report,
   the worst case), with the default thresholds (failure 1, success 2); and, for comparison,
   the same with ``--success-threshold 1`` (no hysteresis).
c. mass failure: 2,000 pods labelled ``true`` turn NOT_READY at once (heartbeating at 1 Hz
   after), default rate limit (``--kube-qps 20 --kube-burst 40``), real time: how long until the
   emulator shows all 2,000 labels ``false``. Expected about (2000 - 40) / 20 = 98 s. Also the
   busiest second of PATCH arrivals: the bucket grants at most burst + qps = 60 tokens in any
   second, but a writer task takes its token before its request leaves the process, so up to
   ``--kube-concurrency`` (16) requests granted just before a second can arrive within it.
   And the Events recorded for the 2,000 label changes (at most 5/s, bursts of 25, "drops the
   rest"): how many were sent, dropped, or still queued when the labels were done.

Run from the repository root (takes about two minutes, stops by itself)::

    .venv/bin/python -m bench.kube_writes

Prints a table and writes bench/results/kube_writes.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import kmock

from aggregator.flags import AggregatorFlags
from aggregator.kube.registry import KubeRegistry
from aggregator.server import Aggregator
from aggregator.wiring import build_aggregator
from servehealth_common.states import ServeState
from testsupport.kube.emulator import PODS, ApiCall, KubeEmulator, peak_count
from testsupport.messages import batch, open_node_stream

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "kube_writes.json"
NS = "ray"
LABEL = "ray.io/serve"
#: Reports per ReportBatch message (--max-message-bytes is 64 KiB; 500 reports are ~15 KiB).
BATCH = 500
#: Longest wait for the writer to finish anything but the mass-failure scenario.
SETTLE_TIMEOUT = 60.0
#: Longest wait for one message to be written to, or read from, the report stream.
CALL_TIMEOUT = 30.0
#: The bench reads one ack per message to know it was handled; aggregators that have
#: ``--ack-every`` ack only changes (and every Nth message) unless told otherwise.
ACK_EACH = (
    {"ack_every": 1} if "ack_every" in {f.name for f in dataclasses.fields(AggregatorFlags)} else {}
)
#: The bench's report stream carries no ServiceAccount token (it measures writes, not tokens).
NO_AUTH = (
    {"auth": "none"} if "auth" in {f.name for f in dataclasses.fields(AggregatorFlags)} else {}
)


class FakeClock:
    """The tracker's monotonic clock, advanced by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Row:
    scenario: str
    measure: str
    expected: str
    measured: str


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, scenario: str, measure: str, expected: str, measured: object) -> None:
        self.rows.append(Row(scenario, measure, expected, str(measured)))


# -- plumbing ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def emulator_with_pods(
    count: int, serve: str | None, prefix: str = "ray-worker"
) -> AsyncIterator[tuple[KubeEmulator, list[str], Path]]:
    """A running emulator holding ``count`` Ray pods, and a kubeconfig pointing at it."""
    labels = {"ray.io/node-type": "worker", "ray.io/cluster": "bench"}
    if serve is not None:
        labels[LABEL] = serve
    names = [f"{prefix}-{i:04d}" for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="kube-writes-") as tmp:
        async with KubeEmulator() as emulator, kmock.Server(emulator):
            try:
                for number, name in enumerate(names):
                    emulator.add_pod(NS, name, labels=labels, node_name=f"node-{number % 50}")
                kubeconfig = emulator.write_kubeconfig(Path(tmp) / "kubeconfig")
                yield emulator, names, kubeconfig
            finally:
                await emulator.close()


@contextlib.asynccontextmanager
async def running_aggregator(
    kubeconfig: Path, clock: Callable[[], float] = time.monotonic, **overrides: Any
) -> AsyncIterator[tuple[Aggregator, KubeRegistry]]:
    settings = AggregatorFlags(
        listen="127.0.0.1:0",
        metrics_listen="",
        kube_backend="kubernetes",
        kubeconfig=str(kubeconfig),
        shutdown_grace=0.2,
        **{**ACK_EACH, **NO_AUTH, **overrides},
    )
    aggregator = build_aggregator(settings, clock=clock)
    await aggregator.start()
    try:
        assert isinstance(aggregator.registry, KubeRegistry)
        yield aggregator, aggregator.registry
    finally:
        await aggregator.stop()


async def report(
    call: grpc.aio.StreamStreamCall, names: Sequence[str], state: ServeState, sequence: int
) -> int:
    """One report per pod, in batches; returns the next sequence number."""
    for start in range(0, len(names), BATCH):
        chunk = [(NS, name, int(state)) for name in names[start : start + BATCH]]
        await asyncio.wait_for(call.write(batch(chunk, sequence)), CALL_TIMEOUT)
        reply = await asyncio.wait_for(call.read(), CALL_TIMEOUT)
        if reply.ack.sequence != sequence:
            raise RuntimeError(f"expected the ack of {sequence}, got {reply}")
        sequence += 1
    return sequence


async def wait_for(check: Callable[[], bool], within: float, what: str) -> float:
    """Poll ``check`` every 10 ms; the seconds it took. Raises TimeoutError after ``within``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not check():
        if loop.time() - started > within:
            raise TimeoutError(f"{what}: not done within {within:g}s")
        await asyncio.sleep(0.01)
    return loop.time() - started


def patches(emulator: KubeEmulator, since: int) -> list[ApiCall]:
    return emulator.requests("PATCH", resource="pods", since=since)


def labels_of(emulator: KubeEmulator) -> list[str | None]:
    return [pod["metadata"]["labels"].get(LABEL) for pod in emulator.list_objects(PODS, NS)]


# -- a. steady state -------------------------------------------------------------------------


async def steady_state(results: Results, pods: int, rounds: int) -> None:
    clock = FakeClock()
    async with (
        # Labelled true: the aggregator seeds them SERVING, as after a restart.
        emulator_with_pods(pods, serve="true") as (emulator, names, kubeconfig),
        running_aggregator(kubeconfig, clock) as (agg, registry),
        grpc.aio.insecure_channel(f"127.0.0.1:{agg.port}") as channel,
    ):
        call = await open_node_stream(channel, "node-bench")
        mark = emulator.checkpoint()
        loop = asyncio.get_running_loop()
        started = loop.time()
        sequence = 1
        for _ in range(rounds):
            clock.advance(1.0)
            sequence = await report(call, names, ServeState.SERVING, sequence)
        elapsed = loop.time() - started
        await wait_for(lambda: registry.writer.pending == 0, SETTLE_TIMEOUT, "steady state")
        call.cancel()
        label_writes = patches(emulator, mark)
        requests = emulator.requests(since=mark)
        writes = [r for r in requests if r.method in ("PATCH", "POST", "PUT", "DELETE")]
        serving = agg.core.counts()[ServeState.SERVING]
        transitions = sum(
            metric.value
            for family in agg.metrics.transitions.collect()
            for metric in family.samples
            if metric.name.endswith("_total")
        )

    results.add("a steady", f"label writes, {pods} pods x {rounds} s", "0", len(label_writes))
    results.add("a steady", "  API writes of any kind", "0", len(writes))
    results.add("a steady", "  state transitions", "0", f"{transitions:.0f}")
    results.add("a steady", "pods SERVING at the end", str(pods), serving)
    results.data["steady_state"] = {
        "pods": pods,
        "rounds": rounds,
        "heartbeat_interval_s": 1.0,
        "clock": "fake, +1 s per round",
        "start": "pods labelled true, seeded SERVING",
        "label_writes": len(label_writes),
        "api_writes": len(writes),
        "transitions": transitions,
        "api_requests": len(requests),
        "request_verbs": sorted({r.verb for r in requests}),
        "pods_serving_at_end": serving,
        "wall_time_s": round(elapsed, 2),
    }


# -- b. flapping ----------------------------------------------------------------------------


async def flapping(seconds: float, success_threshold: int) -> dict[str, Any]:
    clock = FakeClock()
    reports = round(seconds / 0.5)
    async with (
        emulator_with_pods(1, serve=None, prefix="ray-flappy") as (emulator, names, kubeconfig),
        running_aggregator(kubeconfig, clock, success_threshold=success_threshold) as (
            agg,
            registry,
        ),
        grpc.aio.insecure_channel(f"127.0.0.1:{agg.port}") as channel,
    ):
        call = await open_node_stream(channel, "node-bench")
        sequence = await report(call, names, ServeState.SERVING, 1)
        await wait_for(lambda: labels_of(emulator) == ["true"], SETTLE_TIMEOUT, "first label")
        await wait_for(lambda: registry.writer.pending == 0, SETTLE_TIMEOUT, "first write")
        mark = emulator.checkpoint()
        values = []
        for number in range(reports):
            clock.advance(0.5)
            state = ServeState.UNHEALTHY if number % 2 == 0 else ServeState.SERVING
            sequence = await report(call, names, state, sequence)
            # Every write lands before the next report (the worst case: nothing coalesced).
            await wait_for(lambda: registry.writer.pending == 0, SETTLE_TIMEOUT, "flap write")
            values.append(labels_of(emulator)[0])
        call.cancel()
        writes = patches(emulator, mark)
        events = emulator.requests("POST", resource="events", since=mark)
        final_state = next(s.name for s, n in agg.core.counts().items() if n)

    changes = sum(1 for before, after in itertools.pairwise(["true", *values]) if before != after)
    return {
        "success_threshold": success_threshold,
        "failure_threshold": 1,
        "seconds": seconds,
        "flap_period_s": 0.5,
        "reports": reports,
        "label_writes": len(writes),
        "written_values": [w.body["metadata"]["labels"][LABEL] for w in writes],
        "label_changes_seen": changes,
        "events_created": len(events),
        "final_state": final_state,
        "final_label": values[-1] if values else None,
    }


async def flapping_both(results: Results, seconds: float) -> None:
    default = await flapping(seconds, success_threshold=2)
    bare = await flapping(seconds, success_threshold=1)
    results.add(
        "b flapping",
        f"label writes, 1 pod, {default['reports']} flaps (success 2)",
        "a handful",
        default["label_writes"],
    )
    results.add(
        "b flapping",
        "  final state / label",
        "-",
        f"{default['final_state']} / {default['final_label']}",
    )
    results.add(
        "b flapping",
        "label writes, same flaps, success threshold 1",
        "-",
        bare["label_writes"],
    )
    results.data["flapping"] = {"default_thresholds": default, "success_threshold_1": bare}


# -- c. mass failure at the default rate limit --------------------------------------------------


async def mass_failure(results: Results, pods: int, give_up_after: float) -> None:
    settings = AggregatorFlags(listen="127.0.0.1:0")
    qps, burst = settings.kube_qps, settings.kube_burst
    expected = max(0.0, (pods - burst) / qps)
    async with (
        emulator_with_pods(pods, serve="true") as (emulator, names, kubeconfig),
        running_aggregator(kubeconfig) as (agg, registry),
        grpc.aio.insecure_channel(f"127.0.0.1:{agg.port}") as channel,
    ):
        call = await open_node_stream(channel, "node-bench")
        sequence = await report(call, names, ServeState.SERVING, 1)
        if emulator.requests("PATCH"):
            raise AssertionError("seeded pods were written before the failure")
        loop = asyncio.get_running_loop()
        mark = emulator.checkpoint()
        t0 = loop.time()
        sequence = await report(call, names, ServeState.NOT_READY, sequence)
        reported = loop.time() - t0
        next_beat = t0 + 1.0
        print(f"  c: {pods} pods NOT_READY at t0; waiting for their labels ...", flush=True)
        progress = t0 + 10.0
        while registry.writer.pending:
            now = loop.time()
            if now - t0 > give_up_after:
                raise TimeoutError(f"mass failure: writes not done within {give_up_after:g}s")
            if now >= next_beat:  # agents keep heartbeating at 1 Hz
                sequence = await report(call, names, ServeState.NOT_READY, sequence)
                next_beat += 1.0
            if now >= progress:
                done = pods - registry.writer.pending
                print(f"     t0+{now - t0:5.1f}s  {done:5d}/{pods} labels written", flush=True)
                progress += 10.0
            await asyncio.sleep(0.05)
        idle = loop.time() - t0
        call.cancel()
        sample = agg.metrics.registry.get_sample_value
        sent, dropped, failed = (
            sample("serve_health_events_total", {"result": result}) or 0.0
            for result in ("sent", "dropped", "error")
        )
        calls = patches(emulator, mark)
        labels = labels_of(emulator)
        event_calls = emulator.requests("POST", resource="events", since=mark)
        events = len(event_calls)
        last_event = max((c.at - t0 for c in event_calls), default=0.0)

    arrivals = sorted(c.at - t0 for c in calls)
    if labels != ["false"] * pods:
        raise AssertionError("mass failure: not every label is false")

    def nth(fraction: float) -> float:
        return arrivals[max(0, round(fraction * len(arrivals)) - 1)]

    peak = peak_count(calls, window=1.0)
    results.add(
        "c mass",
        f"time until all {pods} labels false",
        f"~{expected:.0f} s",
        f"{arrivals[-1]:.1f} s",
    )
    results.add(
        "c mass", "  50% / 90% of labels false", "-", f"{nth(0.5):.1f} s / {nth(0.9):.1f} s"
    )
    results.add("c mass", "  PATCH requests", str(pods), len(calls))
    queued = pods - sent - dropped - failed  # one Event per label change
    results.add(
        "c mass",
        "  Events sent / dropped / still queued",
        f"~25 / ~{pods - 25} / 0",  # the recorder's bucket: bursts of 25, then 5/s
        f"{sent:.0f} / {dropped:.0f} / {queued:.0f}",
    )
    results.add("c mass", "  last Event created", "< 1 s", f"{last_event:.1f} s")
    slack = settings.kube_concurrency
    results.add("c mass", "  peak PATCHes in any 1 s", f"<= {burst + qps:.0f} (+{slack})", peak)
    results.data["mass_failure"] = {
        "pods": pods,
        "kube_qps": qps,
        "kube_burst": burst,
        "kube_concurrency": settings.kube_concurrency,
        "expected_s": round(expected, 1),
        "all_false_s": round(arrivals[-1], 3),
        "first_write_s": round(arrivals[0], 3),
        "half_false_s": round(nth(0.5), 3),
        "p90_false_s": round(nth(0.9), 3),
        "writer_idle_s": round(idle, 3),
        "reports_sent_s": round(reported, 3),
        "patch_requests": len(calls),
        "peak_patches_per_1s": peak,
        "events_created": events,
        "events_sent": sent,
        "events_dropped": dropped,
        "events_failed": failed,
        "events_still_queued": queued,
        "last_event_created_s": round(last_event, 3),
    }


# -- main ---------------------------------------------------------------------------------


def print_table(results: Results) -> None:
    rows = [Row("scenario", "measure", "expected", "measured"), *results.rows]
    cells = [(row.scenario, row.measure, row.expected, row.measured) for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(4)]
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))


async def run(args: argparse.Namespace) -> Results:
    results = Results()
    print(f"a: steady state, {args.steady_pods} pods, {args.steady_rounds} rounds", flush=True)
    await steady_state(results, args.steady_pods, args.steady_rounds)
    print(f"b: one pod flapping every 500 ms for {args.flap_seconds:g} s", flush=True)
    await flapping_both(results, args.flap_seconds)
    print(f"c: {args.mass_pods} pods turn bad at once, default rate limit", flush=True)
    await mass_failure(results, args.mass_pods, args.mass_timeout)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steady-pods", type=int, default=1000)
    parser.add_argument("--steady-rounds", type=int, default=60, help="seconds of heartbeats")
    parser.add_argument("--flap-seconds", type=float, default=30.0)
    parser.add_argument("--mass-pods", type=int, default=2000)
    parser.add_argument(
        "--mass-timeout", type=float, default=300.0, help="give up on scenario c after this"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    try:
        results = asyncio.run(run(args))
    except (AssertionError, TimeoutError, RuntimeError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    wall = round(time.monotonic() - started, 1)
    print()
    print_table(results)
    document = {
        "benchmark": "kube_writes",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "unit": "label writes = PATCH requests of pods arriving at the API emulator",
        **results.data,
        "table": [row.__dict__ for row in results.rows],
        "wall_time_s": wall,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.output} ({wall}s wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
