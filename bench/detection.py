"""Detection, end to end: real agent processes on fake Serve proxies, a real aggregator
process, the Kubernetes API emulator. A proxy flips to failing; we time how long until the
emulator receives the label write (``false``), p50/p99 over ``--flips`` flips (default 104).

Two kinds of failure, measured separately:

- ``503``: the proxy answers ``503 No replicas are available yet.`` (NOT_READY) - a pod
  answering for itself, written at once;
- ``hang``: the proxy stops answering (UNHEALTHY) - a suspect failure: the pod leaves service
  once a look at the other pods in service shows the failure is not a mass one (README,
  "Self-protection"). Pods carry their address (127.0.0.1 and their proxy's port), as on
  Kubernetes, so the aggregator can look.

Each round flips ``--per-round`` of the 20 pods (8 by default: 40 %, under the PANIC threshold;
1 for a lone failure), waits for their labels to go ``false``, heals them, and waits for
``true`` again. Targets (issues 5 and 12): p99 <= 1.5 s with default settings. Writes
bench/results/detection.json.

    python -m bench.detection [--flips 104] [--agents 20] [--per-round 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kmock

from testsupport import harness
from testsupport.fakes import HEALTHY, NO_REPLICAS, FakeServeProxy
from testsupport.kube.emulator import KubeEmulator

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "detection.json"
LABEL = "ray.io/serve"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def wait_labels(kube: KubeEmulator, names: list[str], value: str, within: float) -> None:
    await kube.wait_until(
        lambda: all(kube.pod_labels("default", n).get(LABEL) == value for n in names),
        within=within,
    )


async def measure(kind: str, flips: int, agents: int, per_round: int) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix=f"serve-health-detection-{kind}-"))
    proxies = [await FakeServeProxy().start() for _ in range(agents)]
    processes: list[harness.Process] = []
    async with KubeEmulator() as kube, kmock.Server(kube):
        try:
            kubeconfig = kube.write_kubeconfig(log_dir / "kubeconfig")
            names = [f"pod-{i}" for i in range(agents)]
            uids = [
                kube.add_pod("default", name, pod_ip="127.0.0.1", serve_port=proxy.port)[
                    "metadata"
                ]["uid"]
                for name, proxy in zip(names, proxies, strict=True)
            ]
            aggregator = await asyncio.to_thread(
                harness.start_aggregator,
                log_dir,
                None,
                ["--kube-backend", "kubernetes", "--kubeconfig", str(kubeconfig)],
            )
            processes.append(aggregator)
            for i, (name, uid) in enumerate(zip(names, uids, strict=True)):
                identity = harness.PodIdentity("default", name, uid, "node-1")
                processes.append(
                    await asyncio.to_thread(
                        harness.start_agent,
                        log_dir,
                        aggregator.address,
                        proxies[i].port,
                        identity,
                        name=f"agent-{i}",
                    )
                )
            await wait_labels(kube, names, "true", within=30)
            loop = asyncio.get_running_loop()
            latencies: list[float] = []
            round_number = 0
            while len(latencies) < flips:
                chosen = [(round_number * per_round + j) % agents for j in range(per_round)]
                mark = kube.checkpoint()
                flipped_at = loop.time()
                for i in chosen:
                    if kind == "hang":
                        proxies[i].hang = True
                    else:
                        proxies[i].set(NO_REPLICAS)
                chosen_names = [names[i] for i in chosen]
                await wait_labels(kube, chosen_names, "false", within=30)
                for call in kube.requests("PATCH", since=mark):
                    labels = (call.body or {}).get("metadata", {}).get("labels", {})
                    if labels.get(LABEL) == "false" and call.name in chosen_names:
                        latencies.append(call.at - flipped_at)
                for i in chosen:
                    proxies[i].set(HEALTHY)
                await wait_labels(kube, chosen_names, "true", within=30)
                round_number += 1
            return {
                "kind": kind,
                "per_round": per_round,
                "flips": len(latencies),
                "p50_s": round(statistics.median(latencies), 3),
                "p99_s": round(percentile(latencies, 0.99), 3),
                "max_s": round(max(latencies), 3),
            }
        finally:
            for process in processes[1:]:
                await asyncio.to_thread(process.stop)
            if processes:
                await asyncio.to_thread(processes[0].stop)
            await kube.close()
            for proxy in proxies:
                await proxy.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=104)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=8, help="proxies flipped at once")
    parser.add_argument("--kinds", default="503,hang", help="comma-separated: 503, hang")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args()
    results = []
    for kind in args.kinds.split(","):
        print(
            f"measuring detection of {kind} ({args.flips} flips, {args.agents} agents, "
            f"{args.per_round} at once) ..."
        )
        results.append(asyncio.run(measure(kind, args.flips, args.agents, args.per_round)))
        print(f"  {results[-1]}", flush=True)
    print(
        f"\n{'failure':>8} {'flips':>6} {'p50 s':>7} {'p99 s':>7} {'max s':>7}  target p99 <= 1.5 s"
    )
    for r in results:
        print(f"{r['kind']:>8} {r['flips']:>6} {r['p50_s']:>7} {r['p99_s']:>7} {r['max_s']:>7}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
