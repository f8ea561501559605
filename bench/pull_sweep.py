"""How long does one full pull sweep of 2,000 pods take, against the seed's sequential design?

One fake fleet for both sides, in a subprocess of its own: 2,000 aiohttp ``FakeServeProxy``
servers on 127.0.0.1 (every 20th one accepts and never answers: 5 % hung) and the Kubernetes
API emulator (kmock) listing them as Ray pods (``status.podIP`` 127.0.0.1, container port
``serve``), every pod labelled ``ray.io/serve=true`` (a fleet that was serving; 5 % just hung).
The measured side, in this process:

- **ours**: the real aggregator (``aggregator.server.Aggregator`` on the emulator, default
  settings but a startup grace and pull interval long enough that its own loop stays out of
  the way) and ``Puller.pull_now`` of every pod, awaited: bounded concurrency, ``--pull-timeout``
  per probe, a failure confirmed by a second probe. A first sweep meets every failure for the
  first time (a hung pod costs one timeout when its hedged second probe goes unanswered too and
  the loop keeps time, up to timeout + confirm delay + timeout otherwise): ``--first-sweeps`` of
  them, each by a
  freshly started aggregator, then ``--repeats`` "steady" sweeps by the last one, which already
  knows the hung pods (nothing needs confirming). The event loop is the one the aggregator's
  command line runs on (``--loop``); sweeps are timed with ``time.perf_counter``.
- **seed**: KubeRay's first design (PR #367): list the pods, then GET each pod's ``/-/healthz``
  one after another, 2 s timeout each, no concurrency.

With two or more CPUs the measured side is pinned to the first and the fleet to the second
(``os.sched_setaffinity``), so the servers never compete with the puller for a core. Loopback
only; the fleet exits when this process closes its stdin (or after a hard deadline) and is
killed if it does not.

Run from the repository root::

    python -m bench.pull_sweep                  # the full run (the seed pass takes ~3.5 min)
    python -m bench.pull_sweep --seed-pods 200  # quick check: the seed pass is extrapolated

Prints a table and writes bench/results/pull_sweep.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import procstat
from testsupport import harness

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "pull_sweep.json"
NAMESPACE = "ray"
LOOPBACK = "127.0.0.1"  # every pod address; nothing else is ever probed
LABEL = "ray.io/serve"
READY = "FLEET-READY "
FLEET_START_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0

T = TypeVar("T")


def pod_name(index: int) -> str:
    return f"ray-worker-{index:05d}"


def is_hung(index: int, hung_every: int) -> bool:
    """Every ``hung_every``-th pod hangs, spread evenly (none waits at the end of the line)."""
    return hung_every > 0 and index % hung_every == hung_every // 2


def pin(cpu: int | None) -> str:
    """Pin this process (and the threads it starts later) to ``cpu``; say what was done."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return "not pinned"
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the fleet (subprocess) ------------------------------------------------------------------


async def serve_fleet(count: int, hung_every: int, workdir: Path, lifetime: float) -> None:
    """Start the proxies and the emulator, print where they are, serve until stdin closes."""
    import kmock

    from testsupport.fakes import FakeServeProxy
    from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator

    loop = asyncio.get_running_loop()
    proxies = [FakeServeProxy(host=LOOPBACK, hang=is_hung(i, hung_every)) for i in range(count)]
    try:
        for start in range(0, count, 250):
            await asyncio.gather(*(proxy.start() for proxy in proxies[start : start + 250]))
        async with KubeEmulator() as kube, kmock.Server(kube):
            try:
                for index, proxy in enumerate(proxies):
                    kube.add_pod(
                        NAMESPACE,
                        pod_name(index),
                        labels={**DEFAULT_POD_LABELS, LABEL: "true"},
                        pod_ip=LOOPBACK,
                        serve_port=proxy.port,
                    )
                kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig", NAMESPACE)
                ready = {
                    "kubeconfig": str(kubeconfig),
                    "pods": [[pod_name(i), p.port, p.hang] for i, p in enumerate(proxies)],
                }
                print(READY + json.dumps(ready), flush=True)
                closed = asyncio.Event()

                def on_stdin() -> None:
                    if not os.read(sys.stdin.fileno(), 4096):
                        closed.set()

                loop.add_reader(sys.stdin.fileno(), on_stdin)
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(closed.wait(), lifetime)
                finally:
                    loop.remove_reader(sys.stdin.fileno())
            finally:
                await kube.close()
    finally:
        for start in range(0, count, 250):
            await asyncio.gather(*(proxy.stop() for proxy in proxies[start : start + 250]))


def fleet_main(args: argparse.Namespace) -> int:
    where = pin(args.cpu)
    procstat.raise_fd_limit()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # The fleet is scenery: the fastest loop available, so it keeps up with the measured side.
    name, run = event_loop("uvloop")
    print(f"fleet: pid {os.getpid()}, {where}, loop {name}", file=sys.stderr, flush=True)
    run(serve_fleet(args.pods, args.hung_every, Path(args.workdir), args.lifetime))
    return 0


def event_loop(choice: str) -> tuple[str, Callable[[Coroutine[Any, Any, T]], T]]:
    """``(name, run)`` for an event loop: ``asyncio``, ``uvloop`` (asyncio if not installed),
    or ``product``: whatever the aggregator's own command line runs on."""
    if choice == "product":
        try:
            from servehealth_common import runtime
        except ImportError:  # a checkout whose CLI runs plain asyncio.run
            return "asyncio", asyncio.run
        return runtime.loop_name(), runtime.run
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            return "asyncio", asyncio.run
        return "uvloop", uvloop.run
    return "asyncio", asyncio.run


@dataclass
class Fleet:
    """The fleet subprocess, seen from the measured side."""

    process: subprocess.Popen[bytes]
    kubeconfig: str
    pods: list[tuple[str, int, bool]]  # name, port, hung

    @classmethod
    def start(
        cls, count: int, hung_every: int, cpu: int | None, workdir: Path, lifetime: float
    ) -> Fleet:
        command = [
            sys.executable, "-m", "bench.pull_sweep", "--fleet-child",
            "--pods", str(count), "--hung-every", str(hung_every),
            "--workdir", str(workdir), "--lifetime", str(lifetime),
        ]  # fmt: skip
        if cpu is not None:
            command += ["--cpu", str(cpu)]
        stderr = (workdir / "fleet.log").open("wb")
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        stderr.close()
        # Kill a fleet that does not come up in time (readline below would wait forever).
        watchdog = threading.Timer(FLEET_START_TIMEOUT, process.kill)
        watchdog.start()
        try:
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.decode(errors="replace")
                if line.startswith(READY):
                    ready = json.loads(line[len(READY) :])
                    pods = [(name, int(port), bool(hung)) for name, port, hung in ready["pods"]]
                    return cls(process, ready["kubeconfig"], pods)
            raise RuntimeError(f"the fleet exited ({process.wait()}); see {workdir}/fleet.log")
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            watchdog.cancel()

    def stop(self) -> int:
        """Close its stdin (it stops by itself), kill it if it does not."""
        try:
            return harness.stop_child(self.process, STOP_TIMEOUT)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


# -- ours: the aggregator's Puller -----------------------------------------------------------


@dataclass
class Sweep:
    seconds: float
    cpu_seconds: float  # measured side (this process, all threads)
    fleet_cpu_seconds: float
    states: dict[str, int]
    wrong: int  # pods whose state is not what their proxy does (SERVING / UNHEALTHY)


async def measure_ours(
    fleet: Fleet, pull_timeout: float, repeats: int, concurrency: int | None = None
) -> tuple[list[Sweep], dict[str, Any]]:
    """A fresh aggregator: its first sweep (every pod new to it), then ``repeats`` more."""
    from aggregator.flags import AggregatorFlags
    from aggregator.wiring import build_aggregator
    from servehealth_common.pod_identity import PodKey
    from servehealth_common.states import ServeState

    settings = AggregatorFlags(
        listen=f"{LOOPBACK}:0",
        metrics_listen="",
        kube_backend="kubernetes",
        kubeconfig=fleet.kubeconfig,
        namespace=(NAMESPACE,),
        pull_timeout=pull_timeout,
        # Nothing but the sweeps below pulls: the aggregator's own pull loop sits out the
        # startup grace (no agent ever connects, so every pod stays in pure-pull mode).
        startup_grace=3600,
        pull_interval=3600,
        log_level="warning",
        **({"pull_concurrency": concurrency} if concurrency else {}),
    )
    aggregator = build_aggregator(settings)
    await aggregator.start()
    sweeps: list[Sweep] = []
    try:
        puller = aggregator.puller
        assert puller is not None
        used = {
            "pull_timeout_s": settings.pull_timeout,
            "pull_concurrency": settings.pull_concurrency,
            "confirm_delay_s": puller.settings.confirm_delay,
            "failure_threshold": settings.failure_threshold,
        }
        keys = [PodKey(NAMESPACE, name) for name, _, _ in fleet.pods]
        missing = [key for key in keys if aggregator.core.pod(key) is None]
        if missing:
            raise RuntimeError(f"{len(missing)} pods not discovered, e.g. {missing[0]}")
        for key, (_, port, _) in zip(keys, fleet.pods, strict=True):
            if puller.url(key) != f"http://{LOOPBACK}:{port}/-/healthz":  # loopback only
                raise RuntimeError(f"unexpected pull address for {key}: {puller.url(key)}")
        expected = {
            key: ServeState.UNHEALTHY if hung else ServeState.SERVING
            for key, (_, _, hung) in zip(keys, fleet.pods, strict=True)
        }
        for number in range(repeats + 1):
            cpu, fleet_cpu = time.process_time(), cpu_seconds(fleet.process.pid)
            started = time.perf_counter()  # uvloop's loop.time() has 1 ms steps
            await asyncio.gather(*puller.pull_now(keys))
            elapsed = time.perf_counter() - started
            cpu, fleet_cpu = time.process_time() - cpu, cpu_seconds(fleet.process.pid) - fleet_cpu
            states: Counter[str] = Counter()
            wrong = 0
            for key in keys:
                record = aggregator.core.pod(key)
                state = record.state if record is not None else None
                states[state.name if state else "GONE"] += 1
                wrong += state is not expected[key]
            sweeps.append(
                Sweep(round(elapsed, 4), round(cpu, 3), round(fleet_cpu, 3), dict(states), wrong)
            )
            kind = "first" if number == 0 else "steady"  # of this aggregator
            print(
                f"  ours, {kind} sweep: {elapsed:.3f}s  (measured side {cpu:.2f} CPU-s, fleet "
                f"{fleet_cpu:.2f} CPU-s; {dict(states)}; wrong {wrong})",
                flush=True,
            )
            # Let the label writes of the pods that turned UNHEALTHY happen between sweeps
            # (after self-protection's look), not during the next one.
            await asyncio.sleep(0.5 + settings.pull_timeout)
            writer = getattr(aggregator.registry, "writer", None)
            deadline = time.monotonic() + 60
            while writer is not None and writer.pending and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await aggregator.stop()
    return sweeps, used


# -- the seed's design: list, then one GET after another ------------------------------------


@dataclass
class SeedPass:
    pods: int  # probed (all, or a sample with the fleet's share of hung pods)
    hung: int  # of those, hung
    list_seconds: float
    gets_seconds: float
    healthy_get_seconds: float  # mean GET time of a pod that answers
    hung_get_seconds: float  # mean GET time of a hung pod (the timeout)
    serving: int
    failed: int

    def full_pass(self, pods: int, hung: int) -> float:
        """The whole fleet's pass: measured if every pod was probed, else from the means."""
        if self.pods >= pods:
            return self.list_seconds + self.gets_seconds
        healthy_part = (pods - hung) * self.healthy_get_seconds
        return self.list_seconds + healthy_part + hung * self.hung_get_seconds


def seed_sample(pods: list[tuple[str, int, bool]], count: int) -> set[str]:
    """``count`` pod names with the fleet's share of hung pods (all of them for the whole)."""
    if count >= len(pods):
        return {name for name, _, _ in pods}
    hung_total = sum(hung for _, _, hung in pods)
    want_hung = max(1, round(count * hung_total / len(pods))) if hung_total else 0
    hung = [name for name, _, is_hung in pods if is_hung][:want_hung]
    healthy = [name for name, _, is_hung in pods if not is_hung][: count - len(hung)]
    return set(hung) | set(healthy)


async def measure_seed(fleet: Fleet, pods: int, get_timeout: float) -> SeedPass:
    """List the pods, then GET each one's /-/healthz in turn, ``get_timeout`` each."""
    import aiohttp
    import kubernetes

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=fleet.kubeconfig, client_configuration=configuration
    )
    with kubernetes.client.ApiClient(configuration) as client:
        api = kubernetes.client.CoreV1Api(client)
        started = time.monotonic()
        listed = api.list_namespaced_pod(NAMESPACE, label_selector="ray.io/node-type")
        list_seconds = time.monotonic() - started
    sample = seed_sample(fleet.pods, pods)
    hung_names = {name for name, _, hung in fleet.pods if hung}
    targets = []
    for pod in sorted(listed.items, key=lambda p: p.metadata.name):
        if pod.metadata.name not in sample:
            continue
        port = next(
            p.container_port
            for c in pod.spec.containers
            for p in c.ports or ()
            if p.name == "serve"
        )
        if pod.status.pod_ip != LOOPBACK:
            raise RuntimeError(f"unexpected pod address {pod.status.pod_ip}")
        url = f"http://{pod.status.pod_ip}:{port}/-/healthz"
        targets.append((url, pod.metadata.name in hung_names))
    serving = failed = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        started = time.monotonic()
        for url, hung in targets:  # one after another: the seed's design
            began = time.monotonic()
            try:
                async with asyncio.timeout(get_timeout), session.get(url) as response:
                    body = await response.text()
                    ok = response.status == 200 and body.strip() == "success"
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            times[hung].append(time.monotonic() - began)
            serving += ok
            failed += not ok
        gets_seconds = time.monotonic() - started
    return SeedPass(
        pods=len(targets),
        hung=len(times[True]),
        list_seconds=list_seconds,
        gets_seconds=gets_seconds,
        healthy_get_seconds=statistics.fmean(times[False]) if times[False] else 0.0,
        hung_get_seconds=statistics.fmean(times[True]) if times[True] else get_timeout,
        serving=serving,
        failed=failed,
    )


# -- the run ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=2000, help="fleet size (default 2000)")
    parser.add_argument(
        "--hung-every", type=int, default=20, help="every N-th proxy hangs (default 20: 5 %%)"
    )
    parser.add_argument(
        "--seed-pods",
        type=int,
        default=None,
        help="pods the seed pass probes (default: all); a smaller sample keeps the fleet's "
        "share of hung pods and is extrapolated to the whole fleet",
    )
    parser.add_argument("--pull-timeout", type=float, default=0.5, help="ours (default 0.5 s)")
    parser.add_argument("--seed-timeout", type=float, default=2.0, help="seed (default 2 s)")
    parser.add_argument(
        "--pull-concurrency", type=int, default=None, help="ours (default: the product's)"
    )
    parser.add_argument(
        "--first-sweeps",
        type=int,
        default=3,
        help="first sweeps, each by a freshly started aggregator (default 3)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="steady sweeps after the last first one (default 3)"
    )
    parser.add_argument("--target", type=float, default=1.5, help="sweep target (default 1.5 s)")
    parser.add_argument(
        "--loop",
        choices=("product", "asyncio", "uvloop"),
        default="product",
        help="event loop of the measured side (default: the one the aggregator's CLI uses)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    # The fleet subprocess runs this module too.
    parser.add_argument("--fleet-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fleet_child:
        return fleet_main(args)

    seed_pods = min(args.seed_pods or args.pods, args.pods)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = len(cpus) >= 2 and not args.no_pin
    measured_cpu, fleet_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    where = pin(measured_cpu)
    procstat.raise_fd_limit()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    hung = sum(is_hung(i, args.hung_every) for i in range(args.pods))
    loop_name, run = event_loop(args.loop)
    print(
        f"pull sweep: {args.pods} pods, {hung} hung ({hung / args.pods:.0%}), loopback only; "
        f"measured side pid {os.getpid()} {where} ({loop_name} loop), fleet "
        f"{f'pinned to CPU {fleet_cpu}' if pinned else 'not pinned'} "
        f"({len(cpus) or os.cpu_count()} CPUs available)",
        flush=True,
    )
    load_before = round(os.getloadavg()[0], 2)
    started = time.monotonic()
    # The seed pass waits seed_timeout for each hung pod; give the fleet room for all of it.
    lifetime = 600 + seed_pods * args.seed_timeout + args.pods * 0.05
    with tempfile.TemporaryDirectory(prefix="pull-sweep-") as workdir:
        fleet = Fleet.start(args.pods, args.hung_every, fleet_cpu, Path(workdir), lifetime)
        print(f"fleet ready (pid {fleet.process.pid}) after {time.monotonic() - started:.1f}s")
        try:
            firsts: list[Sweep] = []
            count = max(args.first_sweeps, 1)
            for number in range(count):
                repeats = args.repeats if number == count - 1 else 0
                sweeps, used = run(
                    measure_ours(fleet, args.pull_timeout, repeats, args.pull_concurrency)
                )
                firsts.append(sweeps[0])
            print(f"  seed pass over {seed_pods} pods, one after another ...", flush=True)
            seed = run(measure_seed(fleet, seed_pods, args.seed_timeout))
        finally:
            code = fleet.stop()
        print(f"fleet stopped (exit code {code})")
    load_after = round(os.getloadavg()[0], 2)

    steady = sweeps[1:]
    first_median = statistics.median(s.seconds for s in firsts)
    steady_median = statistics.median(s.seconds for s in steady) if steady else None
    wrong = sum(s.wrong for s in firsts) + sum(s.wrong for s in steady)
    seed_total = seed.full_pass(args.pods, hung)
    extrapolated = seed.pods < args.pods
    print()
    print(f"full sweep of {args.pods} pods, {hung} hung (seconds)")
    print(f"{'design':<44} {'sweep':>9} {'seed / this':>12}")
    rows = [(f"ours, first sweep (median of {len(firsts)})", first_median)]
    if steady_median is not None:
        rows.append((f"ours, steady sweep (median of {len(steady)})", steady_median))
    seed_label = f"seed: list + sequential GETs, {args.seed_timeout:g} s timeout"
    for label, seconds in rows:
        print(f"{label:<44} {seconds:>9.3f} {seed_total / seconds:>11.0f}x")
    note = f" (extrapolated from {seed.pods} pods, {seed.hung} hung)" if extrapolated else ""
    print(f"{seed_label:<44} {seed_total:>9.1f} {'1x':>12}{note}")
    print(
        "first sweeps: "
        + ", ".join(f"{s.seconds:.3f}" for s in firsts)
        + " s; steady sweeps: "
        + ", ".join(f"{s.seconds:.3f}" for s in steady)
        + " s"
    )
    verdict = "meets" if first_median < args.target else "MISSES"
    print(
        f"first sweep (median) {verdict} the {args.target:g} s target; pods in a wrong state "
        f"after any sweep: {wrong}; load average before/after: {load_before} / {load_after}"
    )

    result = {
        "benchmark": "pull_sweep",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": len(cpus) or os.cpu_count(),
        "measured_loop": loop_name,
        "load_average_1m": {"before": load_before, "after": load_after},
        "pinning": (
            {"measured_cpu": measured_cpu, "fleet_cpu": fleet_cpu} if pinned else "not pinned"
        ),
        "fleet": {"pods": args.pods, "hung": hung, "address": LOOPBACK},
        "ours": {
            **used,
            "first_sweeps_s": [s.seconds for s in firsts],
            "first_median_s": first_median,
            "steady_sweeps_s": [s.seconds for s in steady],
            "steady_median_s": steady_median,
            "first_sweeps": [s.__dict__ for s in firsts],
            "steady_sweeps": [s.__dict__ for s in steady],
            "wrong_states": wrong,
            "target_s": args.target,
            "meets_target": first_median < args.target,
        },
        "seed": {
            "timeout_s": args.seed_timeout,
            "pods_probed": seed.pods,
            "hung_probed": seed.hung,
            "list_s": round(seed.list_seconds, 4),
            "gets_s": round(seed.gets_seconds, 3),
            "healthy_get_mean_s": round(seed.healthy_get_seconds, 6),
            "hung_get_mean_s": round(seed.hung_get_seconds, 4),
            "serving": seed.serving,
            "failed": seed.failed,
            "full_pass_s": round(seed_total, 3),
            "extrapolated": extrapolated,
        },
        "ratio_seed_over_ours_first": round(seed_total / first_median, 1),
        "ratio_seed_over_ours_steady": (
            round(seed_total / steady_median, 1) if steady_median else None
        ),
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
