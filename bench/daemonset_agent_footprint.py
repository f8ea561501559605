"""DaemonSet agent footprint (issue 28, point 6: its memory request): one real
``serve-health-agent --mode daemonset`` with its endpoint on (``--metrics-listen``, scraped at
every sample, as Prometheus and the kubelet would), on the Kubernetes API emulator
(testsupport/kube/emulator.py), for the Ray pods of its node (``--pods``, each a real loopback HTTP
proxy), in two phases:

- connected: a real aggregator (Kubernetes backend, ``--leader-elect``) accepts its stream;
- fallback: the aggregator is SIGKILLed, half the proxies answer 503, and the agent, past
  ``--fallback-after`` and the Lease's duration, writes their label itself (the Kubernetes
  client's writes, Events).

Prints the agent's RSS (VmRSS, every 5 s) in each phase and its peak (VmHWM); writes
bench/results/daemonset_agent_footprint.json. Unlike bench/agent_footprint.py (a sidecar, which
never imports the Kubernetes client until its fallback), a DaemonSet agent lists and watches its
node's pods with the Kubernetes client from its start.

    python -m bench.daemonset_agent_footprint [--pods 10] [--phase 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kmock

from bench import procstat
from testsupport import harness
from testsupport.kube.agent_processes import (
    AGENT_ARGS,
    FAILING,
    LABEL,
    LEASE,
    ProxyPool,
    add_pod,
    leading_aggregator,
)
from testsupport.kube.emulator import KubeEmulator

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "daemonset_agent_footprint.json"
_ENDPOINT = re.compile(r"serving /livez, /readyz and /metrics on (?P<address>\S+)")
NODE = "node-1"


def vm(pid: int, field: str) -> int:
    """A ``Vm*`` line of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no {field} for pid {pid}")


def scrape(address: str) -> None:
    for path in ("/metrics", "/livez", "/readyz"):
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            response.read()


async def sample(agent: harness.Process, endpoint: str, seconds: float, name: str) -> list[int]:
    found = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(5.0)
        await asyncio.to_thread(scrape, endpoint)
        found.append(procstat.rss_bytes(agent.pid))
        print(f"  {name}: rss={found[-1] / 2**20:6.1f} MiB", flush=True)
    return found


async def run(pods: int, phase: float) -> dict[str, float]:
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-ds-footprint-"))
    proxies = ProxyPool()
    running: list[harness.Process] = []
    async with KubeEmulator() as kube, kmock.Server(kube):
        try:
            kubeconfig = kube.write_kubeconfig(log_dir / "kubeconfig")
            started = await proxies.start(pods)
            for index, proxy in enumerate(started):
                add_pod(kube, f"worker-{index}", proxy, labels={LABEL: "true"}, node_name=NODE)
            aggregator = await asyncio.to_thread(
                leading_aggregator,
                log_dir,
                kubeconfig,
                "--agent-fallback=on",  # label mode: off unless turned on
                lease_seconds=3,
                renew_deadline=2.0,
            )
            running.append(aggregator)
            agent = harness.spawn_daemonset_agent(
                log_dir,
                aggregator.address,
                kubeconfig,
                NODE,
                extra_args=[
                    *AGENT_ARGS,
                    "--fallback-write=label",
                    f"--fallback-lease={LEASE}",
                    f"--metrics-listen={harness.HOST}:0",
                ],
            )
            running.append(agent)
            endpoint = (await asyncio.to_thread(agent.wait_for_log, _ENDPOINT, 30))["address"]
            connected = await sample(agent, endpoint, phase, "connected")
            aggregator.popen.kill()
            aggregator.popen.wait(10)
            for proxy in started[: pods // 2]:
                proxy.set(FAILING)
            fallback = await sample(agent, endpoint, phase, "fallback")
            written = sum(
                kube.pod_labels("default", f"worker-{i}").get(LABEL) == "false" for i in range(pods)
            )
            return {
                "pods": pods,
                "phase_s": phase,
                "rss_mib_max_connected": round(max(connected) / 2**20, 1),
                "rss_mib_max_fallback": round(max(fallback) / 2**20, 1),
                "vm_hwm_mib": round(vm(agent.pid, "VmHWM") / 2**20, 1),
                "labels_written_false": written,
            }
        finally:
            for process in reversed(running):
                process.stop()
            await proxies.stop()
            await kube.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10, help="Ray pods on the agent's node")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per phase")
    args = parser.parse_args()
    result = asyncio.run(run(args.pods, args.phase))
    print(json.dumps(result, indent=2))
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
