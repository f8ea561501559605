"""What reaches the API server when every agent loses the aggregator at once (issue 26)?

Two processes on 127.0.0.1: the Kubernetes API emulator (``testsupport/kube/emulator.py``, kmock
over real HTTP) in a child process of its own (``bench/storm_emulator.py``), and in the bench's
process thousands of simulated agents, each made of the product's own fallback objects: a
:class:`~node_agent.fallback.decider.Fallback` decider (its
:class:`~node_agent.fallback.budget.ApiBudget`, its Lease gate), a
:class:`~node_agent.fallback.runner.FallbackRunner` and, once it has something to send, a
:class:`~node_agent.fallback.writer.FallbackWriter`, all writers sharing one
:class:`~servehealth_common.kube.client.KubeClient`. Only the probes and the Report stream are
simulated: the bench tells each runner what a connected agent hears (the aggregator's write
settings, the fleet size it announces, a sidecar's PodView, ``accepted()``), then ``ended()``,
and feeds probe results every ``--probe-interval``.

Why two processes: each agent in fallback holds one long-lived watch of the aggregator's Lease
(30 min), so the full fleet keeps about 11,000 connections open, each a file descriptor at both
ends: 22,000 in one process, over the hard limit of 20,000 open files of the machine it runs on
(``ulimit -Hn``, which cannot be raised); in one process the run died in the emulator's accept
(``Errno 24``) at about 10,000 watches. Split, the agents' client holds about 11,000 and the
emulator about 11,000. The bench drives the emulator over a control channel
(``bench/storm_emulator.py``): it stores the pods and the Lease, renews the Lease, reads the
request count and the open watches (each second), and at the end the requests (arrival times on
the one CLOCK_MONOTONIC of both processes) and the pods. ``--in-process`` runs the emulator in the
bench's process and event loop, as before (a few thousand agents at most).

Default fleet: 10,000 sidecar pods (one sidecar agent each) and 1,000 nodes of 2 pods (one
DaemonSet agent each), label mode (``ray.io/serve``, every pod labelled ``true``), the Lease
``serve-health/ray-serve-health-aggregator`` held by ``aggregator-0`` (15 s) and renewed by the
bench every 2 s. The timeline:

1. connected (``--connected`` s): streams up, every probe SERVING. Expected API requests: 0.
2. t_end: every stream ends (``ended()``); ``--failing`` of all pods (chosen at random, fixed
   seed) probe NOT_READY from now on, the others SERVING. The Lease is still renewed for
   ``--renewed-for`` s (an aggregator alive, the agents cut off from it): agents with a failing
   pod read the Lease, and must write nothing.
3. t0 = t_end + ``--renewed-for``: the aggregator dies (the Lease is never renewed again); the
   bench runs ``--duration`` s more.

Requests are counted where an API server counts them, at the emulator, every verb, by arrival
time. Reported: the busiest second, the busiest 60 s (mean), the mean; requests by verb;
writes (PATCH) and Events; when each failing pod was written (first PATCH after t0: first,
median, p95, last) against a model of the budget (each agent's slot phase is known: the Lease
read takes its first slot, its first write the next slot that starts after the Lease has aged
out), and writes to healthy pods (a bug if any). Targets (issue 26): <= 50 requests/s
sustained (60 s mean), <= 200 in any second, zero writes while the Lease is renewed.

The measured agents and the load generator (probe feeding) share the bench's process and its
CPU (with ``--in-process``, the emulator too); the emulator's process has its own (its RSS,
threads, open files and CPU are reported beside the bench's). The generator feeds each round in
``--slices`` slices spread over the interval and times itself: every round that ends later than
its interval is counted and reported; a lag that lasts (a round a whole interval late, or two
late rounds in a row) means the run is not a result, and the output says so. Two costs of
putting thousands of agents into one process, which no real agent pays, are taken out of the
way: the emulator subclass (``StormEmulator``) hands a change only to the watches of its
resource, as the API server's watch cache does (kmock hands it to every open watch: with
thousands of Lease watches, every pod write would wake them all; ``--plain-emulator`` turns that
off); and the garbage collector: one collection would scan all the agents' objects at once and
stop them all (pauses of 0.5-1.5 s at 11,000 agents, and a third of the CPU), so the setup's
objects are frozen (``gc.freeze()``, in both processes) and, with ``--gc off`` (the default),
the collector is off during the run, in both (the collections of test runs with it on freed no
object: the agents make no cyclic garbage; a full collection of the bench's process at the end
reports what was left). ``--gc on`` keeps it.

Run from the repository root (a full run takes ``--connected + --renewed-for + --duration``
seconds, about 16 minutes; pin it to one core to put agents and generator on the same one: the
emulator's process inherits the pinning)::

    taskset -c 0 .venv/bin/python -m bench.fallback_storm --failing 0.01 --out \\
        bench/results/fallback_storm_1pct.json
    .venv/bin/python -m bench.fallback_storm --sidecars 200 --nodes 20 --duration 60

Prints a table and writes bench/results/fallback_storm.json (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import procstat
from bench.storm_emulator import Arrival, ChildEmulator, EmulatorControl, LocalEmulator
from node_agent.fallback.budget import DEFAULT_FLEET_SIZE, PER_SLOT, WINDOW, ApiBudget
from node_agent.fallback.decider import Fallback
from node_agent.fallback.lease_gate import LeaseName
from node_agent.fallback.rules import PodFacts, WhosePods
from node_agent.fallback.runner import FallbackRunner
from node_agent.fallback.writer import FallbackWriter
from node_agent.sink import NoMetrics
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.kube.client import KubeClient
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import ProbeResult
from servehealth_common.states import ServeState
from testsupport import harness
from testsupport.kube.emulator import LEASES, PODS

DEFAULT_OUTPUT = harness.REPO_ROOT / "bench" / "results" / "fallback_storm.json"
NS = "ray"
LABEL = "ray.io/serve"
LEASE = LeaseName("serve-health", "ray-serve-health-aggregator")
HOLDER = "aggregator-0"
#: The writes an aggregator in label mode announces (failure 1, success 2: its defaults).
WRITES = pb.WriteSettings(
    label=True,
    label_key=LABEL,
    failure_threshold=1,
    success_threshold=2,
    fallback=True,
    lease=str(LEASE),
)
SERVING = ProbeResult(ServeState.SERVING, "", 200, 0.001)
NOT_READY = ProbeResult(ServeState.NOT_READY, "HTTP 503", 503, 0.001)
WAITED = "loop_thread_waited_s"
TARGET_SUSTAINED = 50.0  # requests/s, any 60 s
TARGET_PEAK = 200  # requests in any 1 s
SHARED_CPU = (
    "two processes: the emulator in a child process of its own; the measured agents (simulated "
    "agents, their shared client) and the load generator (probe feeding) share the bench's CPU"
)
SHARED_CPU_IN_PROCESS = (
    "one process (--in-process): the measured side (simulated agents, their shared client, the "
    "emulator) and the load generator (probe feeding) share its CPU"
)


def shared_cpu(args: argparse.Namespace) -> str:
    return SHARED_CPU_IN_PROCESS if args.in_process else SHARED_CPU


# -- the emulator (bench/storm_emulator.py) ---------------------------------------------------


def micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def add_lease(emulator: EmulatorControl, duration: int) -> None:
    now = micro_time()
    await emulator.put_object(
        LEASES,
        {
            "metadata": {"namespace": LEASE.namespace, "name": LEASE.name},
            "spec": {
                "holderIdentity": HOLDER,
                "leaseDurationSeconds": duration,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        },
    )


# -- the simulated agents ---------------------------------------------------------------------


class CountingSink(NoMetrics):
    """The agents' metrics: only their fallback writes, counted by (kind, result)."""

    def __init__(self) -> None:
        self.writes: Counter[str] = Counter()

    def fallback_write(self, kind: str, result: str) -> None:
        self.writes[f"{kind} {result}"] += 1


class CountingHandler(logging.Handler):
    """Counts the product's log records by level and message template (nothing printed); keeps
    a few examples of each warning or error."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.levelname} {record.name}: {str(record.msg)[:90]}"
        self.counts[key] += 1
        if record.levelno >= logging.WARNING and len(self.examples.setdefault(key, [])) < 2:
            with contextlib.suppress(Exception):
                text = record.getMessage()
                if record.exc_info:
                    text += " | " + repr(record.exc_info[1])
                self.examples[key].append(text[:400])
        if record.levelno >= logging.ERROR and self.counts[key] <= 3:
            print(
                f"  [log] {record.levelname} {record.name}: {record.getMessage()[:300]}",
                file=sys.stderr,
                flush=True,
            )


@dataclass
class SimAgent:
    kind: str  # "sidecar" or "daemonset"
    name: str
    runner: FallbackRunner
    pods: list[PodKey]
    phase: float  # its budget's slot phase (drawn from its own seeded random source)


@dataclass
class Fleet:
    agents: list[SimAgent]
    pods: list[PodKey]
    failing: set[PodKey]
    owner: dict[PodKey, SimAgent]
    fleet_size: int
    period: float


def agent_seed(seed: int, number: int) -> int:
    return seed * 1_000_003 + number


@dataclass
class StoredPods:
    sidecar: list[PodKey]  # one sidecar agent each
    by_node: dict[str, list[PodKey]]  # one DaemonSet agent per node
    stored: dict[PodKey, dict[str, Any]]  # as the emulator stored them (uid, resourceVersion)

    @property
    def all(self) -> list[PodKey]:
        return [*self.sidecar, *(key for keys in self.by_node.values() for key in keys)]


async def store_pods(args: argparse.Namespace, emulator: EmulatorControl) -> StoredPods:
    """The fleet's pods in the emulator's store, every one labelled ``true``."""
    sidecar_pods = [PodKey(NS, f"sidecar-{i:05d}") for i in range(args.sidecars)]
    node_names = [f"node-{j:04d}" for j in range(args.nodes)]
    node_pods = {
        node: [PodKey(NS, f"{node}-ray-{k}") for k in range(args.pods_per_node)]
        for node in node_names
    }
    labels = {"ray.io/cluster": "storm", "ray.io/node-type": "worker", LABEL: "true"}
    specs = [
        (key.name, f"sidecar-node-{number // 10:04d}") for number, key in enumerate(sidecar_pods)
    ]
    specs += [(key.name, node) for node, keys in node_pods.items() for key in keys]
    stored = await emulator.add_pods(NS, labels, specs)
    by_key = {PodKey(NS, pod["metadata"]["name"]): pod for pod in stored}
    return StoredPods(sidecar_pods, node_pods, by_key)


def make_agent(
    args: argparse.Namespace,
    number: int,
    kind: str,
    name: str,
    own: WhosePods,
    keys: list[PodKey],
    pod: PodKey | None,
    client: KubeClient,
    sink: CountingSink,
) -> SimAgent:
    """One agent's fallback objects (the product's), seeded by its number."""
    budget_seed = agent_seed(args.seed, number)
    core = Fallback(
        after=args.fallback_after,
        own=own,
        flag_rules=None,
        clock=time.monotonic,
        lease=LEASE,
        budget=ApiBudget(
            fleet_budget=args.budget,
            fleet_size=DEFAULT_FLEET_SIZE,  # as an agent starts; the aggregator announces
            clock=time.monotonic,
            rng=random.Random(budget_seed),
        ),
    )
    who = f"{name} ({kind}, simulated)"
    rng = random.Random(budget_seed + 500_000_000)

    async def open_writer(core: Fallback) -> FallbackWriter:
        return FallbackWriter(client, core, who=who, metrics=sink, rng=rng)

    runner = FallbackRunner(core, open_writer, metrics=sink, own_pod=pod)
    phase = random.Random(budget_seed).random()  # ApiBudget's first draw: its phase
    return SimAgent(kind, name, runner, keys, phase)


def tell_connected(agent: SimAgent, stored: dict[PodKey, dict[str, Any]], fleet_size: int) -> None:
    """What a connected agent hears from its aggregator."""
    runner = agent.runner
    runner.settings(WRITES)
    runner.fleet(fleet_size)
    runner.accepted()
    for key in agent.pods:
        pod = stored[key]
        if agent.kind == "sidecar":
            metadata = pod["metadata"]
            runner.pod_view(
                pb.PodView(
                    pod=pb.PodRef(namespace=NS, name=key.name, uid=metadata["uid"]),
                    resource_version=metadata["resourceVersion"],
                    node_name=pod["spec"]["nodeName"],
                    label=metadata["labels"][LABEL],
                )
            )
        else:  # its own watch of the node's pods would tell it
            runner.pod_seen(PodFacts.from_pod(pod))


def build_fleet(
    args: argparse.Namespace,
    stored: StoredPods,
    client: KubeClient,
    sink: CountingSink,
) -> Fleet:
    """One set of the product's fallback objects per agent, told what a connected agent hears
    from its aggregator."""
    pods = stored.all
    agents_count = len(stored.sidecar) + len(stored.by_node)
    fleet_size = max(len(pods), agents_count)  # as the aggregator announces it
    chosen = random.Random(args.seed).sample(pods, round(args.failing * len(pods)))
    agents: list[SimAgent] = []
    for key in stored.sidecar:
        own = WhosePods(pod=key, uid=stored.stored[key]["metadata"]["uid"])
        agents.append(
            make_agent(args, len(agents), "sidecar", key.name, own, [key], key, client, sink)
        )
    for node, keys in stored.by_node.items():
        own = WhosePods(node_name=node)
        agents.append(
            make_agent(args, len(agents), "daemonset", node, own, keys, None, client, sink)
        )
    owner: dict[PodKey, SimAgent] = {}
    for agent in agents:
        tell_connected(agent, stored.stored, fleet_size)
        for key in agent.pods:
            owner[key] = agent
    period = PER_SLOT * fleet_size / args.budget
    return Fleet(agents, pods, set(chosen), owner, fleet_size, period)


# -- the load generator -----------------------------------------------------------------------


@dataclass
class Generator:
    """Feeds every agent a probe result of each of its pods every ``interval``, in ``slices``
    slices spread over it (each pod at a fixed phase, as agents probe at their own), and times
    itself."""

    fleet: Fleet
    interval: float
    slices: int
    seed: int
    storm: bool = False  # failing pods probe NOT_READY
    rounds: int = 0
    rounds_late: int = 0  # rounds that ended after their interval
    late_in_a_row: int = 0  # the longest run of consecutive late rounds
    round_feed: list[float] = field(default_factory=list)  # CPU-ish time feeding each round
    round_over: list[float] = field(default_factory=list)  # end - (scheduled start + interval)
    slice_lag: list[float] = field(default_factory=list)  # slice start - its schedule
    observes: int = 0

    def __post_init__(self) -> None:
        pairs = [(agent.runner.observe, key) for agent in self.fleet.agents for key in agent.pods]
        random.Random(self.seed + 1).shuffle(pairs)
        size = math.ceil(len(pairs) / self.slices) or 1
        chunks = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        failing = self.fleet.failing
        self._calm = [[(observe, key, SERVING) for observe, key in chunk] for chunk in chunks]
        self._storm = [
            [(observe, key, NOT_READY if key in failing else SERVING) for observe, key in chunk]
            for chunk in chunks
        ]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        step = self.interval / max(1, len(self._calm))
        base = loop.time()
        number = streak = 0
        while True:
            start = base + number * self.interval
            feed = 0.0
            plan = self._storm if self.storm else self._calm
            for index, chunk in enumerate(plan):
                target = start + index * step
                delay = target - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                begun = loop.time()
                self.slice_lag.append(begun - target)
                for observe, key, result in chunk:
                    observe(key, result)
                feed += loop.time() - begun
                self.observes += len(chunk)
            over = loop.time() - (start + self.interval)
            self.rounds += 1
            self.round_feed.append(feed)
            self.round_over.append(over)
            streak = streak + 1 if over > 0 else 0
            self.late_in_a_row = max(self.late_in_a_row, streak)
            if over > 0:
                self.rounds_late += 1
                if self.rounds_late <= 5 or self.rounds_late % 60 == 0:
                    print(
                        f"  GENERATOR BEHIND: round {number} ended {over:.2f}s after its "
                        f"interval (feeding took {feed:.3f}s; {self.rounds_late} late so far)",
                        flush=True,
                    )
            number += 1

    def sustained_ok(self) -> bool:
        """No lag that lasts: no round ended a whole interval late, none two in a row."""
        return max(self.round_over, default=0.0) < self.interval and self.late_in_a_row <= 1

    def summary(self) -> dict[str, Any]:
        lags = sorted(self.slice_lag) or [0.0]
        feeds = sorted(self.round_feed) or [0.0]
        return {
            "rounds": self.rounds,
            "observes": self.observes,
            "slices_per_round": len(self._calm),
            "rounds_late": self.rounds_late,
            "late_rounds_in_a_row_max": self.late_in_a_row,
            "kept_up": self.rounds_late == 0,
            "no_sustained_lag": self.sustained_ok(),
            "round_feed_s": {
                "median": round(statistics.median(feeds), 4),
                "p99": round(quantile(feeds, 0.99), 4),
                "max": round(feeds[-1], 4),
            },
            "round_end_vs_interval_s_max": round(max(self.round_over, default=0.0), 3),
            "slice_start_lag_s": {
                "median": round(statistics.median(lags), 4),
                "p99": round(quantile(lags, 0.99), 4),
                "max": round(lags[-1], 4),
            },
        }


def quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- resources --------------------------------------------------------------------------------


class GcPauses:
    """How long the interpreter's garbage collections stop everything (``gc.callbacks``): a
    process holding thousands of agents' objects pays pauses that one agent never does."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.collected: dict[int, int] = {0: 0, 1: 0, 2: 0}  # unreachable objects freed
        self.final_freed: int | None = None  # by a full collection when the run ended
        self.final_s: float | None = None
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._began)
            self.collected[info["generation"]] += info["collected"]

    def summary(self) -> dict[str, Any]:
        return {
            "freed_by_a_full_collection_at_the_end": self.final_freed,
            "that_collection_s": None if self.final_s is None else round(self.final_s, 3),
            **self._during(),
        }

    def _during(self) -> dict[str, Any]:
        return {
            f"gen{generation}": {
                "count": len(pauses),
                "max_s": round(max(pauses, default=0.0), 4),
                "total_s": round(sum(pauses), 2),
                "objects_freed": self.collected[generation],
            }
            for generation, pauses in self.pauses.items()
        }


def run_queue_wait_s(tid: int) -> float:
    """How long thread ``tid`` of this process has waited for a CPU while runnable (its
    schedstat): time the machine's other work took from it."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as schedstat:
            return int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


@dataclass
class ProcessMax:
    """The largest RSS, threads and open files seen of one process."""

    rss: int = 0
    threads: int = 0
    fds: int = 0

    def sample(self, pid: int, *, fds: bool, prefix: str = "") -> dict[str, Any]:
        rss, threads = procstat.rss_bytes(pid), threads_of(pid)
        self.rss, self.threads = max(self.rss, rss), max(self.threads, threads)
        sample: dict[str, Any] = {
            f"{prefix}rss_mib": round(rss / 2**20, 1),
            f"{prefix}threads": threads,
            f"{prefix}cpu_s": round(procstat.cpu_seconds(pid), 2),
        }
        if fds:
            count = procstat.open_fds(pid)
            self.fds = max(self.fds, count)
            sample[f"{prefix}fds"] = count
        return sample


@dataclass
class Sampler:
    """RSS, threads, open files, CPU (the bench's process and the emulator's, when it has its
    own), open watches and the shared client's queue, sampled as the run goes."""

    client: KubeClient
    emulator: EmulatorControl
    bench: ProcessMax = field(default_factory=ProcessMax)
    child: ProcessMax = field(default_factory=ProcessMax)  # the emulator's process
    queue_max: int = 0  # calls waiting for one of the client's threads
    watches_max: int = 0
    requests: int = 0  # the latest count
    watches: int = 0
    series: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rss_max(self) -> int:
        return self.bench.rss

    @property
    def threads_max(self) -> int:
        return self.bench.threads

    @property
    def fds_max(self) -> int:
        return self.bench.fds

    async def run(self) -> None:
        queue = self.client._executor._work_queue  # read only: is the client the bottleneck?
        tid = threading.get_native_id()  # the event loop's thread: agents, generator (emulator)
        tick = 0
        while True:
            self.queue_max = max(self.queue_max, queue.qsize())
            if tick % 10 == 0:
                self.series.append(await self.sample(tid, fds=tick % 50 == 0))
            tick += 1
            await asyncio.sleep(0.1)

    async def sample(self, tid: int, *, fds: bool) -> dict[str, Any]:
        sample: dict[str, Any] = {
            "t": round(asyncio.get_running_loop().time(), 1),
            **self.bench.sample(os.getpid(), fds=fds),
            "loop_thread_waited_s": round(run_queue_wait_s(tid), 3),
        }
        if self.emulator.pid is not None:
            sample.update(self.child.sample(self.emulator.pid, fds=fds, prefix="emulator_"))
        self.requests, self.watches = await self.emulator.counters()
        self.watches_max = max(self.watches_max, self.watches)
        sample["requests"], sample["watches"] = self.requests, self.watches
        sample["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return sample


def cpu_share(
    series: list[dict[str, Any]], start: float, end: float, what: str = "cpu_s"
) -> float | None:
    """The growth of ``what`` between ``start`` and ``end`` (loop time) per second: the
    process's CPU use as a share of a core, or the share of the time its loop thread waited for
    a CPU that other work held."""
    inside = [s for s in series if start <= s["t"] <= end]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    return round((inside[-1][what] - inside[0][what]) / (inside[-1]["t"] - inside[0]["t"]), 3)


def worst_wait(series: list[dict[str, Any]], width: float = 10.0) -> float | None:
    """The largest share of any ``width`` seconds the loop thread waited for a CPU."""
    best = None
    for index, sample in enumerate(series):
        later = next((s for s in series[index:] if s["t"] >= sample["t"] + width), None)
        if later is None:
            break
        share = (later["loop_thread_waited_s"] - sample["loop_thread_waited_s"]) / (
            later["t"] - sample["t"]
        )
        best = share if best is None else max(best, share)
    return None if best is None else round(best, 3)


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Timeline:
    started: float = 0.0  # the connected phase began
    t_end: float | None = None  # every stream ended
    t0: float | None = None  # the Lease's last renewal: the aggregator died
    stop: float | None = None
    last_renewal: float | None = None


async def renew_lease(
    emulator: EmulatorControl, every: float, timeline: Timeline, stop: asyncio.Event
) -> None:
    """The aggregator renewing its Lease (in the store, not through the API: not counted) until
    ``stop`` (a renewal under way is finished first)."""
    while not stop.is_set():
        await emulator.patch_object(
            LEASES, LEASE.namespace, LEASE.name, {"spec": {"renewTime": micro_time()}}
        )
        timeline.last_renewal = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def progress(
    emulator: EmulatorControl,
    timeline: Timeline,
    gen: Generator,
    sampler: Sampler,
    every: float,
) -> None:
    last = 0
    while True:
        await asyncio.sleep(every)
        now = time.monotonic()
        count, watches = await emulator.counters()
        if timeline.t0 is not None:
            where = f"t0+{now - timeline.t0:6.0f}s"
        elif timeline.t_end is not None:
            where = f"t_end+{now - timeline.t_end:4.0f}s (Lease renewed)"
        else:
            where = f"connected {now - timeline.started:4.0f}s"
        lag = max(gen.slice_lag[-200:], default=0.0)
        child = (
            ""
            if emulator.pid is None
            else f"; emulator rss {sampler.child.rss / 2**20:.0f} MiB, fds {sampler.child.fds} max"
        )
        print(
            f"  {where}: {count} requests ({(count - last) / every:.1f}/s lately), "
            f"watches {watches}, rss {sampler.rss_max / 2**20:.0f} MiB max, "
            f"threads {sampler.threads_max} max, fds {sampler.fds_max} max{child}, generator "
            f"late rounds {gen.rounds_late}, slice lag max {lag:.3f}s",
            flush=True,
        )
        last = count


@dataclass
class Setup:
    fleet: Fleet
    runner_tasks: list[asyncio.Task[Any]]
    memory: dict[str, Any]


async def set_up(
    args: argparse.Namespace,
    emulator: EmulatorControl,
    client: KubeClient,
    sink: CountingSink,
    gc_pauses: GcPauses,
) -> Setup:
    """The pods in the store, the agents running (connected), the collector out of the way."""
    pid = os.getpid()
    built = time.monotonic()
    stored = await store_pods(args, emulator)
    rss_before_agents = procstat.rss_bytes(pid)
    fleet = build_fleet(args, stored, client, sink)
    runner_tasks = [
        asyncio.create_task(agent.runner.run(), name=f"fallback {agent.name}")
        for agent in fleet.agents
    ]
    await asyncio.sleep(0.5)
    # The setup's objects (store, agents) out of the collector's way; and with --gc off (the
    # default) no collections at all during the run (see GC in the module doc), in either process.
    await emulator.settle_gc(disable=args.gc == "off")
    gc.collect()
    gc.freeze()
    if args.gc == "off":
        gc.disable()
    gc.callbacks.append(gc_pauses)
    rss_agents = procstat.rss_bytes(pid)
    setup_s = time.monotonic() - built
    failing_agents = {id(fleet.owner[key]) for key in fleet.failing}
    print(
        f"fleet: {args.sidecars} sidecars + {args.nodes} DaemonSet agents "
        f"({len(fleet.pods)} pods, fleet size {fleet.fleet_size}); failing "
        f"{len(fleet.failing)} pods on {len(failing_agents)} agents; budget "
        f"{args.budget:g}/s: a slot of {PER_SLOT} requests every {fleet.period:.1f}s per "
        f"agent; built in {setup_s:.1f}s, RSS {rss_agents / 2**20:.0f} MiB",
        flush=True,
    )
    where = "in this process" if emulator.pid is None else f"in process {emulator.pid}"
    print(
        f"  ({shared_cpu(args)}; emulator {where} at {emulator.url}; "
        f"CPUs allowed: {sorted(os.sched_getaffinity(0))})",
        flush=True,
    )
    memory = {
        "rss_before_agents_mib": round(rss_before_agents / 2**20, 1),
        "rss_with_agents_mib": round(rss_agents / 2**20, 1),
        "rss_per_agent_kib": round((rss_agents - rss_before_agents) / len(fleet.agents) / 1024, 1),
        "setup_s": round(setup_s, 1),
    }
    return Setup(fleet, runner_tasks, memory)


async def play(
    args: argparse.Namespace,
    emulator: EmulatorControl,
    fleet: Fleet,
    gen: Generator,
    timeline: Timeline,
    stop_renewing: asyncio.Event,
    renewer: asyncio.Task[Any],
) -> int:
    """The timeline: connected, every stream ended (the Lease still renewed), t0 (the
    aggregator dead) and ``--duration`` more. Returns the requests before it began."""
    timeline.started = time.monotonic()
    mark_connected, _ = await emulator.counters()
    print(f"connected for {args.connected:g}s ...", flush=True)
    await asyncio.sleep(args.connected)

    timeline.t_end = time.monotonic()
    for agent in fleet.agents:
        agent.runner.ended()
    gen.storm = True
    print(
        f"t_end: every stream ended, {len(fleet.failing)} pods NOT_READY from now on; "
        f"the Lease is renewed {args.renewed_for:g}s more",
        flush=True,
    )
    await asyncio.sleep(args.renewed_for)

    stop_renewing.set()
    await renewer
    timeline.t0 = time.monotonic()
    print(
        f"t0: the aggregator is dead (Lease last renewed "
        f"{timeline.t0 - (timeline.last_renewal or timeline.t0):.1f}s ago); "
        f"running {args.duration:g}s",
        flush=True,
    )
    await asyncio.sleep(args.duration)
    timeline.stop = time.monotonic()
    return mark_connected


async def run_against(
    args: argparse.Namespace, emulator: EmulatorControl, client: KubeClient
) -> dict[str, Any]:
    timeline, sink, gc_pauses = Timeline(), CountingSink(), GcPauses()
    stop_renewing = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    try:
        await add_lease(emulator, args.lease_duration)
        renewer = asyncio.create_task(
            renew_lease(emulator, args.renew_every, timeline, stop_renewing), name="renewer"
        )
        tasks.append(renewer)
        setup = await set_up(args, emulator, client, sink, gc_pauses)
        tasks += setup.runner_tasks
        gen = Generator(setup.fleet, args.probe_interval, args.slices, args.seed)
        sampler = Sampler(client, emulator)
        tasks.append(asyncio.create_task(gen.run(), name="generator"))
        tasks.append(asyncio.create_task(sampler.run(), name="sampler"))
        watching = progress(emulator, timeline, gen, sampler, args.progress_every)
        tasks.append(asyncio.create_task(watching, name="progress"))
        mark = await play(args, emulator, setup.fleet, gen, timeline, stop_renewing, renewer)
        print("stopping ...", flush=True)
        gc.callbacks.remove(gc_pauses)  # (the collections during the run only)
        began = time.perf_counter()
        gc_pauses.final_freed = gc.collect()  # the cyclic garbage the run left, if any
        gc_pauses.final_s = time.perf_counter() - began
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(gc_pauses)
        gc.enable()
    began = time.monotonic()
    calls = await emulator.requests()
    final_labels = {
        PodKey(NS, pod["metadata"]["name"]): (pod["metadata"].get("labels") or {}).get(LABEL)
        for pod in await emulator.list_objects(PODS, NS)
    }
    print(
        f"  agents stopped in {began - (timeline.stop or began):.1f}s; {len(calls)} requests "
        f"and {len(final_labels)} pods read from the emulator in {time.monotonic() - began:.1f}s",
        flush=True,
    )
    return analyse(
        args,
        setup.fleet,
        timeline,
        calls[mark:],
        calls[:mark],
        final_labels,
        gen,
        sampler,
        sink,
        gc_pauses.summary(),
        memory=setup.memory,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    procstat.raise_fd_limit()  # (the emulator's process inherits it, and raises its own)
    rss_start = procstat.rss_bytes(os.getpid())
    where = LocalEmulator if args.in_process else ChildEmulator
    async with where(only_own_resource=not args.plain_emulator) as emulator:
        client = KubeClient(
            emulator.client_configuration(),
            timeout=10.0,
            concurrency=args.concurrency,
            user_agent="fallback-storm-bench",
        )
        try:
            result = await run_against(args, emulator, client)
        finally:
            client.close()
            closing = time.monotonic()
    print(f"  emulator closed in {time.monotonic() - closing:.1f}s", flush=True)
    result["resources"] = {"rss_start_mib": round(rss_start / 2**20, 1), **result["resources"]}
    return result


# -- the analysis -----------------------------------------------------------------------------


def slot_start_after(phase: float, period: float, now: float) -> float:
    """When a request reserved at ``now`` may go, with a fresh slot (ApiBudget.reserve)."""
    offset = phase * period
    slot = math.floor((now - offset) / period)
    if now >= offset + slot * period + min(WINDOW, period):
        slot += 1
    return max(now, offset + slot * period)


def predicted_write(agent: SimAgent, fleet: Fleet, args: argparse.Namespace, tl: Timeline) -> float:
    """When the budget lets ``agent`` write first (the model): its Lease read (a get and a
    watch: one slot) at its first slot from t_end + --fallback-after; the Lease counts as
    renewed until ``--lease-duration`` after the last renewal seen (or after the read, if it
    came after the last renewal); the write in the next slot from then."""
    assert tl.t_end is not None
    assert tl.t0 is not None
    read = slot_start_after(agent.phase, fleet.period, tl.t_end + args.fallback_after)
    last = tl.last_renewal if tl.last_renewal is not None else tl.t0
    opens = max(read, last) + args.lease_duration
    write = slot_start_after(agent.phase, fleet.period, opens)
    if write <= read + min(WINDOW, fleet.period) and fleet.period > WINDOW:  # slot k is full
        write = slot_start_after(agent.phase, fleet.period, read + fleet.period)
    return write


def per_second(times: Sequence[float], start: float, end: float) -> list[int]:
    buckets = [0] * max(0, math.ceil(end - start))
    for at in times:
        index = math.floor(at - start)
        if 0 <= index < len(buckets):
            buckets[index] += 1
    return buckets


def max_window_mean(buckets: Sequence[int], width: int) -> float:
    if not buckets:
        return 0.0
    width = min(width, len(buckets))
    total = best = sum(buckets[:width])
    for index in range(width, len(buckets)):
        total += buckets[index] - buckets[index - width]
        best = max(best, total)
    return best / width


def by_verb(calls: Sequence[Arrival]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for call in calls:
        what = call.resource or "?"
        if call.subresource:
            what += f"/{call.subresource}"
        counts[f"{call.verb} {what}"] += 1
    return dict(sorted(counts.items()))


def peak_count(calls: Sequence[Arrival], window: float = 1.0) -> int:
    """The largest number of ``calls`` that arrived within any ``window`` seconds (as
    testsupport.kube.emulator.peak_count counts ApiCalls)."""
    times = sorted(call.at for call in calls)
    best = start = 0
    for end, at in enumerate(times):
        while at - times[start] >= window:
            start += 1
        best = max(best, end - start + 1)
    return best


def stats(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"first": None, "median": None, "p95": None, "last": None}
    return {
        "first": round(ordered[0], 1),
        "median": round(statistics.median(ordered), 1),
        "p95": round(quantile(ordered, 0.95), 1),
        "last": round(ordered[-1], 1),
    }


def analyse(
    args: argparse.Namespace,
    fleet: Fleet,
    tl: Timeline,
    calls: list[Arrival],
    before: list[Arrival],
    final_labels: dict[PodKey, str | None],
    gen: Generator,
    sampler: Sampler,
    sink: CountingSink,
    gc_pauses: dict[str, Any],
    memory: dict[str, Any],
) -> dict[str, Any]:
    assert tl.t_end is not None
    assert tl.t0 is not None
    assert tl.stop is not None
    connected = [c for c in calls if c.at < tl.t_end]
    renewed = [c for c in calls if tl.t_end <= c.at < tl.t0]
    storm = [c for c in calls if tl.t0 <= c.at < tl.stop]
    buckets = per_second([c.at for c in storm], tl.t0, tl.stop)
    before_buckets = per_second([c.at for c in calls if c.at < tl.t0], tl.started, tl.t0)
    patches = [c for c in calls if c.method == "PATCH" and c.resource == "pods"]
    events = [c for c in calls if c.method == "POST" and c.resource == "events"]

    first_event: dict[PodKey, float] = {}
    for call in events:
        involved = (call.body or {}).get("involvedObject") or {}
        first_event.setdefault(
            PodKey(involved.get("namespace", ""), involved.get("name", "")), call.at
        )
    first_patch: dict[PodKey, float] = {}
    patch_count: Counter[PodKey] = Counter()
    for call in patches:
        key = PodKey(call.namespace or "", call.name or "")
        patch_count[key] += 1
        first_patch.setdefault(key, call.at)
    failing = fleet.failing
    written = [key for key in failing if final_labels.get(key) == "false"]
    healthy_patched = sorted(str(key) for key in patch_count if key not in failing)
    healthy_changed = sorted(
        str(key) for key in fleet.pods if key not in failing and final_labels.get(key) != "true"
    )
    failing_patched_unwritten = sorted(
        str(key) for key in failing if key in patch_count and final_labels.get(key) != "false"
    )
    since_t0 = [first_patch[key] - tl.t0 for key in written if key in first_patch]
    since_end = [first_patch[key] - tl.t_end for key in written if key in first_patch]
    predicted = {key: predicted_write(fleet.owner[key], fleet, args, tl) for key in failing}
    expected_by_end = sum(1 for at in predicted.values() if at <= tl.stop)
    errors = [first_patch[key] - predicted[key] for key in written if key in first_patch]
    duration = tl.stop - tl.t0

    peak_1s = peak_count(storm, window=1.0)
    sustained = max_window_mean(buckets, 60)
    mean = len(storm) / duration if duration > 0 else 0.0
    renewed_writes = sum(1 for c in renewed if c.method in ("PATCH", "POST", "PUT", "DELETE"))
    verdicts = {
        "peak_1s_le_200": peak_1s <= TARGET_PEAK,
        "sustained_60s_le_50": sustained <= TARGET_SUSTAINED,
        "zero_requests_while_connected": not connected and not before,
        "zero_writes_while_lease_renewed": renewed_writes == 0,
        "zero_writes_to_healthy_pods": not healthy_patched and not healthy_changed,
        "generator_kept_up": gen.rounds_late == 0,
        "generator_no_sustained_lag": gen.sustained_ok(),
    }
    failing_agents = {id(fleet.owner[key]) for key in failing}
    return {
        "fleet": {
            "sidecars": args.sidecars,
            "nodes": args.nodes,
            "pods_per_node": args.pods_per_node,
            "pods": len(fleet.pods),
            "agents": len(fleet.agents),
            "fleet_size_announced": fleet.fleet_size,
            "budget_per_s": args.budget,
            "slot_period_s": round(fleet.period, 2),
            "failing_share": args.failing,
            "failing_pods": len(failing),
            "failing_agents": len(failing_agents),
        },
        "timeline_s": {
            "connected": round(tl.t_end - tl.started, 1),
            "renewed_after_streams_ended": round(tl.t0 - tl.t_end, 1),
            "after_t0": round(duration, 1),
            "last_renewal_before_t0": round(tl.t0 - (tl.last_renewal or tl.t0), 2),
        },
        "connected": {"requests": len(connected) + len(before), "by_verb": by_verb(connected)},
        "lease_renewed": {
            "requests": len(renewed),
            "by_verb": by_verb(renewed),
            "writes_and_events": renewed_writes,
        },
        "after_t0": {
            "requests": len(storm),
            "max_in_any_1s": peak_1s,
            "max_in_a_calendar_second": max(buckets, default=0),
            "max_60s_mean_per_s": round(sustained, 2),
            "mean_per_s": round(mean, 2),
            "by_verb": by_verb(storm),
            "pod_patches": sum(1 for c in storm if c.method == "PATCH" and c.resource == "pods"),
            "events_created": sum(
                1 for c in storm if c.method == "POST" and c.resource == "events"
            ),
            "per_second": buckets,
        },
        "before_t0_per_second": before_buckets,
        "writes": {
            "pod_patches_total": len(patches),
            "events_total": len(events),
            "failing_pods": len(failing),
            "failing_pods_written": len(written),
            "expected_written_by_end_model": expected_by_end,
            "patches_per_written_pod_max": max((patch_count[k] for k in written), default=0),
            "first_write_after_t0_s": stats(since_t0),
            "first_write_after_streams_ended_s": stats(since_end),
            "actual_minus_model_s": stats(errors),
            "event_after_its_write_s": stats(
                [first_event[k] - first_patch[k] for k in written if k in first_event]
            ),
            "written_pods_with_event": sum(1 for k in written if k in first_event),
            "healthy_pods_patched": healthy_patched[:20],
            "healthy_pods_patched_count": len(healthy_patched),
            "healthy_pods_not_true_at_end": healthy_changed[:20],
            "healthy_pods_not_true_count": len(healthy_changed),
            "failing_pods_patched_but_not_false": failing_patched_unwritten[:20],
        },
        "agent_write_results": dict(sorted(sink.writes.items())),
        "generator": gen.summary(),
        "gc_pauses": gc_pauses,
        "client": {
            "concurrency": args.concurrency,
            "max_calls_queued_for_a_thread": sampler.queue_max,
        },
        "resources": resources(sampler, tl, memory),
        "verdicts": verdicts,
    }


def resources(sampler: Sampler, tl: Timeline, memory: dict[str, Any]) -> dict[str, Any]:
    """The bench's process (the emulator's too with --in-process), then the emulator's own."""
    assert tl.t_end is not None
    assert tl.t0 is not None
    assert tl.stop is not None
    return {
        **memory,
        "rss_max_mib": round(sampler.rss_max / 2**20, 1),
        "threads_max": sampler.threads_max,
        "open_files_max": sampler.fds_max,
        "open_watches_max": sampler.watches_max,
        "cpu_share_connected": cpu_share(sampler.series, tl.started, tl.t_end),
        "cpu_share_lease_renewed": cpu_share(sampler.series, tl.t_end, tl.t0),
        "cpu_share_after_t0": cpu_share(sampler.series, tl.t0, tl.stop),
        "loop_thread_waiting_for_a_cpu_share": {
            "connected": cpu_share(sampler.series, tl.started, tl.t_end, WAITED),
            "lease_renewed": cpu_share(sampler.series, tl.t_end, tl.t0, WAITED),
            "after_t0": cpu_share(sampler.series, tl.t0, tl.stop, WAITED),
            "worst_10s": worst_wait(sampler.series),
        },
        "machine_loadavg_1m_max": max((s["loadavg_1m"] for s in sampler.series), default=None),
        "emulator_process": emulator_process(sampler, tl.started, tl.t_end, tl.t0, tl.stop),
        "samples": sampler.series[::10],
    }


def emulator_process(
    sampler: Sampler, started: float, t_end: float, t0: float, stop: float
) -> dict[str, Any] | None:
    """The emulator's own process, when it has one (None: --in-process, counted above)."""
    if sampler.emulator.pid is None:
        return None
    series, what = sampler.series, "emulator_cpu_s"
    return {
        "rss_max_mib": round(sampler.child.rss / 2**20, 1),
        "threads_max": sampler.child.threads,
        "open_files_max": sampler.child.fds,
        "cpu_share_connected": cpu_share(series, started, t_end, what),
        "cpu_share_lease_renewed": cpu_share(series, t_end, t0, what),
        "cpu_share_after_t0": cpu_share(series, t0, stop, what),
    }


# -- the report -------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    fleet, after, writes = result["fleet"], result["after_t0"], result["writes"]
    gen, res = result["generator"], result["resources"]
    t0w, model = writes["first_write_after_t0_s"], writes["actual_minus_model_s"]

    def fmt(figures: dict[str, Any]) -> str:
        return " / ".join("-" if v is None else f"{v:g}" for v in figures.values())

    return [
        (
            "fleet",
            "-",
            f"{fleet['agents']} agents, {fleet['pods']} pods, "
            f"{fleet['failing_pods']} failing on {fleet['failing_agents']} agents",
        ),
        ("slot period (2 x fleet size / budget)", "-", f"{fleet['slot_period_s']:g} s"),
        ("requests while connected", "0", str(result["connected"]["requests"])),
        (
            "requests while the Lease is renewed",
            "Lease reads only",
            f"{result['lease_renewed']['requests']} {result['lease_renewed']['by_verb']}",
        ),
        ("  writes + Events then", "0", str(result["lease_renewed"]["writes_and_events"])),
        ("requests after t0", "-", str(after["requests"])),
        ("  max in any 1 s", f"<= {TARGET_PEAK}", str(after["max_in_any_1s"])),
        ("  max 60 s mean (/s)", f"<= {TARGET_SUSTAINED:g}", f"{after['max_60s_mean_per_s']:g}"),
        ("  mean over the run (/s)", "-", f"{after['mean_per_s']:g}"),
        ("  by verb", "-", json.dumps(after["by_verb"])),
        (
            "pod PATCHes / Events (all run)",
            "-",
            f"{writes['pod_patches_total']} / {writes['events_total']}",
        ),
        (
            "failing pods written by the end",
            f"{writes['expected_written_by_end_model']} (model) of {writes['failing_pods']}",
            str(writes["failing_pods_written"]),
        ),
        ("  first write after t0: first/median/p95/last s", "-", fmt(t0w)),
        ("  actual - model: first/median/p95/last s", "~0", fmt(model)),
        (
            "  Event after its write: first/median/p95/last s",
            "-",
            f"{fmt(writes['event_after_its_write_s'])} ({writes['written_pods_with_event']} pods)",
        ),
        (
            "healthy pods written",
            "0",
            f"{writes['healthy_pods_patched_count']} patched, "
            f"{writes['healthy_pods_not_true_count']} not 'true'",
        ),
        ("generator rounds late / rounds", "0", f"{gen['rounds_late']} / {gen['rounds']}"),
        (
            "  late rounds in a row (max) / latest end s",
            "<= 1 / < interval",
            f"{gen['late_rounds_in_a_row_max']} / {gen['round_end_vs_interval_s_max']:g}",
        ),
        ("  round feed s: median/p99/max", "< interval", fmt(gen["round_feed_s"])),
        ("  slice start lag s: median/p99/max", "-", fmt(gen["slice_start_lag_s"])),
        (
            "GC: collections during the run / freed at the end",
            "-",
            f"{sum(result['gc_pauses'][g]['count'] for g in ('gen0', 'gen1', 'gen2'))} / "
            f"{result['gc_pauses']['freed_by_a_full_collection_at_the_end']} objects",
        ),
        (
            "loop thread waiting for a CPU held by others: after t0 / worst 10 s",
            "-",
            f"{res['loop_thread_waiting_for_a_cpu_share']['after_t0']} / "
            f"{res['loop_thread_waiting_for_a_cpu_share']['worst_10s']} "
            f"(load average max {res['machine_loadavg_1m_max']})",
        ),
        (
            "client: calls queued for a thread (max)",
            "0",
            str(result["client"]["max_calls_queued_for_a_thread"]),
        ),
        (
            "RSS max / per agent",
            "-",
            f"{res['rss_max_mib']:g} MiB / {res['rss_per_agent_kib']:g} KiB",
        ),
        (
            "threads / open files / watches (max)",
            "-",
            f"{res['threads_max']} / {res['open_files_max']} / {res['open_watches_max']}",
        ),
        (
            "CPU (share of a core): connected / renewed / after t0",
            "-",
            f"{res['cpu_share_connected']} / {res['cpu_share_lease_renewed']} / "
            f"{res['cpu_share_after_t0']}",
        ),
        *emulator_rows(res["emulator_process"]),
    ]


def emulator_rows(child: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The emulator's own process (the rows above are the bench's), when it has one."""
    if child is None:
        return []
    return [
        (
            "emulator process: RSS / threads / open files (max)",
            "-",
            f"{child['rss_max_mib']:g} MiB / {child['threads_max']} / {child['open_files_max']}",
        ),
        (
            "  its CPU (share of a core): connected / renewed / after t0",
            "-",
            f"{child['cpu_share_connected']} / {child['cpu_share_lease_renewed']} / "
            f"{child['cpu_share_after_t0']}",
        ),
    ]


def print_table(rows: list[tuple[str, str, str]]) -> None:
    cells = [("measure", "target", "measured"), *rows]
    widths = [max(len(line[column]) for line in cells) for column in range(2)]
    for line in cells:
        print(f"{line[0].ljust(widths[0])}  {line[1].ljust(widths[1])}  {line[2]}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sidecars", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000, help="one DaemonSet agent each")
    parser.add_argument("--pods-per-node", type=int, default=2)
    parser.add_argument("--failing", type=float, default=0.01, help="share of all pods")
    parser.add_argument("--budget", type=float, default=40.0, help="--fallback-api-budget")
    parser.add_argument("--duration", type=float, default=900.0, help="seconds after t0")
    parser.add_argument("--connected", type=float, default=10.0, help="seconds before t_end")
    parser.add_argument(
        "--renewed-for",
        type=float,
        default=30.0,
        help="seconds the Lease is still renewed after the streams end",
    )
    parser.add_argument("--probe-interval", type=float, default=1.0)
    parser.add_argument("--slices", type=int, default=10, help="probe feeding slices per round")
    parser.add_argument("--fallback-after", type=float, default=10.0)
    parser.add_argument("--lease-duration", type=int, default=15)
    parser.add_argument("--renew-every", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64, help="the shared client's threads")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument(
        "--gc",
        choices=("off", "on"),
        default="off",
        help="the garbage collector during the run (after setup: gc.freeze() either way)",
    )
    parser.add_argument("--progress-every", type=float, default=30.0)
    parser.add_argument(
        "--plain-emulator",
        action="store_true",
        help="hand every change to every open watch, as kmock does",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the emulator in this process (its own by default; a few thousand agents at "
        "most: every connection is a file descriptor on either side)",
    )
    parser.add_argument("--output", "--out", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if not 0 <= args.failing <= 1:
        parser.error("--failing is a share, 0 to 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    counting = CountingHandler()
    for name in ("node_agent", "servehealth_common", "urllib3"):
        logger = logging.getLogger(name)
        logger.addHandler(counting)
        logger.propagate = False
        logger.setLevel(logging.INFO)

    commit = harness.code_version(exclude=("bench",))  # the code measured: as the run starts
    begun = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    started = time.monotonic()
    result = asyncio.run(run(args))
    wall = round(time.monotonic() - started, 1)
    rows = table(result)
    print()
    print_table(rows)
    verdicts = result["verdicts"]
    print()
    for name, ok in verdicts.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    gen = result["generator"]
    if not verdicts["generator_no_sustained_lag"]:
        print("  THE LOAD GENERATOR FELL BEHIND: this run is not a result.")
    elif not verdicts["generator_kept_up"]:
        print(
            f"  The load generator was late in {gen['rounds_late']} of {gen['rounds']} rounds "
            f"(at most {gen['round_end_vs_interval_s_max']:g}s, never two in a row): a "
            "transient, not a sustained lag."
        )
    print(f"  ({shared_cpu(args)})")
    document = {
        "benchmark": "fallback_storm",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "started": begun,
        "commit": commit,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "shared_cpu": shared_cpu(args),
        "emulator_process": "the bench's" if args.in_process else "a child process of its own",
        "emulator_watch_delivery": "all watches" if args.plain_emulator else "own resource only",
        "args": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        **result,
        "log_records": dict(counting.counts.most_common()),
        "log_examples": counting.examples,
        "table": [{"measure": m, "target": t, "measured": v} for m, t, v in rows],
        "wall_time_s": wall,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.output} ({wall}s wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
