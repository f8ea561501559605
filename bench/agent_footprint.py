"""Agent footprint: one real agent process probing a real HTTP server at a 1 s interval,
reporting to a real aggregator, for ``--duration`` seconds (default 600). Prints its CPU use
(share of one core) and RSS, sampled every 10 s; writes bench/results/agent_footprint.json.
With ``--grpc``, the agent also probes a real gRPC server answering Serve's ``Healthz``
(``--grpc-proxy-port``: gRPC ingress); the results then go to agent_footprint_grpc.json.
With ``--metrics``, the agent also serves its endpoint (``--metrics-listen 127.0.0.1:0``),
scraped at every sample (/metrics, /livez, /readyz) as Prometheus and the kubelet would; the
results file then ends in ``_metrics`` (agent_footprint_metrics.json, or
agent_footprint_grpc_metrics.json).

Targets (issues 5 and 15): RSS <= 50 MiB, CPU <= 1 %, with gRPC ingress too.

    python -m bench.agent_footprint [--duration 600] [--grpc] [--metrics]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import procstat
from testsupport import harness
from testsupport.fakes import FakeGrpcServeProxy, FakeServeProxy

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "agent_footprint.json"
#: The agent's log line with its endpoint's address (--metrics-listen).
_ENDPOINT = re.compile(r"serving /livez, /readyz and /metrics on (?P<address>\S+)")


def serve_fake_proxy(grpc: bool = False) -> int:
    """A FakeServeProxy (real aiohttp HTTP server), or with ``grpc`` a FakeGrpcServeProxy (real
    grpc.aio server), in a thread of its own; returns its port."""
    ready: list[int] = []
    started = threading.Event()

    def run() -> None:
        async def main() -> None:
            proxy = await (FakeGrpcServeProxy() if grpc else FakeServeProxy()).start()
            ready.append(proxy.port)
            started.set()
            await asyncio.Event().wait()

        asyncio.run(main())

    threading.Thread(target=run, daemon=True, name="fake-proxy").start()
    started.wait(10)
    return ready[0]


def scrape(address: str) -> int:
    """GET /metrics, /livez and /readyz of the agent; the size of /metrics in bytes."""
    size = 0
    for path in ("/metrics", "/livez", "/readyz"):
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            body = response.read()
        if path == "/metrics":
            size = len(body)
    return size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--grpc", action="store_true", help="probe a gRPC proxy too")
    parser.add_argument(
        "--metrics", action="store_true", help="serve and scrape the agent's /metrics too"
    )
    args = parser.parse_args()
    proxy_port = serve_fake_proxy()
    extra_args: tuple[str, ...] = ()
    if args.grpc:
        extra_args += ("--grpc-proxy-port", str(serve_fake_proxy(grpc=True)))
    if args.metrics:
        extra_args += ("--metrics-listen", f"{harness.HOST}:0")
    suffix = ("_grpc" if args.grpc else "") + ("_metrics" if args.metrics else "")
    output = OUTPUT.with_name(f"agent_footprint{suffix}.json")
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-footprint-"))
    aggregator = harness.start_aggregator(log_dir)
    agent = None
    try:
        agent = harness.start_agent(
            log_dir, aggregator.address, proxy_port, harness.PodIdentity(), extra_args=extra_args
        )
        endpoint = agent.wait_for_log(_ENDPOINT, 5)["address"] if args.metrics else None
        time.sleep(5)  # past start-up (imports, first connection)
        window = procstat.CpuWindow(agent.pid)
        window.start()
        samples: list[tuple[float, int]] = []
        started = time.monotonic()
        while time.monotonic() - started < args.duration:
            time.sleep(min(10.0, args.duration))
            scraped = f"  /metrics {scrape(endpoint)} bytes" if endpoint else ""
            samples.append((time.monotonic() - started, procstat.rss_bytes(agent.pid)))
            print(
                f"  t={samples[-1][0]:6.0f}s  rss={samples[-1][1] / 2**20:6.1f} MiB{scraped}",
                flush=True,
            )
        cpu = window.stop()
        rss = [rss for _, rss in samples]
        result = {
            "duration_s": args.duration,
            "grpc_ingress": args.grpc,
            "metrics": args.metrics,
            "interval": harness.AGENT_INTERVAL,
            "cpu_percent_of_one_core": round(cpu * 100, 3),
            "rss_mib_max": round(max(rss) / 2**20, 1),
            "rss_mib_median": round(statistics.median(rss) / 2**20, 1),
            "rss_mib_last": round(rss[-1] / 2**20, 1),
        }
        print(json.dumps(result, indent=2))
        print(
            f"agent: CPU {result['cpu_percent_of_one_core']:.2f} % of one core (target <= 1 %), "
            f"RSS max {result['rss_mib_max']} MiB (target <= 50 MiB)"
        )
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if agent is not None:
            agent.stop()
        aggregator.stop()


if __name__ == "__main__":
    sys.exit(main())
