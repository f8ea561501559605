"""Run every benchmark, one after another, and print where each figure stands against its
target. Each scenario is its own module (and can be run alone, with its own options):

    python -m bench                 # everything, with the issues' sizes (about 80 minutes)
    python -m bench --quick         # small sizes, a couple of minutes: a smoke run, not figures
    python -m bench --only ingest,detection

Scenarios: ingest (N agents vs one aggregator core), detection (proxy failure -> label write),
pull_sweep (pull fallback vs the seed's sequential design), kube_writes (API writes in steady
state, under flapping, at the rate limit), agent_footprint (one agent's CPU and RSS),
shutdown_detection (real Ray Serve: serve.shutdown() -> out of SERVING), flood (the
aggregator's memory under thousands of half-open connections, and how soon it closes them),
failover (two aggregators with leader election: SIGKILL the leader, time until the standby
serves and the agents are back, spurious writes; ``--api-latency p99-1s --quiet 600`` also
counts leadership losses on a slow API), leader_churn_sim (the leader election's own code on a
simulated clock against a slow API: leadership losses per hour for several timings),
panic_trials (self-protection's randomized
trials on a simulated clock), mass_hang (75 % of 1,000 proxies hang: label writes during it,
time until PANIC), fallback_storm (11,000 simulated agents lose the aggregator at once: API
requests per second while they fall back, within the fleet's budget), liveness (SIGKILL,
SIGSTOP, black-holed or stalled agents: time until
the aggregator's GetPod shows the agent gone and the pod pulled), endpoints (issue 27: who
decides the traffic, read at the serve Service's endpoints on the emulator's kubelet and
EndpointSlices, with KubeRay's injected readiness probe and with the documented one: lone 503
and hang, a 75 % hang, a HeadOnly worker, a dead raylet), fallback_first_write (12
real sidecars: SIGKILL the aggregator as one pod's proxy fails, time until that sidecar's own
write lands, with and without the Lease gate; the healthy sidecars' API requests), baseline
(ours next to KubeRay's readiness cadence and the seed's sequential pass, as ratios). Each
writes bench/results/<name>.json; this command also writes bench/results/summary.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testsupport import harness

RESULTS = harness.REPO_ROOT / "bench" / "results"

#: name -> (full arguments, quick arguments)
SCENARIOS: dict[str, tuple[list[str], list[str]]] = {
    "ingest": (["--find-max"], ["--agents", "300", "--duration", "5", "--warmup", "2"]),
    "detection": ([], ["--flips", "8", "--agents", "8", "--kinds", "503"]),
    "pull_sweep": ([], ["--pods", "200", "--seed-pods", "20"]),
    "kube_writes": (
        [],
        [
            "--steady-pods",
            "100",
            "--steady-rounds",
            "5",
            "--flap-seconds",
            "3",
            "--mass-pods",
            "60",
        ],
    ),
    "agent_footprint": ([], ["--duration", "20"]),
    "shutdown_detection": ([], ["--runs", "1"]),
    "flood": ([], ["--sizes", "1000", "--no-reap"]),
    "failover": ([], ["--kills", "2", "--pods", "10", "--steady", "1"]),
    "leader_churn_sim": ([], ["--hours", "1"]),
    "panic_trials": ([], ["--seeds", "50"]),
    "mass_hang": ([], ["--pods", "100", "--trials", "1"]),
    "liveness": ([], ["--rounds", "2", "--simulated-agents", "1000", "--real-agents", "2"]),
    "endpoints": (
        [],
        [
            *("--pods", "4", "--trials", "1", "--raylet-trials", "1", "--mass-trials", "1"),
            *("--mass-window", "5", "--observe", "2", "--headonly-observe", "1"),
            *("--kubelet-time-scale", "0.2"),
        ],
    ),
    "fallback_storm": (
        [],
        [
            *("--sidecars", "200", "--nodes", "20", "--failing", "0.1"),
            *("--connected", "2", "--renewed-for", "15", "--duration", "30"),
        ],
    ),
    "fallback_first_write": ([], ["--pods", "3", "--trials", "1", "--variants", "a"]),
    "baseline": ([], []),  # last: reads detection and pull_sweep results
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    args = parser.parse_args()
    chosen = [name for name in SCENARIOS if not args.only or name in args.only.split(",")]
    summary: dict[str, object] = {}
    for name in chosen:
        full, quick = SCENARIOS[name]
        command = [sys.executable, "-m", f"bench.{name}", *(quick if args.quick else full)]
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.call(command, cwd=harness.REPO_ROOT)
        result_file = RESULTS / f"{name}.json"
        summary[name] = {
            "exit_code": code,
            "seconds": round(time.monotonic() - started, 1),
            "result": json.loads(result_file.read_text()) if result_file.exists() else None,
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'summary.json'}")
    failed = [name for name, entry in summary.items() if entry["exit_code"]]  # type: ignore[index]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
