"""A 75 % mass hang over 1,000 pods, half of them agentless: label writes during it (target 0)
and the time until PANIC is declared (issue 12, "Measure and report").

The real processes, against a fake fleet:

- **the fleet** (a subprocess of this module, like ``bench.pull_sweep``'s): 1,000 aiohttp
  ``FakeServeProxy`` servers on 127.0.0.1 and the Kubernetes API emulator (kmock) listing them
  as Ray pods in namespace ``ray`` (``status.podIP`` 127.0.0.1, a container port named
  ``serve`` pointing at the pod's own proxy, labelled ``ray.io/serve=true``), 50 pods on each
  of 20 nodes. The bench drives it over its stdin and stdout, one JSON line per command and per
  answer: hang a set of proxies at one moment, heal them, the PATCHes received since a mark,
  the pods' labels. It exits when its stdin closes (this process is gone), or after a hard
  deadline, and then also SIGTERMs the agents and the aggregator this bench registered with it.
- **the aggregator**: ``python -m aggregator`` (``harness.start_aggregator``), kubernetes
  backend on the emulator's kubeconfig, ``--auth none``, every other setting its default.
- **the agents**: one ``python -m node_agent --mode daemonset`` per node on the first 10 nodes
  (500 pods pushed, probed every 1 s); the pods of the other 10 nodes have no agent and are
  pulled by the aggregator every ``--pull-interval`` (5 s).

With two CPUs or more, the aggregator runs on the first (it inherits this process's affinity
at its start), and the fleet, the agents and this process on the second: what is measured
does not share a core with what loads it.

Each trial, once every pod is SERVING with the label ``true``, PANIC is off, no write is
pending and the aggregator has pulled every agentless pod at least twice since its startup
grace: a random pause (0-5 s more, so that the hang meets the pulls at a different phase each
time), then 75 % of the proxies (a seeded random sample, pushed and agentless mixed) hang at
one moment. For ``--window`` seconds (15 s, three pull intervals) the bench polls
``GetSummary`` every 20 ms. Then it reads the PATCHes the emulator received and the labels,
heals every proxy, and waits until PANIC is over and every label is ``true`` again.

Measured per trial: the PATCHes that set the label ``false`` during the window (target 0), by
kind of pod; the time from the hang until ``GetSummary.panic`` is true (poll resolution 20 ms)
and until the aggregator's log line ``PANIC: holding a write`` (its millisecond timestamp);
the held writes and when they stopped growing; the ``false`` writes while it recovers from
the heal; the CPU share of the aggregator, of each CPU, and of the load side (fleet, agents,
this process), and the fleet's event-loop lag. When the load's CPU was busy 90 % of the time or
more, the fleet's loop stalled for more than 250 ms, a proxy that did not hang was seen as
anything but SERVING, more pods were suspect than hung, or a poll failed, the load generator
may have been the bottleneck, and the output says so. On a shared machine, before each hang the
bench waits up to ``--quiet-wait`` (120 s) for a second in which other work kept neither CPU
more than 10 % busy, and it flags a trial whose window had 15 % or more of such work.

Run from the repository root (about 5 minutes with 3 trials on a quiet machine)::

    .venv/bin/python -m bench.mass_hang [--trials 3] [--pods 1000] [--seed 12]

Prints a table and writes bench/results/mass_hang.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import platform
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import procstat
from bench.pull_sweep import event_loop, pin
from servehealth.v1 import servehealth_pb2 as pb
from testsupport import harness

REPO_ROOT = harness.REPO_ROOT
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "mass_hang.json"
NAMESPACE = "ray"
LOOPBACK = "127.0.0.1"  # every pod address; nothing else is ever probed
LABEL = "ray.io/serve"
READY = "FLEET-READY "
REPLY = "FLEET-REPLY "
FLEET_START_TIMEOUT = 300.0
FLEET_CALL_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
#: The aggregator's defaults this bench relies on (README): it does not pass them.
PULL_INTERVAL = 5.0
POLL_INTERVAL = 0.02
#: A CPU busy this share of the time or more was saturated.
SATURATED = 0.90
#: A fleet whose event loop stalls longer than this (half the 500 ms probe timeout) may make
#: a healthy proxy look hung.
FLEET_LAG = 0.25
#: Other work (not this bench's processes) on a CPU below this share: a quiet machine.
QUIET = 0.10
#: Other work above this share during a window: the trial was disturbed.
DISTURBED = 0.15
SERVING = "SERVE_STATE_SERVING"
SUSPECT = ("SERVE_STATE_UNHEALTHY", "SERVE_STATE_SILENT")
_LOG_TIME = r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
#: The first write PANIC holds (aggregator/decision/held_writes.py): PANIC as operators see it.
PANIC_LINE = re.compile(rf"^{_LOG_TIME} \S+ \S+: PANIC: holding a write ", re.MULTILINE)
#: The detector's decision, logged before any write is held.
DETECTOR_LINE = re.compile(
    rf"^{_LOG_TIME} \S+ \S+: .*writes that would take a pod out of service are held from now on",
    re.MULTILINE,
)


def pod_name(index: int) -> str:
    return f"ray-worker-{index:04d}"


def node_name(index: int) -> str:
    return f"node-{index:02d}"


# -- the fleet (subprocess) ------------------------------------------------------------------


class FleetControl:
    """The fleet's side of the protocol: one JSON command per stdin line, one answer each."""

    def __init__(self, proxies: list[Any], kube: Any, names: list[str]) -> None:
        self.proxies = proxies
        self.kube = kube
        self.names = names
        self.hung: set[int] = set()
        self.adopted: set[int] = set()
        self.lag_max = 0.0  # the event loop's longest delay since the last "lag" command
        self.lag_over = {0.1: 0, 0.25: 0, 0.5: 0}  # how many delays exceeded each bound
        self.gc_max = 0.0  # the longest garbage collection since the last "lag" command
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.monotonic()
        else:
            self.gc_max = max(self.gc_max, time.monotonic() - self._gc_started)

    async def watch_lag(self, period: float = 0.01) -> None:
        """Measure how late this loop wakes up: a stalled fleet answers probes late, and a
        healthy proxy that answers after the probe timeout looks hung."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            lag = time.monotonic() - before - period
            self.lag_max = max(self.lag_max, lag)
            for bound in self.lag_over:
                self.lag_over[bound] += lag > bound

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        from testsupport.fakes import HEALTHY

        loop = asyncio.get_running_loop()
        op = command.get("op")
        if op == "hang":  # all at one moment: a loop of attribute writes, no await
            chosen = [int(i) for i in command["pods"]]
            mark = self.kube.checkpoint()
            at = {"loop": loop.time(), "mono": time.monotonic(), "wall": time.time()}
            for index in chosen:
                self.proxies[index].hang = True
            self.hung.update(chosen)
            return {"mark": mark, **at}
        if op == "heal":  # answers the requests left hanging too
            mark = self.kube.checkpoint()
            at = {"loop": loop.time(), "mono": time.monotonic(), "wall": time.time()}
            for index in sorted(self.hung):
                self.proxies[index].set(HEALTHY)
            self.hung.clear()
            return {"mark": mark, **at}
        if op == "patches":  # PATCHes of pods (not pods/status) since a mark, loop times
            patches = []
            for call in self.kube.requests("PATCH", resource="v1/pods", since=command["since"]):
                labels = ((call.body or {}).get("metadata") or {}).get("labels") or {}
                patches.append([call.name, labels.get(LABEL), call.at, call.subresource])
            return {"patches": patches, "loop": loop.time(), "mark": self.kube.checkpoint()}
        if op == "labels":
            values = [self.kube.pod_labels(NAMESPACE, name).get(LABEL) for name in self.names]
            not_true = [n for n, v in zip(self.names, values, strict=True) if v != "true"]
            return {"true": len(self.names) - len(not_true), "not_true": not_true}
        if op == "lag":  # since the last call, then start again
            answer = {
                "max_s": round(self.lag_max, 4),
                **{f"over_{bound:g}s": count for bound, count in self.lag_over.items()},
                "gc_max_s": round(self.gc_max, 4),
            }
            self.lag_max = self.gc_max = 0.0
            self.lag_over = dict.fromkeys(self.lag_over, 0)
            return answer
        if op == "collect":  # between trials: see serve_fleet
            started = time.monotonic()
            collected = gc.collect()
            gc.freeze()
            return {"collected": collected, "seconds": round(time.monotonic() - started, 3)}
        if op == "adopt":  # processes to stop should this bench vanish
            self.adopted.update(int(pid) for pid in command["pids"])
            return {"adopted": sorted(self.adopted)}
        if op == "release":  # the bench stopped them itself
            self.adopted.difference_update(int(pid) for pid in command["pids"])
            return {"adopted": sorted(self.adopted)}
        return {"error": f"unknown op {op!r}"}


async def serve_fleet(pods: int, nodes: int, workdir: Path, lifetime: float) -> None:
    """Start the proxies and the emulator, print where they are, answer commands until stdin
    closes (or ``lifetime`` passes)."""
    import kmock

    from testsupport.fakes import FakeServeProxy
    from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator

    loop = asyncio.get_running_loop()
    per_node = -(-pods // nodes)
    proxies = [FakeServeProxy(host=LOOPBACK) for _ in range(pods)]
    names = [pod_name(i) for i in range(pods)]
    control: FleetControl | None = None
    try:
        for start in range(0, pods, 250):
            await asyncio.gather(*(proxy.start() for proxy in proxies[start : start + 250]))
        async with KubeEmulator() as kube, kmock.Server(kube):
            try:
                for index, proxy in enumerate(proxies):
                    kube.add_pod(
                        NAMESPACE,
                        names[index],
                        labels={**DEFAULT_POD_LABELS, LABEL: "true"},
                        node_name=node_name(index // per_node),
                        pod_ip=LOOPBACK,
                        serve_port=proxy.port,
                    )
                kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig", NAMESPACE)
                control = FleetControl(proxies, kube, names)
                ready = {
                    "kubeconfig": str(kubeconfig),
                    "pods": [
                        [names[i], p.port, node_name(i // per_node)] for i, p in enumerate(proxies)
                    ],
                }
                # Python's cycle collector stalled this loop for up to a second in a hang (tens
                # of thousands of requests left waiting, on top of 1,000 servers and the
                # emulator), long enough for healthy proxies to miss the 500 ms probe timeout.
                # The fleet is scenery: no automatic collections; the bench asks for one
                # ("collect") between trials, and what survives it is never scanned again.
                gc.collect()
                gc.freeze()
                gc.disable()
                print(READY + json.dumps(ready), flush=True)
                closed = asyncio.Event()
                buffer = bytearray()

                def on_stdin() -> None:
                    chunk = os.read(sys.stdin.fileno(), 65536)
                    if not chunk:
                        closed.set()
                        return
                    buffer.extend(chunk)
                    while b"\n" in buffer:
                        line, _, rest = bytes(buffer).partition(b"\n")
                        buffer[:] = rest
                        try:
                            answer = control.handle(json.loads(line))
                        except Exception as error:  # an answer either way: the bench waits
                            answer = {"error": f"{type(error).__name__}: {error}"}
                        sys.stdout.write(REPLY + json.dumps(answer) + "\n")
                        sys.stdout.flush()

                loop.add_reader(sys.stdin.fileno(), on_stdin)
                lag = asyncio.create_task(control.watch_lag())
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(closed.wait(), lifetime)
                finally:
                    lag.cancel()
                    loop.remove_reader(sys.stdin.fileno())
            finally:
                await kube.close()
    finally:
        if control is not None:
            for pid in sorted(control.adopted):  # the bench is gone without stopping them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                    print(f"fleet: sent SIGTERM to pid {pid}", file=sys.stderr, flush=True)
        for proxy in proxies:
            proxy.set(proxy.healthz)  # release hung requests, so that stop() does not wait
        for start in range(0, pods, 250):
            await asyncio.gather(*(proxy.stop() for proxy in proxies[start : start + 250]))


def fleet_main(args: argparse.Namespace) -> int:
    where = pin(args.cpu)
    procstat.raise_fd_limit()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    name, run = event_loop("uvloop")  # scenery: the fastest loop available
    print(f"fleet: pid {os.getpid()}, {where}, loop {name}", file=sys.stderr, flush=True)
    run(serve_fleet(args.pods, args.nodes, Path(args.workdir), args.lifetime))
    return 0


@dataclass
class Fleet:
    """The fleet subprocess, seen from the bench."""

    process: subprocess.Popen[bytes]
    kubeconfig: str
    pods: list[tuple[str, int, str]]  # name, port, node
    _answers: queue.Queue[str] = field(default_factory=queue.Queue, repr=False)

    @classmethod
    def start(cls, pods: int, nodes: int, cpu: int | None, workdir: Path, lifetime: float) -> Fleet:
        command = [
            sys.executable, "-m", "bench.mass_hang", "--fleet-child",
            "--pods", str(pods), "--nodes", str(nodes),
            "--workdir", str(workdir), "--lifetime", str(lifetime),
        ]  # fmt: skip
        if cpu is not None:
            command += ["--cpu", str(cpu)]
        stderr = (workdir / "fleet.log").open("wb")
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )
        stderr.close()
        watchdog = threading.Timer(FLEET_START_TIMEOUT, process.kill)  # readline has no timeout
        watchdog.start()
        try:
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.decode(errors="replace")
                if line.startswith(READY):
                    ready = json.loads(line[len(READY) :])
                    listed = [(name, int(port), node) for name, port, node in ready["pods"]]
                    fleet = cls(process, ready["kubeconfig"], listed)
                    threading.Thread(target=fleet._read, name="fleet-stdout", daemon=True).start()
                    return fleet
            raise RuntimeError(f"the fleet exited ({process.wait()}); see {workdir}/fleet.log")
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            watchdog.cancel()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for raw in self.process.stdout:
                line = raw.decode(errors="replace")
                if line.startswith(REPLY):
                    self._answers.put(line[len(REPLY) :])

    def call(self, op: str, timeout: float = FLEET_CALL_TIMEOUT, **arguments: Any) -> Any:
        """Send one command, wait for its answer (RuntimeError if none within ``timeout``)."""
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps({"op": op, **arguments}) + "\n").encode())
        self.process.stdin.flush()
        try:
            answer = json.loads(self._answers.get(timeout=timeout))
        except queue.Empty:
            raise RuntimeError(f"the fleet did not answer {op!r} within {timeout:g}s") from None
        if "error" in answer:
            raise RuntimeError(f"the fleet failed {op!r}: {answer['error']}")
        return answer

    def stop(self) -> int:
        """Close its stdin (it stops by itself), kill it if it does not."""
        return harness.stop_child(self.process, STOP_TIMEOUT)


# -- measuring -------------------------------------------------------------------------------


def cpu_times() -> dict[str, tuple[float, float]]:
    """``{"cpu0": (busy, total), ...}`` in clock ticks, from /proc/stat."""
    times = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            numbers = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq
            idle = numbers[3] + numbers[4]
            times[name] = (sum(numbers) - idle, sum(numbers))
    return times


@dataclass
class CpuMeter:
    """CPU use between :meth:`start` and :meth:`stop`: each CPU's busy share, the share of one
    core used by each group of processes (``aggregator`` and the load: the others), and, when
    pinned, what other work (not ours) kept each of the two CPUs busy."""

    groups: dict[str, list[int]]
    aggregator_cpu: int | None = None
    load_cpu: int | None = None
    _start: tuple[float, dict[str, tuple[float, float]], dict[str, float]] | None = None

    def _process_seconds(self) -> dict[str, float]:
        used = {}
        for group, pids in self.groups.items():
            total = 0.0
            for pid in pids:
                with contextlib.suppress(OSError):
                    total += procstat.cpu_seconds(pid)
            used[group] = total
        return used

    def start(self) -> None:
        self._start = (time.monotonic(), cpu_times(), self._process_seconds())

    def stop(self) -> dict[str, Any]:
        assert self._start is not None
        wall0, cpus0, used0 = self._start
        wall, cpus, used = time.monotonic() - wall0, cpu_times(), self._process_seconds()
        busy = {}
        for name, (b1, t1) in cpus.items():
            b0, t0 = cpus0.get(name, (0, 0))
            busy[name] = round((b1 - b0) / (t1 - t0), 3) if t1 > t0 else 0.0
        shares = {group: round((used[group] - used0[group]) / wall, 3) for group in used}
        result: dict[str, Any] = {
            "seconds": round(wall, 2),
            "cpu_busy": busy,
            "process_share": shares,
            "aggregator_share": shares["aggregator"],
            "load_share": round(sum(v for k, v in shares.items() if k != "aggregator"), 3),
        }
        if self.aggregator_cpu is None or self.load_cpu is None:
            result["load_cpu_busy"] = max(busy.values(), default=0.0)
            return result
        aggregator_busy = busy.get(f"cpu{self.aggregator_cpu}", 0.0)
        load_busy = busy.get(f"cpu{self.load_cpu}", 0.0)
        result.update(
            aggregator_cpu_busy=aggregator_busy,
            load_cpu_busy=load_busy,
            other_on_aggregator_cpu=round(max(0.0, aggregator_busy - shares["aggregator"]), 3),
            other_on_load_cpu=round(max(0.0, load_busy - result["load_share"]), 3),
        )
        return result

    def other_work(self, measured: dict[str, Any]) -> float:
        """The larger share of a CPU kept busy by work that is not ours (0 when not pinned)."""
        return max(
            measured.get("other_on_aggregator_cpu", 0.0), measured.get("other_on_load_cpu", 0.0)
        )


@dataclass
class Sample:
    at: float  # seconds after the hang
    panic: bool
    held: int
    suspect: int
    serving: int


def summary(inspector: harness.Inspector) -> pb.Summary:
    return inspector.stub.GetSummary(pb.GetSummaryRequest(), timeout=2.0)


def metric_total(metrics_port: int, name: str) -> float:
    """The sum of every sample of ``name`` (over its labels) on the aggregator's /metrics."""
    status, body = harness.http_get(f"http://{LOOPBACK}:{metrics_port}/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(None, 1)[1])
    return total


def wait_until(check: Callable[[], Any], within: float, what: str, interval: float = 0.1) -> float:
    """Poll ``check`` until it returns something true; its seconds, or RuntimeError."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise RuntimeError(f"not {what} within {within:g}s")
        time.sleep(interval)


def log_times(
    text: str, pattern: re.Pattern[str], after_wall: float, within: float
) -> float | None:
    """The wall-clock time of the first line matching ``pattern`` within ``within`` seconds
    from ``after_wall`` (the log has millisecond, local-time stamps); None if there is none."""
    for match in pattern.finditer(text):
        stamp = datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if after_wall - 0.001 <= stamp <= after_wall + within:
            return stamp
    return None


@dataclass
class Setup:
    fleet: Fleet
    aggregator: harness.AggregatorProcess
    agents: list[harness.Process]
    inspector: harness.Inspector
    pushed: set[int]  # pod indices an agent reports for
    names: list[str]


def settled(setup: Setup, pulls_needed: float) -> bool:
    """Every pod SERVING and labelled true, PANIC off, no write pending, every agentless pod
    pulled at least twice, every agent connected."""
    seen = summary(setup.inspector)
    pods = len(setup.names)
    if seen.pods != pods or seen.pods_by_state[SERVING] != pods or seen.panic:
        return False
    if seen.agents_connected != len(setup.agents):
        return False
    if seen.pods_in_pull_mode != pods - len(setup.pushed):
        return False
    port = setup.aggregator.metrics_port
    if metric_total(port, "serve_health_writes_pending") != 0:
        return False
    if metric_total(port, "serve_health_pull_probes_total") < pulls_needed:
        return False
    return setup.fleet.call("labels")["true"] == pods


def run_trial(
    setup: Setup, number: int, rng: random.Random, args: argparse.Namespace, meter: CpuMeter
) -> dict[str, Any]:
    pods = len(setup.names)
    index_of = {name: i for i, name in enumerate(setup.names)}
    agentless = pods - len(setup.pushed)
    # The fleet's garbage of the last trial goes first (its loop stalls meanwhile), then wait
    # for a settled fleet (after a heal, SERVING everywhere means every pod was probed again),
    # then a random pause: the hang meets the pulls at a new phase.
    collected = setup.fleet.call("collect")
    wait_until(lambda: settled(setup, 0), 180, "settled", interval=0.25)
    # A shared machine: wait (a bounded time) for a second in which no other work kept either
    # CPU busy, so that what is measured is the aggregator, not a neighbour.
    quiet_waited = time.monotonic()
    quiet = False
    while not quiet:
        meter.start()
        time.sleep(1.0)
        quiet = meter.other_work(meter.stop()) < QUIET
        if time.monotonic() - quiet_waited > args.quiet_wait:
            break
    quiet_waited = time.monotonic() - quiet_waited
    pause = 2.0 + rng.uniform(0, PULL_INTERVAL)
    meter.start()
    time.sleep(pause)
    steady_cpu = meter.stop()

    chosen = sorted(rng.sample(range(pods), round(pods * args.hang_share)))
    hung = set(chosen)
    steady_lag = setup.fleet.call("lag")  # since the last trial's recovery; starts again
    meter.start()
    hang = setup.fleet.call("hang", pods=chosen)
    t0 = hang["mono"]
    samples: list[Sample] = []
    poll_errors = 0
    end = t0 + args.window
    while time.monotonic() < end:
        try:
            seen = summary(setup.inspector)
        except grpc.RpcError:  # counted and reported: an aggregator too busy to answer
            poll_errors += 1
            time.sleep(POLL_INTERVAL)
            continue
        samples.append(
            Sample(
                at=time.monotonic() - t0,
                panic=seen.panic,
                held=seen.panic_held_writes,
                suspect=sum(seen.pods_by_state[state] for state in SUSPECT),
                serving=seen.pods_by_state[SERVING],
            )
        )
        time.sleep(max(0.0, POLL_INTERVAL - (time.monotonic() - t0 - samples[-1].at)))
    window_cpu = meter.stop()
    window_lag = setup.fleet.call("lag")
    # What went wrong in the window: pods that did not hang but are not SERVING (the load
    # side could not keep up), and the PATCHes.
    listed = setup.inspector.stub.ListPods(pb.ListPodsRequest(), timeout=5.0).pods
    healthy_not_serving = sorted(
        p.name
        for p in listed
        if index_of.get(p.name) not in hung and p.state != pb.SERVE_STATE_SERVING
    )
    patches = setup.fleet.call("patches", since=hang["mark"])["patches"]
    labels = setup.fleet.call("labels")
    false_writes = [
        (name, at - hang["loop"])
        for name, value, at, subresource in patches
        if value == "false" and subresource is None and at - hang["loop"] <= args.window
    ]
    other_writes = len(patches) - len(false_writes)

    # Heal, and watch the recovery.
    meter.start()
    heal = setup.fleet.call("heal")
    t1 = heal["mono"]
    panic_over = None
    recovered = None
    deadline = t1 + args.recovery_timeout
    while time.monotonic() < deadline:
        seen = summary(setup.inspector)
        if panic_over is None and not seen.panic:
            panic_over = time.monotonic() - t1
        if (
            panic_over is not None
            and seen.pods_by_state[SERVING] == pods
            and setup.fleet.call("labels")["true"] == pods
        ):
            recovered = time.monotonic() - t1
            break
        time.sleep(0.1)
    recovery_cpu = meter.stop()
    after = setup.fleet.call("patches", since=heal["mark"])["patches"]
    false_after_heal = sum(1 for _, value, _, sub in after if value == "false" and sub is None)
    true_after_heal = sum(1 for _, value, _, sub in after if value == "true" and sub is None)
    error = (
        None
        if recovered is not None
        else f"trial {number}: not recovered within {args.recovery_timeout:g}s of the heal "
        f"(see {setup.aggregator.log_path})"
    )

    log = setup.aggregator.log_text()
    panic_log = log_times(log, PANIC_LINE, hang["wall"], args.window)
    detector_log = log_times(log, DETECTOR_LINE, hang["wall"], args.window)
    panic_samples = [s for s in samples if s.panic]
    held_max = max((s.held for s in samples), default=0)
    growth = [b.at for a, b in itertools.pairwise(samples) if b.held > a.held]
    threshold_crossed = next((s.at for s in samples if s.suspect * 2 > pods), None)
    false_pushed = sum(1 for name, _ in false_writes if index_of[name] in setup.pushed)
    false_not_hung = sum(1 for name, _ in false_writes if index_of[name] not in hung)

    def rounded(value: float | None, digits: int = 3) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "trial": number,
        "error": error,
        "hang_at": datetime.fromtimestamp(hang["wall"], UTC).isoformat(timespec="milliseconds"),
        "pause_before_s": round(pause, 2),
        "waited_for_quiet_s": round(quiet_waited, 1),
        "quiet_before": quiet,
        "hung": len(hung),
        "hung_pushed": len(hung & setup.pushed),
        "hung_agentless": len(hung - setup.pushed),
        "false_writes": len(false_writes),
        "false_writes_pushed": false_pushed,
        "false_writes_agentless": len(false_writes) - false_pushed,
        "false_writes_of_pods_not_hung": false_not_hung,
        "false_writes_at_s": sorted(round(at, 3) for _, at in false_writes),
        "false_writes_pods": sorted(name for name, _ in false_writes),
        "other_pod_patches": other_writes,
        "labels_not_true_at_window_end": len(labels["not_true"]),
        "suspect_over_half_s": rounded(threshold_crossed),
        "panic_declared_s": rounded(panic_samples[0].at if panic_samples else None),
        "panic_log_s": rounded(None if panic_log is None else panic_log - hang["wall"]),
        "panic_detector_log_s": rounded(
            None if detector_log is None else detector_log - hang["wall"]
        ),
        "panic_held_writes_max": held_max,
        "panic_held_writes_last_growth_s": rounded(growth[-1] if growth else None),
        "panic_held_writes_at_window_end": samples[-1].held if samples else None,
        "suspect_at_window_end": samples[-1].suspect if samples else None,
        "suspect_max": max((s.suspect for s in samples), default=0),
        "pods_not_hung_not_serving_at_window_end": len(healthy_not_serving),
        "pods_not_hung_not_serving_examples": healthy_not_serving[:10],
        "polls": len(samples),
        "poll_errors": poll_errors,
        "panic_over_after_heal_s": rounded(panic_over),
        "recovered_after_heal_s": rounded(recovered),
        "false_writes_after_heal": false_after_heal,
        "true_writes_after_heal": true_after_heal,
        "fleet_loop_lag_window": window_lag,
        "fleet_loop_lag_before": steady_lag,
        "fleet_gc_before": collected,
        "cpu_steady": steady_cpu,
        "cpu_window": window_cpu,
        "cpu_recovery": recovery_cpu,
        "agentless_pods": agentless,
    }


# -- the run ---------------------------------------------------------------------------------


def start_aggregator_on(
    cpu: int | None, log_dir: Path, kubeconfig: str
) -> harness.AggregatorProcess:
    """The aggregator, started while this thread's affinity is ``cpu``: it and every thread it
    starts inherit it. This thread's affinity is put back afterwards."""
    before = os.sched_getaffinity(0) if cpu is not None else None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        args = ["--kube-backend", "kubernetes", "--kubeconfig", kubeconfig]
        return harness.start_aggregator(log_dir, None, args, timeout=60)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def affinity_of(pid: int) -> list[int]:
    """The CPUs the threads of ``pid`` may run on (the union over its threads)."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def print_table(trials: list[dict[str, Any]], window: float) -> None:
    print()
    print(f"{len(trials)} trials; 'false' = label writes to false within {window:g} s of the hang")
    header = (
        f"{'trial':>5} {'hung p/a':>9} {'false':>6} {'p/a':>7} {'1st at':>7} "
        f"{'PANIC poll':>10} {'PANIC log':>9} {'held':>5} {'held grows to':>13} "
        f"{'agg CPU':>7} {'load CPU':>8} {'other':>5} {'heal: false':>11} {'recovered':>9}"
    )
    print(header)
    for t in trials:
        first = f"{t['false_writes_at_s'][0]:.2f}" if t["false_writes_at_s"] else "-"
        load_cpu = t["cpu_window"]["load_cpu_busy"]
        other = max(t["cpu_window"].get(k, 0.0) for k in OTHER_KEYS)

        def secs(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        print(
            f"{t['trial']:>5} {t['hung_pushed']:>4}/{t['hung_agentless']:<4} "
            f"{t['false_writes']:>6} "
            f"{t['false_writes_pushed']:>3}/{t['false_writes_agentless']:<3} "
            f"{first:>7} {secs(t['panic_declared_s']):>10} {secs(t['panic_log_s']):>9} "
            f"{t['panic_held_writes_max']:>5} {secs(t['panic_held_writes_last_growth_s']):>13} "
            f"{t['cpu_window']['aggregator_share']:>6.0%} {load_cpu:>7.0%} {other:>4.0%} "
            f"{t['false_writes_after_heal']:>11} {secs(t['recovered_after_heal_s']):>9}"
        )
    print(
        "(p/a: pushed/agentless; times in seconds after the hang, PANIC poll = GetSummary.panic "
        "seen, every 20 ms; PANIC log = the 'PANIC: holding a write' line; held grows to = last "
        "increase of panic_held_writes; agg CPU = aggregator process, share of one core; load "
        "CPU = busy share of the load's CPU; other = the most either CPU was kept busy by work "
        "not this bench's; heal: false = label writes to false while recovering from the heal)"
    )


OTHER_KEYS = ("other_on_aggregator_cpu", "other_on_load_cpu")


def load_verdict(trial: dict[str, Any]) -> list[str]:
    """Why the load side (fleet, agents, emulator, bench) may have been the bottleneck in a
    trial's window; empty if it was not."""
    reasons = []
    busy = trial["cpu_window"]["load_cpu_busy"]
    if busy >= SATURATED:
        reasons.append(f"the load's CPU was busy {busy:.0%} of the window")
    if trial["pods_not_hung_not_serving_at_window_end"]:
        reasons.append(
            f"{trial['pods_not_hung_not_serving_at_window_end']} pods whose proxy did not hang "
            "were not SERVING at the end of the window"
        )
    if trial["suspect_max"] > trial["hung"]:
        reasons.append(
            f"up to {trial['suspect_max']} pods UNHEALTHY or SILENT for {trial['hung']} hung"
        )
    lag = trial["fleet_loop_lag_window"]["max_s"]
    if lag > FLEET_LAG:
        reasons.append(f"the fleet's event loop stalled for up to {lag * 1000:.0f} ms")
    if trial["poll_errors"]:
        reasons.append(f"{trial['poll_errors']} GetSummary polls failed")
    return reasons


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM runs the clean-up (agents, aggregator, fleet stopped), as Ctrl-C does."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=1000, help="Ray pods (default 1000)")
    parser.add_argument("--nodes", type=int, default=20, help="nodes they spread over (20)")
    parser.add_argument(
        "--agent-nodes",
        type=int,
        default=10,
        help="nodes with a DaemonSet agent (default 10: half the pods pushed, half agentless)",
    )
    parser.add_argument("--trials", type=int, default=3, help="mass hangs (default 3)")
    parser.add_argument(
        "--hang-share", type=float, default=0.75, help="share of proxies that hang (0.75)"
    )
    parser.add_argument(
        "--window", type=float, default=15.0, help="observation window after a hang (15 s)"
    )
    parser.add_argument(
        "--recovery-timeout", type=float, default=120.0, help="longest wait after a heal (120 s)"
    )
    parser.add_argument("--seed", type=int, default=12, help="random seed (default 12)")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="before each hang, wait up to this long for a second in which other work kept "
        "neither CPU more than 10%% busy (default 120 s; the trial then goes on, and says so)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="add this to the niceness of the bench and every process it starts (negative: "
        "ahead of other work on a shared machine; needs the privilege); recorded in the result",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    # The fleet subprocess runs this module too.
    parser.add_argument("--fleet-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fleet_child:
        return fleet_main(args)
    if not 0 < args.agent_nodes < args.nodes or args.pods < args.nodes:
        parser.error("need 0 < --agent-nodes < --nodes <= --pods")

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    niceness = os.nice(args.nice) if args.nice else os.nice(0)  # children inherit it
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = len(cpus) >= 2 and not args.no_pin
    aggregator_cpu, load_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    where = pin(load_cpu)
    procstat.raise_fd_limit()  # children inherit it
    rng = random.Random(args.seed)
    load_before = round(os.getloadavg()[0], 2)
    started = time.monotonic()
    per_node = -(-args.pods // args.nodes)
    pushed = {i for i in range(args.pods) if i // per_node < args.agent_nodes}
    print(
        f"mass hang: {args.pods} pods on {args.nodes} nodes, {len(pushed)} pushed by "
        f"{args.agent_nodes} DaemonSet agents, {args.pods - len(pushed)} agentless; "
        f"{args.hang_share:.0%} hang, {args.trials} trials, window {args.window:g} s, seed "
        f"{args.seed}; bench pid {os.getpid()} {where}, aggregator "
        f"{f'pinned to CPU {aggregator_cpu}' if pinned else 'not pinned'} "
        f"({len(cpus) or os.cpu_count()} CPUs), niceness {niceness}",
        flush=True,
    )
    lifetime = 900 + args.trials * (args.window + args.recovery_timeout + 240)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-mass-hang-"))
    fleet = Fleet.start(args.pods, args.nodes, load_cpu, log_dir, lifetime)
    print(f"fleet ready (pid {fleet.process.pid}) after {time.monotonic() - started:.1f}s")
    aggregator: harness.AggregatorProcess | None = None
    agents: list[harness.Process] = []
    inspector: harness.Inspector | None = None
    trials: list[dict[str, Any]] = []
    failure: str | None = None
    try:
        aggregator = start_aggregator_on(aggregator_cpu, log_dir, fleet.kubeconfig)
        fleet.call("adopt", pids=[aggregator.pid])
        for node in range(args.agent_nodes):
            agents.append(
                harness.spawn_daemonset_agent(
                    log_dir,
                    aggregator.address,
                    fleet.kubeconfig,
                    node_name(node),
                    name=f"agent-{node_name(node)}",
                )
            )
        fleet.call("adopt", pids=[agent.pid for agent in agents])
        for agent in agents:
            harness.wait_connected(agent, timeout=60)
        aggregator_cpus = affinity_of(aggregator.pid)
        print(
            f"aggregator pid {aggregator.pid} (CPUs {aggregator_cpus}), {len(agents)} agents "
            f"connected, logs in {log_dir}",
            flush=True,
        )
        inspector = harness.Inspector(aggregator.address)
        setup = Setup(fleet, aggregator, agents, inspector, pushed, [p[0] for p in fleet.pods])
        agentless = args.pods - len(pushed)
        # Settled: past the startup grace, and every agentless pod pulled twice since.
        took = wait_until(
            lambda: settled(setup, 2 * agentless), 180, "settled after the start", interval=0.25
        )
        print(f"settled {took:.1f}s after the agents connected", flush=True)
        meter = CpuMeter(
            {
                "aggregator": [aggregator.pid],
                "fleet": [fleet.process.pid],
                "agents": [agent.pid for agent in agents],
                "bench": [os.getpid()],
            },
            aggregator_cpu,
            load_cpu,
        )
        for number in range(1, args.trials + 1):
            try:
                trial = run_trial(setup, number, rng, args, meter)
            except RuntimeError as error:  # not settled, the fleet did not answer: stop here
                failure = f"trial {number}: {error}"
                break
            trials.append(trial)
            print(
                f"trial {number}: {trial['hung']} hung ({trial['hung_pushed']} pushed, "
                f"{trial['hung_agentless']} agentless); label writes false in the window: "
                f"{trial['false_writes']} ({trial['false_writes_pushed']} pushed, "
                f"{trial['false_writes_agentless']} agentless); PANIC declared after "
                f"{trial['panic_declared_s']} s (log {trial['panic_log_s']} s); held writes "
                f"max {trial['panic_held_writes_max']}; recovered "
                f"{trial['recovered_after_heal_s']} s after the heal "
                f"({trial['false_writes_after_heal']} false writes while recovering)",
                flush=True,
            )
            if trial["error"]:  # the next trial would not start from a settled fleet
                failure = trial["error"]
                break
    finally:
        if inspector is not None:
            inspector.close()
        for agent in agents:
            agent.stop()
        if aggregator is not None:
            aggregator.stop()
        stopped = [agent.pid for agent in agents]
        if aggregator is not None:
            stopped.append(aggregator.pid)
        with contextlib.suppress(RuntimeError, OSError):
            fleet.call("release", pids=stopped)
        code = fleet.stop()
        print(f"fleet stopped (exit code {code})")
    load_after = round(os.getloadavg()[0], 2)

    # Was the load side the bottleneck, or the machine shared?
    verdicts = {t["trial"]: load_verdict(t) for t in trials}
    saturated = [number for number, reasons in verdicts.items() if reasons]
    disturbed = [
        t["trial"]
        for t in trials
        if max(t["cpu_window"].get(k, 0.0) for k in OTHER_KEYS) >= DISTURBED
    ]
    print_table(trials, args.window)
    false_total = sum(t["false_writes"] for t in trials)
    print(
        f"label writes to false during the hang: {false_total} in {len(trials)} trials "
        f"({', '.join(str(t['false_writes']) for t in trials)}; target 0); PANIC declared "
        f"after (median) {median([t['panic_declared_s'] for t in trials])} s"
    )
    for t in trials:
        cpu = t["cpu_window"]
        print(
            f"trial {t['trial']} in the window: fleet loop lag max "
            f"{t['fleet_loop_lag_window']['max_s'] * 1000:.0f} ms; CPU (share of one core) "
            f"{cpu['process_share']}; each CPU busy {cpu['cpu_busy']}"
            + (
                f"; other work on the aggregator's CPU {cpu['other_on_aggregator_cpu']:.0%}, "
                f"on the load's CPU {cpu['other_on_load_cpu']:.0%}"
                if pinned
                else ""
            )
        )
    for number in saturated:
        print(f"LOAD SIDE SATURATED in trial {number}: {'; '.join(verdicts[number])}")
    if saturated:
        print("  (those trials measure the load generator too, not only the aggregator)")
    else:
        print(
            f"load side not saturated: its CPU busy < {SATURATED:.0%} in every window, every "
            "proxy that did not hang stayed SERVING, no poll failed"
        )
    if disturbed:
        print(
            f"DISTURBED: in trials {disturbed} other work (not this bench's processes) kept a "
            f"CPU busy {DISTURBED:.0%} of the window or more"
        )

    result = {
        "benchmark": "mass_hang",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": harness.code_version(),
        "python": platform.python_version(),
        "cpus": len(cpus) or os.cpu_count(),
        "pinning": (
            {"aggregator_cpu": aggregator_cpu, "load_cpu": load_cpu} if pinned else "not pinned"
        ),
        "load_average_1m": {"before": load_before, "after": load_after},
        "fleet": {
            "pods": args.pods,
            "nodes": args.nodes,
            "agent_nodes": args.agent_nodes,
            "pushed": len(pushed),
            "agentless": args.pods - len(pushed),
            "hang_share": args.hang_share,
            "address": LOOPBACK,
        },
        "aggregator_settings": "defaults (--kube-backend kubernetes, --auth none)",
        "niceness": niceness,
        "window_s": args.window,
        "seed": args.seed,
        "trials": trials,
        "false_writes_total": false_total,
        "false_writes_per_trial": [t["false_writes"] for t in trials],
        "target_false_writes": 0,
        "panic_declared_s": [t["panic_declared_s"] for t in trials],
        "panic_declared_median_s": median([t["panic_declared_s"] for t in trials]),
        "panic_log_s": [t["panic_log_s"] for t in trials],
        "load_saturated_trials": saturated,
        "load_saturated_why": {str(k): v for k, v in verdicts.items() if v},
        "disturbed_trials": disturbed,
        "error": failure,
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    if failure:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
