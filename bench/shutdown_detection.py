"""How long after ``serve.shutdown()`` does the aggregator stop calling the pod SERVING?

One Ray instance and one aggregator for the whole benchmark; per run: ``serve.start`` on a
free port, an agent for that port (same pod name, new uid, so the aggregator starts the pod
over), deploy an application, wait for SERVING, then t0 and ``serve.shutdown()`` while a thread
polls ``GetPod`` (and tries a TCP connect to the proxy) every 20 ms. Recorded, from t0:

- ``shutdown_returned``: ``serve.shutdown()`` returned;
- ``proxy_gone``: the proxy's port first refused a connection;
- ``left_serving``: the aggregator first reported anything but SERVING (``left_to``: which);
- ``no_proxy``: the aggregator first reported NO_PROXY.

Run from the repository root::

    python -m bench.shutdown_detection          # or: python bench/shutdown_detection.py

Prints a table and the medians, and writes bench/results/shutdown_detection.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servehealth_common.states import ServeState
from testsupport import harness

POLL_INTERVAL = 0.02
#: Longest wait for one Ray call, for SERVING after a deploy, and for NO_PROXY after t0.
CALL_TIMEOUT = 30.0
SERVING_TIMEOUT = 10.0
DETECTION_TIMEOUT = 15.0
DEFAULT_OUTPUT = harness.REPO_ROOT / "bench" / "results" / "shutdown_detection.json"


@dataclass
class Run:
    run: int
    serve_port: int
    shutdown_returned: float
    proxy_gone: float | None
    left_serving: float | None
    left_to: str
    no_proxy: float | None


class Poller(threading.Thread):
    """Polls the aggregator and the proxy's port on a fixed 20 ms schedule until NO_PROXY."""

    def __init__(self, inspector: harness.Inspector, pod: harness.PodIdentity, port: int) -> None:
        super().__init__(name="poller", daemon=True)
        self.inspector = inspector
        self.pod = pod
        self.port = port
        self.t0: float | None = None
        self.armed = threading.Event()  # first poll done, pod SERVING
        self.proxy_gone: float | None = None
        self.left_serving: float | None = None
        self.left_to = ""
        self.no_proxy: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._poll()
        except BaseException as error:
            self.error = error
            self.armed.set()

    def _proxy_refuses(self) -> bool:
        try:
            with socket.create_connection((harness.HOST, self.port), timeout=0.2):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _poll(self) -> None:
        started = time.monotonic()
        tick = 0
        while True:
            now = time.monotonic()
            pod = self.inspector.get_pod(self.pod)
            t0 = self.t0
            if t0 is None:
                if pod is None or pod.state != ServeState.SERVING:
                    raise harness.StateTimeout(f"pod {self.pod} is not SERVING before t0")
                self.armed.set()
            else:
                since = now - t0
                if self.proxy_gone is None and self._proxy_refuses():
                    self.proxy_gone = since
                assert pod is not None
                if self.left_serving is None and pod.state != ServeState.SERVING:
                    self.left_serving = since
                    self.left_to = harness.state_name(pod.state)
                if pod.state == ServeState.NO_PROXY:
                    self.no_proxy = since
                    return
                if since > DETECTION_TIMEOUT:
                    return
            tick += 1
            time.sleep(max(0.0, started + tick * POLL_INTERVAL - time.monotonic()))


def one_run(
    index: int,
    aggregator: harness.AggregatorProcess,
    inspector: harness.Inspector,
    log_dir: Path,
) -> Run:
    port = harness.free_port()
    harness.call_with_timeout(lambda: harness.start_serve(port), CALL_TIMEOUT, "serve.start")
    pod = harness.PodIdentity(namespace="default", name="ray-head-bench", node_name="node-bench")
    agent = harness.start_agent(log_dir, aggregator.address, port, pod, name=f"agent-{index}")
    try:
        harness.call_with_timeout(harness.deploy_app, CALL_TIMEOUT, "serve.run")
        inspector.wait_for_state(pod, ServeState.SERVING, SERVING_TIMEOUT, logs=(agent, aggregator))
        poller = Poller(inspector, pod, port)
        poller.start()
        poller.armed.wait(5)
        if poller.error is not None:
            raise poller.error
        t0 = time.monotonic()
        poller.t0 = t0
        harness.call_with_timeout(harness.shutdown_serve, CALL_TIMEOUT, "serve.shutdown")
        shutdown_returned = time.monotonic() - t0
        poller.join(DETECTION_TIMEOUT + 5)
        if poller.error is not None:
            raise poller.error
        if poller.no_proxy is None:
            raise harness.StateTimeout(
                f"run {index}: pod {pod} not NO_PROXY within {DETECTION_TIMEOUT:g}s of "
                f"serve.shutdown() (left SERVING: {poller.left_serving})\n{agent.tail()}"
            )
        return Run(
            run=index,
            serve_port=port,
            shutdown_returned=shutdown_returned,
            proxy_gone=poller.proxy_gone,
            left_serving=poller.left_serving,
            left_to=poller.left_to,
            no_proxy=poller.no_proxy,
        )
    finally:
        agent.stop()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _median(runs: Sequence[Run], name: str) -> float | None:
    values = [getattr(run, name) for run in runs if getattr(run, name) is not None]
    return statistics.median(values) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="number of runs (default 5)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)

    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-bench-"))
    print(f"shutdown detection: {args.runs} runs, logs in {log_dir}", flush=True)
    runs: list[Run] = []
    harness.start_ray(quiet=True)
    try:
        aggregator = harness.start_aggregator(log_dir)
        try:
            with harness.Inspector(aggregator.address) as inspector:
                for index in range(1, args.runs + 1):
                    run = one_run(index, aggregator, inspector, log_dir)
                    runs.append(run)
                    print(
                        f"  run {index}: left SERVING after {_seconds(run.left_serving)}",
                        flush=True,
                    )
        finally:
            aggregator.stop()
    except (harness.HarnessError, harness.StateTimeout, TimeoutError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        harness.stop_ray()

    columns = ("shutdown_returned", "proxy_gone", "left_serving", "no_proxy")
    header = f"{'run':>3}  {'shutdown() returned':>19}  {'proxy gone':>10}  "
    header += f"{'left SERVING':>12}  {'to':<9}  {'NO_PROXY':>8}"
    print()
    print("seconds after serve.shutdown() was called")
    print(header)
    for run in runs:
        print(
            f"{run.run:>3}  {_seconds(run.shutdown_returned):>19}  "
            f"{_seconds(run.proxy_gone):>10}  {_seconds(run.left_serving):>12}  "
            f"{run.left_to:<9}  {_seconds(run.no_proxy):>8}"
        )
    medians = {name: _median(runs, name) for name in columns}
    print(
        f"{'med':>3}  {_seconds(medians['shutdown_returned']):>19}  "
        f"{_seconds(medians['proxy_gone']):>10}  {_seconds(medians['left_serving']):>12}  "
        f"{'':<9}  {_seconds(medians['no_proxy']):>8}"
    )
    print()
    print(
        f"median time from serve.shutdown() to leaving SERVING: {_seconds(medians['left_serving'])}"
    )

    import ray

    result = {
        "benchmark": "shutdown_detection",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "ray_version": ray.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "agent": {"interval": harness.AGENT_INTERVAL, "probe_timeout": harness.AGENT_PROBE_TIMEOUT},
        "poll_interval_s": POLL_INTERVAL,
        "unit": "seconds after serve.shutdown() was called",
        "runs": [asdict(run) for run in runs],
        "median": medians,
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
