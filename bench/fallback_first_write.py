"""How soon does a sidecar write for its failing pod when the aggregator dies (issue 26)?

Target of the issue: the first write lands within ``--fallback-after`` + 2 s for a failing pod
among 12 sidecars on 2 cores (measured 13.3 s with ``--fallback-after 3s`` before the fixes,
when every sidecar loaded the Kubernetes client as fallback began).

Real processes, small scale. This process runs the Kubernetes API emulator of the tests
(``testsupport/kube/emulator.py``, kmock over real HTTP) and ``--pods`` (12) loopback fake
Serve proxies (``testsupport/fakes.py::FakeServeProxy``, real HTTP servers). The emulator holds
one pod per proxy, each with the readiness gate ``ray.io/serve-proxy-healthy``. One real
``serve-health-agent`` sidecar process per pod (the product's default probe interval, 750 ms,
and probe timeout, 500 ms, unless ``--interval`` says otherwise; ``--fallback-after 3s``;
``--metrics-listen`` as the example RayService runs it), each with a kubeconfig of its own whose
bearer token names its pod, so that the emulator tells every agent's requests apart. One real
``serve-health-aggregator`` (kubernetes backend on the emulator, ``--mode condition``,
``--agent-fallback on``). Agents may be pinned to one core (``--pin 0``: ``taskset -c 0``, the
12 agents share it, the worst case); the aggregator and this process are not pinned.

Once every agent is connected and every pod carries the condition True, each trial:

1. makes one pod's proxy answer 503 (a different pod each trial) and, in the same instant
   (microseconds after), SIGKILLs the aggregator: the figures count from the kill;
2. measures until the agent's first PATCH of that pod's status arrives at the emulator
   (``first write``) and until the stored condition is False (polled every 10 ms);
3. keeps the outage ``--hold`` s longer, restarts the aggregator (same port) and a fresh
   process for the failing pod's agent (its Kubernetes client loaded: the next trial that fails
   this pod must not find it loaded), and waits until every agent is connected and every pod
   True again;
4. counts every API request each agent made from the kill until then (by its token; the 11
   healthy agents: expected 0), and looks in each agent's ``/proc/PID/maps`` for the shared
   objects that only the Kubernetes client loads (PyYAML's ``_yaml``, ``charset_normalizer``):
   a healthy sidecar must not have loaded it.

Variants: ``a``, the aggregator without ``--leader-elect`` (no Lease: no gate); ``b``, with
``--leader-elect`` (Lease ``default/ray-serve-health-aggregator``, duration ``--lease-durations``,
the aggregator's default 3 s unless said otherwise; one variant per duration): agents learn the
Lease from the aggregator's settings, and the first write cannot come before the Lease lapses.
For ``b`` the table also gives the time from the Lease's expiry (its last ``renewTime`` plus
``leaseDurationSeconds``, read from the emulator after the kill) and from the agent's first read
of the Lease (an agent judges the Lease on its own monotonic clock: a Lease first seen counts as
renewed for a whole duration from that read).

The failing agent's log gives the breakdown (wall clock, milliseconds): when its stream ended,
when fallback began (left out of a trial in which the wall clock moved against the monotonic
one: a clock step, or the machine paused; every other figure is on the monotonic clock); its
metrics give the fleet API budget's slot period (2 x fleet size / 40 s: 0.6 s for 12) and how
long its requests waited for slots; ``/proc/PID/stat`` the CPU time it used from the kill to
the write (against the healthy agents' median: their probes).

Run from the repository root (about 3.5 minutes with the defaults: 5 trials of ``a`` and of
``b`` with a 3 s Lease; add 15 s Leases with ``--lease-durations 3,15``, about 7 minutes)::

    .venv/bin/python -m bench.fallback_first_write
    .venv/bin/python -m bench.fallback_first_write --pin 0 --lease-durations 3,15

Prints a table and writes bench/results/fallback_first_write.json (``--output``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import kmock

from aggregator.flags import AggregatorFlags
from node_agent.fallback.budget import DEFAULT_FLEET_BUDGET, PER_SLOT
from node_agent.flags import AgentFlags
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport import harness
from testsupport.fakes import HEALTHY, FakeServeProxy
from testsupport.kube.emulator import ApiCall, KubeEmulator

DEFAULT_OUTPUT = harness.REPO_ROOT / "bench" / "results" / "fallback_first_write.json"
NS = "default"
GATE = "ray.io/serve-proxy-healthy"
LABELS = {"ray.io/node-type": "worker"}
FAILING = (503, "Service Unavailable")
LEASE_NAME = "ray-serve-health-aggregator"
#: The issue's target: the first write within --fallback-after plus this.
TARGET_MARGIN = 2.0
POLL = 0.01
#: A larger move of the wall clock against the monotonic one during a trial voids its log times.
CLOCK_STEP = 0.05
#: Shared objects only the Kubernetes client (node_agent.fallback.writer) brings into a sidecar.
CLIENT_MARKERS = ("/yaml/_yaml.", "/charset_normalizer/md.")

CONNECTED = re.compile(r"connected to aggregator ")
ENDPOINT = re.compile(r"serving /livez, /readyz and /metrics on [^:\s]+:(\d+)")
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
STREAM_ENDED = re.compile(r"aggregator \S+: stream ended")
FALLBACK_BEGAN = re.compile(r"no aggregator for \d+s: writing for my \d+ pods? myself")
WROTE = re.compile(r"no aggregator: wrote condition")
CONFLICT = re.compile(r"changed since version")
SLOT = re.compile(r"sends at most \d+ API requests every ([\d.]+)s .*shared by (\d+) agents")
WAITED = "serve_health_agent_fallback_api_wait_seconds_total"
SLOT_SECONDS = "serve_health_agent_fallback_api_slot_seconds"


class BenchError(RuntimeError):
    """Something did not happen within its time: not a figure."""


# -- processes -------------------------------------------------------------------------------


def spawn(
    name: str, args: Sequence[str], log_path: Path, env: dict[str, str], pin: str
) -> harness.Process:
    """``python <args>`` (under ``taskset -c pin`` if ``pin``), as :func:`harness.spawn`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    prefix = ["taskset", "-c", pin] if pin else []
    try:
        popen = subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=harness.REPO_ROOT,
            start_new_session=True,
        )
    except BaseException:
        log.close()
        raise
    return harness.Process(name, popen, log_path, log)


def token_kubeconfig(kube: KubeEmulator, path: Path, token: str) -> Path:
    """A kubeconfig for the emulator whose user sends ``Authorization: Bearer <token>`` (the
    emulator does not check it: it names the sender)."""
    kube.write_kubeconfig(path)
    config = json.loads(path.read_text())
    config["users"] = [{"name": "kmock", "user": {"token": token}}]
    path.write_text(json.dumps(config, indent=2))
    return path


def bearer(call: ApiCall) -> str:
    for key, value in call.headers.items():
        if key.lower() == "authorization":
            return value.removeprefix("Bearer ").strip()
    return ""


def client_loaded(pid: int) -> bool | None:
    """Whether the process has the Kubernetes client's shared objects mapped (None: gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return any(marker in maps for marker in CLIENT_MARKERS)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process has used so far (None: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def log_time(line: str) -> float | None:
    """The wall-clock time of a text-format log line (local time, milliseconds)."""
    found = LOG_TIME.match(line)
    if found is None:
        return None
    return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_after(text: str, pattern: re.Pattern[str], wall: float) -> float | None:
    """Wall time of the first log line matching ``pattern`` at or after ``wall`` (the log has
    millisecond times: a line within that of ``wall`` counts)."""
    for line in text.splitlines():
        at = log_time(line)
        if at is not None and at >= wall - 0.001 and pattern.search(line):
            return at
    return None


def other_benches() -> list[str]:
    """Command lines of other benchmarks (``python -m bench.*``) and test runs (pytest) running
    now, for the record: the figures are taken beside them."""
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [part.decode(errors="replace") for part in argv if part]
        if not words or "python" not in os.path.basename(words[0]):
            continue  # (a wrapper's command line: timeout, taskset; its python is listed)
        other = any(w.startswith("bench.") and w != "bench.fallback_first_write" for w in words)
        if other or "pytest" in words[1:3]:
            found.append(" ".join(words)[:200])
    return found


# -- the fleet ---------------------------------------------------------------------------------


@dataclass
class Agent:
    index: int
    pod: str
    uid: str
    proxy: FakeServeProxy
    kubeconfig: Path
    token: str
    process: harness.Process | None = None
    metrics_port: int = 0
    generation: int = 0


@dataclass
class Variant:
    name: str
    lease_seconds: int = 0  # 0: no --leader-elect

    def aggregator_args(self, kubeconfig: Path, renew_deadline: float) -> list[str]:
        args = [
            "--kube-backend=kubernetes",
            f"--kubeconfig={kubeconfig}",
            "--mode=condition",
            "--agent-fallback=on",
        ]
        if self.lease_seconds:
            args += [
                "--leader-elect=true",
                f"--leader-elect-namespace={NS}",
                f"--leader-elect-lease-duration={self.lease_seconds}s",
                f"--leader-elect-renew-deadline={renew_deadline:g}s",
            ]
        return args


@dataclass
class Trial:
    variant: str
    trial: int
    pod: str
    first_write_s: float
    condition_false_s: float
    stream_ended_s: float | None
    fallback_began_s: float | None
    began_to_write_s: float | None
    budget_wait_s: float | None
    slot_s: float | None
    fleet_size: int | None
    lease_seconds: int = 0
    lease_expiry_s: float | None = None  # from the kill: last renewTime + duration
    write_from_expiry_s: float | None = None
    lease_read_s: float | None = None  # the failing agent's first GET of the Lease
    write_from_lease_read_s: float | None = None
    event_s: float | None = None
    failing_requests: dict[str, int] = field(default_factory=dict)
    failing_patches: int = 0
    conflict_logged: bool = False
    failing_client_loaded: bool | None = None
    healthy_requests: int = 0
    healthy_requests_by: dict[str, int] = field(default_factory=dict)
    healthy_client_loaded: list[str] = field(default_factory=list)
    healthy_fallback_logged: int = 0
    healthy_rss_mib_max: float | None = None
    failing_rss_mib: float | None = None
    #: CPU time used from the kill until the write was seen: the failing agent, and the
    #: healthy agents' median (their probes only, if they do nothing else).
    failing_cpu_s: float | None = None
    healthy_cpu_s: float | None = None
    other_requests: int = 0  # agent User-Agent, unknown token (expected 0)
    aggregator_writes_after_kill: int = 0
    load_average: list[float] = field(default_factory=list)
    beside: list[str] = field(default_factory=list)  # other benches and test runs at the kill
    back_s: float = 0.0  # from the restart until every agent connected and every pod True
    #: How far the wall clock moved against the monotonic one during the trial (a step of the
    #: clock, or the machine paused): the log's times (wall clock) are then not comparable
    #: with the kill, and the figures taken from them are left out (None).
    clock_step_s: float = 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, kube: KubeEmulator, log_dir: Path) -> None:
        self.args = args
        self.kube = kube
        self.log_dir = log_dir
        self.agents: list[Agent] = []
        self.aggregator: harness.AggregatorProcess | None = None
        self.port = harness.free_port()
        self.kubeconfig = kube.write_kubeconfig(log_dir / "kubeconfig-aggregator")
        self.restarts = 0
        self.loop = asyncio.get_running_loop()

    # -- starting things -----------------------------------------------------------------

    async def start_fleet(self, variant: Variant) -> None:
        for index in range(self.args.pods):
            proxy = await FakeServeProxy().start()
            name = f"ray-worker-{index:02d}"
            pod = self.kube.add_pod(
                NS,
                name,
                labels=LABELS,
                pod_ip=harness.HOST,
                serve_port=proxy.port,
                readiness_gates=[GATE],
            )
            token = f"bench-agent-{name}"
            path = token_kubeconfig(self.kube, self.log_dir / f"kubeconfig-{name}", token)
            self.agents.append(Agent(index, name, pod["metadata"]["uid"], proxy, path, token))
        await self.start_aggregator(variant)
        for agent in self.agents:
            self.spawn_agent(agent)
        await self.settled(variant, within=120)

    async def start_aggregator(self, variant: Variant) -> None:
        self.restarts += 1
        log_dir = self.log_dir / f"aggregator-{self.restarts:02d}-{variant.name}"
        args = variant.aggregator_args(self.kubeconfig, self.args.renew_deadline)
        self.aggregator = await asyncio.to_thread(
            harness.start_aggregator, log_dir, self.port, args, 60.0
        )

    def spawn_agent(self, agent: Agent) -> None:
        agent.generation += 1
        identity = harness.PodIdentity(NS, agent.pod, agent.uid, "node-1")
        args = [
            "-m",
            "node_agent",
            f"--aggregator={harness.HOST}:{self.port}",
            f"--proxy-url={agent.proxy.url}",
            f"--kubeconfig={agent.kubeconfig}",
            f"--fallback-after={self.args.fallback_after:g}s",
            "--metrics-listen=127.0.0.1:0",
        ]
        if self.args.interval:
            args += [f"--interval={self.args.interval}"]
        if self.args.probe_timeout:
            args += [f"--probe-timeout={self.args.probe_timeout}"]
        agent.process = spawn(
            agent.pod,
            args,
            self.log_dir / f"{agent.pod}-{agent.generation}.log",
            harness.agent_environ(identity),
            self.args.pin,
        )
        agent.metrics_port = 0

    # -- waiting -------------------------------------------------------------------------

    async def until(self, check: Callable[[], Awaitable[bool]], within: float, what: str) -> float:
        started = self.loop.time()
        while not await check():
            for agent in self.agents:
                if agent.process is not None and not agent.process.alive:
                    raise BenchError(f"agent {agent.pod} exited\n{agent.process.tail()}")
            if self.aggregator is not None and not self.aggregator.alive:
                raise BenchError(f"the aggregator exited\n{self.aggregator.tail()}")
            if self.loop.time() - started > within:
                tails = "\n".join(a.process.tail(8) for a in self.agents if a.process)
                aggregator = self.aggregator.tail() if self.aggregator else ""
                raise BenchError(f"{what}: not within {within:g}s\n{aggregator}\n{tails}")
            await asyncio.sleep(0.05)
        return self.loop.time() - started

    async def agents_connected(self) -> int:
        try:
            async with grpc.aio.insecure_channel(f"{harness.HOST}:{self.port}") as channel:
                stub = pb_grpc.InspectionServiceStub(channel)
                summary = await stub.GetSummary(pb.GetSummaryRequest(), timeout=2)
                return summary.agents_connected
        except grpc.aio.AioRpcError:
            return -1

    def condition(self, pod: str) -> str | None:
        found = self.kube.pod_conditions(NS, pod).get(GATE)
        return found["status"] if found else None

    def lease_held(self) -> bool:
        lease = self.kube.lease(NS, LEASE_NAME) or {}
        return bool((lease.get("spec") or {}).get("holderIdentity"))

    async def settled(self, variant: Variant, within: float) -> float:
        """Every agent connected to the aggregator, every pod True (and the Lease held)."""
        count = len(self.agents)

        async def ready() -> bool:
            if variant.lease_seconds and not self.lease_held():
                return False
            if any(self.condition(agent.pod) != "True" for agent in self.agents):
                return False
            return await self.agents_connected() == count

        took = await self.until(ready, within, "every agent connected and every pod True")
        for agent in self.agents:
            assert agent.process is not None
            if not agent.metrics_port:
                found = ENDPOINT.search(agent.process.log_text())
                agent.metrics_port = int(found[1]) if found else 0
        return took

    async def metric(self, agent: Agent, name: str) -> float | None:
        if not agent.metrics_port:
            return None
        return await asyncio.to_thread(harness.metric_value, agent.metrics_port, name)

    # -- one trial -----------------------------------------------------------------------

    async def trial(self, variant: Variant, number: int, failing: Agent, after: Variant) -> Trial:
        """Fail ``failing``'s proxy and kill the aggregator; measure; restart it as ``after``."""
        kube, loop = self.kube, self.loop
        assert self.aggregator is not None
        assert failing.process is not None
        await asyncio.sleep(self.args.settle)  # PodViews of the aggregator's last writes sent
        waited_before = await self.metric(failing, WAITED) or 0.0
        mark = kube.checkpoint()
        load, beside = list(os.getloadavg()), other_benches()

        pids = {agent.pod: agent.process.pid for agent in self.agents if agent.process}
        cpu_before = {pod: cpu_seconds(pid) for pod, pid in pids.items()}
        failing.proxy.set(FAILING)
        killed, killed_wall = loop.time(), time.time()
        offset = killed_wall - killed
        self.aggregator.popen.kill()
        await asyncio.to_thread(self.aggregator.popen.wait, 10)
        self.aggregator.stop()  # (reaped: closes its log)
        lease_expiry = None
        if variant.lease_seconds:
            spec = (kube.lease(NS, LEASE_NAME) or {}).get("spec") or {}
            renewed = datetime.fromisoformat(str(spec["renewTime"])).timestamp()
            lease_expiry = renewed + float(spec["leaseDurationSeconds"]) - killed_wall

        def patches() -> list[ApiCall]:
            return [
                call
                for call in kube.requests("PATCH", resource="pods", name=failing.pod, since=mark)
                if bearer(call) == failing.token
            ]

        within = self.args.fallback_after + variant.lease_seconds * 2 + 60
        false_at = None

        async def written() -> bool:
            nonlocal false_at
            if false_at is None and self.condition(failing.pod) == "False":
                false_at = loop.time()
            return false_at is not None and bool(patches())

        started = loop.time()
        while not await written():
            if loop.time() - started > within:
                raise BenchError(
                    f"no write of {failing.pod} within {within:g}s of the kill\n"
                    f"{failing.process.tail()}"
                )
            await asyncio.sleep(POLL)
        assert false_at is not None
        first_write = patches()[0].at - killed
        cpu_used = {}
        for pod, pid in pids.items():
            before, now_cpu = cpu_before[pod], cpu_seconds(pid)
            if before is not None and now_cpu is not None:
                cpu_used[pod] = round(now_cpu - before, 2)
        healthy_cpu = [cpu for pod, cpu in cpu_used.items() if pod != failing.pod]
        await asyncio.sleep(self.args.hold)

        # What the agents did, before anything restarts.
        text = failing.process.log_text()
        step = time.time() - loop.time() - offset
        ended = first_after(text, STREAM_ENDED, killed_wall)
        began = first_after(text, FALLBACK_BEGAN, killed_wall)
        slots = SLOT.findall(text)
        waited_after = await self.metric(failing, WAITED)
        slot_s = await self.metric(failing, SLOT_SECONDS)
        failing_loaded = client_loaded(failing.process.pid)
        failing_rss = rss_mib(failing.process.pid)
        healthy = [agent for agent in self.agents if agent is not failing]
        loaded = [a.pod for a in healthy if a.process and client_loaded(a.process.pid)]
        rss = [rss_mib(a.process.pid) for a in healthy if a.process]
        healthy_began = sum(
            1
            for agent in healthy
            if agent.process and first_after(agent.process.log_text(), FALLBACK_BEGAN, killed_wall)
        )

        # Back: the failing pod's proxy healthy, its agent a fresh process, the aggregator up.
        failing.proxy.set(HEALTHY)
        await asyncio.to_thread(failing.process.stop)
        restarted = loop.time()
        await self.start_aggregator(after)
        self.spawn_agent(failing)
        await self.settled(after, within=self.args.lease_seconds_max * 3 + 90)
        back = loop.time() - restarted

        # Every request since the kill, by sender.
        calls = kube.requests(since=mark)
        tokens = {agent.token: agent for agent in self.agents}
        failing_calls = [c for c in calls if bearer(c) == failing.token]
        healthy_calls = [c for c in calls if bearer(c) in tokens and bearer(c) != failing.token]
        strays = [
            c
            for c in calls
            if bearer(c) not in tokens
            and any(
                k.lower() == "user-agent" and v.startswith("ray-serve-health-agent/")
                for k, v in c.headers.items()
            )
        ]
        aggregator_writes = [
            c
            for c in calls
            if not bearer(c)
            and c.method in ("PATCH", "POST", "PUT")
            and c.name == failing.pod
            and c.at < restarted
        ]
        by_kind: dict[str, int] = {}
        for call in failing_calls:
            sub = f"/{call.subresource}" if call.subresource else ""
            kind = f"{call.verb} {call.resource}{sub}"
            by_kind[kind] = by_kind.get(kind, 0) + 1
        healthy_by: dict[str, int] = {}
        for call in healthy_calls:
            who = bearer(call).removeprefix("bench-agent-")
            healthy_by[who] = healthy_by.get(who, 0) + 1
        lease_reads = [c for c in failing_calls if c.resource == "leases" and c.verb == "get"]
        events = [c for c in failing_calls if c.resource == "events"]
        lease_read = lease_reads[0].at - killed if lease_reads else None

        def since_kill(wall: float | None) -> float | None:
            if wall is None or abs(step) > CLOCK_STEP:
                return None
            return round(wall - killed_wall, 3)

        began_s = since_kill(began)
        return Trial(
            variant=variant.name,
            trial=number,
            pod=failing.pod,
            first_write_s=round(first_write, 3),
            condition_false_s=round(false_at - killed, 3),
            stream_ended_s=since_kill(ended),
            fallback_began_s=began_s,
            began_to_write_s=None if began_s is None else round(first_write - began_s, 3),
            budget_wait_s=(
                None if waited_after is None else round(waited_after - waited_before, 3)
            ),
            slot_s=slot_s if slot_s else (float(slots[-1][0]) if slots else None),
            fleet_size=int(slots[-1][1]) if slots else None,
            lease_seconds=variant.lease_seconds,
            lease_expiry_s=None if lease_expiry is None else round(lease_expiry, 3),
            write_from_expiry_s=(
                None if lease_expiry is None else round(first_write - lease_expiry, 3)
            ),
            lease_read_s=None if lease_read is None else round(lease_read, 3),
            write_from_lease_read_s=(
                None if lease_read is None else round(first_write - lease_read, 3)
            ),
            event_s=round(events[0].at - killed, 3) if events else None,
            failing_requests=by_kind,
            failing_patches=len(patches()),
            conflict_logged=bool(CONFLICT.search(text)),
            failing_client_loaded=failing_loaded,
            healthy_requests=len(healthy_calls),
            healthy_requests_by=healthy_by,
            healthy_client_loaded=loaded,
            healthy_fallback_logged=healthy_began,
            healthy_rss_mib_max=max((r for r in rss if r is not None), default=None),
            failing_rss_mib=failing_rss,
            failing_cpu_s=cpu_used.get(failing.pod),
            healthy_cpu_s=statistics.median(healthy_cpu) if healthy_cpu else None,
            other_requests=len(strays),
            aggregator_writes_after_kill=len(aggregator_writes),
            load_average=[round(x, 2) for x in load],
            beside=beside,
            back_s=round(back, 2),
            clock_step_s=round(step, 3),
        )

    async def stop(self) -> None:
        processes = [a.process for a in self.agents if a.process is not None]
        if self.aggregator is not None:
            processes.append(self.aggregator)
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))
        for agent in self.agents:
            await agent.proxy.stop()


# -- the run -----------------------------------------------------------------------------------


def variants_of(args: argparse.Namespace) -> list[Variant]:
    chosen = []
    for name in args.variants.split(","):
        if name == "a":
            chosen.append(Variant("a"))
        elif name == "b":
            chosen += [Variant(f"b-{s}s", s) for s in args.lease_durations]
        else:
            raise SystemExit(f"unknown variant {name!r}: a or b")
    return chosen


async def run(args: argparse.Namespace, log_dir: Path) -> list[Trial]:
    plan = [(variant, n) for variant in variants_of(args) for n in range(1, args.trials + 1)]
    trials: list[Trial] = []
    async with KubeEmulator() as kube, kmock.Server(kube):
        bench = Bench(args, kube, log_dir)
        try:
            await bench.start_fleet(plan[0][0])
            for index, (variant, number) in enumerate(plan):
                after = plan[index + 1][0] if index + 1 < len(plan) else variant
                failing = bench.agents[index % len(bench.agents)]
                trial = await bench.trial(variant, number, failing, after)
                trials.append(trial)
                lease = (
                    f", Lease expired {trial.lease_expiry_s:.2f}s, read {trial.lease_read_s}s"
                    if variant.lease_seconds
                    else ""
                )
                print(
                    f"  {variant.name} #{number} ({failing.pod}): stream ended "
                    f"{trial.stream_ended_s}s, fallback began {trial.fallback_began_s}s{lease}, "
                    f"first write {trial.first_write_s:.2f}s, condition False "
                    f"{trial.condition_false_s:.2f}s, slot wait {trial.budget_wait_s}s; "
                    f"healthy agents: {trial.healthy_requests} requests, client loaded in "
                    f"{len(trial.healthy_client_loaded)}; load {trial.load_average[0]:.2f}"
                    + (f", beside {len(trial.beside)} other run(s)" if trial.beside else "")
                    + (
                        f"; WALL CLOCK MOVED {trial.clock_step_s:+.2f}s against the monotonic "
                        "clock: log times left out"
                        if abs(trial.clock_step_s) > CLOCK_STEP
                        else ""
                    ),
                    flush=True,
                )
        finally:
            await bench.stop()
            await kube.close()
    return trials


def summary(trials: Sequence[Trial], key: str) -> dict[str, float | None]:
    values = [getattr(t, key) for t in trials if getattr(t, key) is not None]
    if not values:
        return {"median": None, "max": None, "min": None}
    return {
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "min": round(min(values), 3),
    }


COLUMNS = (
    ("first_write_s", "first write"),
    ("condition_false_s", "cond. False"),
    ("fallback_began_s", "fb began"),
    ("began_to_write_s", "began->write"),
    ("budget_wait_s", "slot wait"),
    ("failing_cpu_s", "agent CPU"),
    ("lease_expiry_s", "Lease expiry"),
    ("write_from_expiry_s", "write-expiry"),
    ("lease_read_s", "Lease read"),
    ("write_from_lease_read_s", "write-read"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=12, help="pods, one sidecar each (12)")
    parser.add_argument("--trials", type=int, default=5, help="trials per variant (5)")
    parser.add_argument(
        "--variants", default="a,b", help="a: no --leader-elect; b: --leader-elect (a,b)"
    )
    parser.add_argument(
        "--lease-durations",
        default=str(int(AggregatorFlags.leader_elect_lease_duration)),
        help="variant b's Lease durations in whole seconds, comma-separated (the aggregator's "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--renew-deadline",
        type=float,
        default=AggregatorFlags.leader_elect_renew_deadline,
        help="the aggregator's --leader-elect-renew-deadline in seconds (%(default)s)",
    )
    parser.add_argument(
        "--fallback-after", type=float, default=3.0, help="the agents' --fallback-after (3)"
    )
    parser.add_argument("--interval", default="", help="the agents' --interval (their default)")
    parser.add_argument(
        "--probe-timeout", default="", help="the agents' --probe-timeout (their default)"
    )
    parser.add_argument(
        "--pin", default="", help="run the agents under taskset -c PIN (e.g. 0: one core)"
    )
    parser.add_argument(
        "--hold", type=float, default=5.0, help="seconds of outage after the write (5)"
    )
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds of steady state before a kill (1)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    args.lease_durations = [int(s) for s in args.lease_durations.split(",") if s]
    args.lease_seconds_max = max(args.lease_durations, default=0)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    load_before = os.getloadavg()
    beside = other_benches()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-fallback-first-write-"))
    variants = variants_of(args)
    print(
        f"fallback_first_write: {args.pods} sidecars, --fallback-after {args.fallback_after:g}s, "
        f"{args.trials} trials of {', '.join(v.name for v in variants)}, agents "
        f"{'pinned to CPU ' + args.pin if args.pin else 'not pinned'}; logs in {log_dir} "
        f"(load average {load_before[0]:.2f} on {os.cpu_count()} CPUs)",
        flush=True,
    )
    for line in beside:
        print(f"  running beside: {line}", flush=True)
    try:
        trials = asyncio.run(run(args, log_dir))
    except (BenchError, harness.HarnessError, AssertionError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()
    beside_after = other_benches()
    target = args.fallback_after + TARGET_MARGIN

    print()
    header = "".join(f"{title:>14}" for _, title in COLUMNS)
    print(f"{'variant':>8} {'':>6}{header}")
    results: dict[str, Any] = {}
    for variant in variants:
        chosen = [t for t in trials if t.variant == variant.name]
        stats = {key: summary(chosen, key) for key, _ in COLUMNS}
        results[variant.name] = {
            "lease_seconds": variant.lease_seconds,
            **stats,
            "healthy_requests": sum(t.healthy_requests for t in chosen),
            "healthy_client_loaded": sum(len(t.healthy_client_loaded) for t in chosen),
            "failing_requests": [t.failing_requests for t in chosen],
        }
        for which in ("median", "max"):
            cells = "".join(
                f"{'-' if stats[key][which] is None else format(stats[key][which], '.2f'):>14}"
                for key, _ in COLUMNS
            )
            print(f"{variant.name:>8} {which:>6}{cells}")
    print("(seconds from the SIGKILL; write-expiry: from the Lease's last renewTime + duration;")
    print(" write-read: from the failing agent's first GET of the Lease; slot wait: the agent's")
    print(" fallback_api_wait_seconds_total over the trial; agent CPU: the failing agent's CPU")
    print(" time from the kill to the write)")
    healthy = sum(t.healthy_requests for t in trials)
    healthy_loaded = sum(len(t.healthy_client_loaded) for t in trials)
    strays = sum(t.other_requests for t in trials)
    marker_ok = all(t.failing_client_loaded for t in trials)
    verdict = {}
    if "a" in results:
        worst = results["a"]["first_write_s"]["max"]
        median = results["a"]["first_write_s"]["median"]
        verdict = {"median_s": median, "max_s": worst, "met": worst <= target}
        print(
            f"\nvariant a: first write median {median:.2f}s, max {worst:.2f}s; target <= "
            f"--fallback-after + {TARGET_MARGIN:g}s = {target:g}s: "
            f"{'met' if verdict['met'] else 'MISSED'}"
        )
    print(
        f"healthy agents: {healthy} API requests after the kills (expected 0), the Kubernetes "
        f"client loaded in {healthy_loaded} healthy sidecar(s) (expected 0; the failing agents "
        f"{'all' if marker_ok else 'NOT all'} show it loaded: the check sees it); requests by "
        f"an agent with an unknown token: {strays}"
    )
    steps = [t.clock_step_s for t in trials if abs(t.clock_step_s) > CLOCK_STEP]
    if steps:
        print(
            f"the wall clock moved against the monotonic one in {len(steps)} trial(s) "
            f"({', '.join(f'{x:+.2f}s' for x in steps)}): their log times are left out"
        )
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
        + (f"; beside: {len(beside)} other bench(es) at the start" if beside else "")
    )

    result = {
        "benchmark": "fallback_first_write",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "code": harness.code_version(exclude=["bench/results"]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "other_benches_at_start": beside,
        "other_benches_at_end": beside_after,
        "settings": {
            "pods": args.pods,
            "sidecars": args.pods,
            "fallback_after_s": args.fallback_after,
            "agent_interval": args.interval or f"{AgentFlags.interval:g}s (agent default)",
            "agent_probe_timeout": args.probe_timeout
            or f"{AgentFlags.probe_timeout:g}s (agent default)",
            "agents_pinned_to_cpu": args.pin or None,
            "fleet_api_budget_per_s": DEFAULT_FLEET_BUDGET,
            "requests_per_slot": PER_SLOT,
            "expected_slot_s": PER_SLOT * args.pods / DEFAULT_FLEET_BUDGET,
            "lease_durations_s": args.lease_durations,
            "renew_deadline_s": args.renew_deadline,
            "hold_s": args.hold,
            "proxy_fails": "503, microseconds before the SIGKILL; times from the kill",
            "aggregator": "--kube-backend kubernetes --mode condition --agent-fallback on",
        },
        "unit": "seconds after SIGKILL of the aggregator",
        "notes": [
            "first_write_s: arrival at the emulator of the failing agent's first PATCH of its "
            "pod's status; condition_false_s: the stored condition seen False (polled, 10 ms)",
            "failing_cpu_s: CPU time (user + system) the failing agent used from the kill until "
            "its write was seen; healthy_cpu_s: the healthy agents' median over the same time",
            "fallback_began_s, stream_ended_s: the failing agent's log lines (wall clock, "
            "milliseconds); None in a trial whose wall clock moved against the monotonic one by "
            f"more than {CLOCK_STEP:g}s (clock_step_s: a clock step, or the machine paused); every "
            "other figure is on the monotonic clock",
            "began_to_write_s (variant a): loading the writer (import node_agent.fallback.writer, "
            "then kubernetes.client.CoreV1Api on the client's creation, both in a thread), the "
            "budget's slot wait (budget_wait_s) and the PATCH",
            "variant b: the agent logs fallback began once the Lease gate opens, just before the "
            "write; lease_read_s is its first GET of the Lease (after --fallback-after and the "
            "writer's loading), and a Lease first seen counts as renewed for a whole duration "
            "from that read (node_agent/fallback/lease_gate.py)",
        ],
        "target_s": target,
        "target_variant_a": verdict,
        "variants": results,
        "healthy_requests": healthy,
        "healthy_client_loaded": healthy_loaded,
        "client_check_sees_failing_agents": marker_ok,
        "clock_steps_s": steps,
        "trials": [dataclasses.asdict(t) for t in trials],
        "log_dir": str(log_dir),
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 1 if healthy or healthy_loaded or strays else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
