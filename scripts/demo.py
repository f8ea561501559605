"""The local demo: real Ray Serve, the aggregator and one agent, every transition printed.

Run it from the repository root with the project's virtualenv::

    python scripts/demo.py

It starts Ray and Serve on a free loopback port, the aggregator (memory backend) and one agent
as subprocesses, subscribes to ``WatchTransitions`` and prints each transition as it happens,
while it deploys an application, drains and undrains the proxy, deletes the application and
shuts Serve down. Then it stops everything and prints a summary. Every wait is bounded and the
whole demo has a deadline (``--deadline``, 300 s): it ends by itself (in about 25 s) and exits
non-zero with a message when a step times out.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from aggregator.ingest.report_service import SHUTDOWN_MESSAGE
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.states import ServeState
from testsupport import harness

# Every wait ends as soon as what it waits for happens; the limits only say when to give up.
# They leave room for a machine whose cores are busy with other work: with two busy loops on
# two cores, serve.start alone once took over 30 s.
#: Longest wait for one state after an action returned (the aggregator needs ~2 s for SERVING).
STATE_TIMEOUT = 30.0
#: Longest wait for one Ray call (serve.start, serve.run, serve.delete, serve.shutdown, ...).
CALL_TIMEOUT = 120.0
#: Longest wait for the WatchTransitions subscription to be registered.
WATCH_TIMEOUT = 5.0
#: The whole demo, start to end (about 25 s on an idle machine).
DEADLINE = 300

_print_lock = threading.Lock()


def say(text: str = "") -> None:
    with _print_lock:
        print(text, flush=True)


def watch_ended_cleanly(code: grpc.StatusCode, details: str | None) -> bool:
    """How a WatchTransitions stream may end when the demo stops it: cancelled by us, or ended
    by the aggregator's drain (UNAVAILABLE with its shutdown message, as documented in
    aggregator/inspection_service.py). Anything else is a failure the demo reports."""
    if code == grpc.StatusCode.CANCELLED:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and details == SHUTDOWN_MESSAGE


class Watcher:
    """Prints every transition of a WatchTransitions stream, on a thread of its own."""

    def __init__(self, inspector: harness.Inspector) -> None:
        self.transitions: list[pb.Transition] = []
        self.error: str | None = None
        self._call = inspector.watch()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for transition in self._call:
                self.transitions.append(transition)
                say(f"    transition  {harness.format_transition(transition)}")
        except grpc.RpcError as error:
            if not watch_ended_cleanly(error.code(), error.details()):
                self.error = f"{error.code().name}: {error.details()}"

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for the stream to end (the aggregator ends it when it drains), else cancel."""
        self._thread.join(timeout)
        self.cancel()

    def cancel(self) -> None:
        if self._thread.is_alive():
            self._call.cancel()
            self._thread.join(5.0)


class DemoFailed(Exception):
    """A step did not happen in time; the message says which and what was seen."""


@dataclass
class Outcome:
    steps: list[tuple[str, float, float, str]] = field(default_factory=list)
    exit_codes: dict[str, int] = field(default_factory=dict)
    transitions: int = 0
    watch_error: str | None = None


def run_demo(log_dir: Path, outcome: Outcome) -> None:
    pod = harness.PodIdentity(namespace="default", name="ray-head-demo", node_name="node-demo")
    serve_port = harness.free_port()
    exit_codes = outcome.exit_codes

    with ExitStack() as stack:
        say("starting Ray (2 CPUs, no dashboard) ...")
        harness.start_ray(quiet=True)
        stack.callback(harness.stop_ray)
        harness.call_with_timeout(
            lambda: harness.start_serve(serve_port), CALL_TIMEOUT, "serve.start"
        )
        say(f"  Serve proxy on {harness.HOST}:{serve_port}")

        say("starting the aggregator (memory backend) ...")
        aggregator = harness.start_aggregator(log_dir)
        stack.callback(lambda: exit_codes.setdefault("aggregator", aggregator.stop()))
        inspector = stack.enter_context(harness.Inspector(aggregator.address))
        say(f"  aggregator listening on {aggregator.address} (pid {aggregator.pid})")

        watcher = Watcher(inspector)
        stack.callback(watcher.cancel)
        _wait_for_watcher(aggregator)
        say("  subscribed to servehealth.v1.InspectionService/WatchTransitions")

        say(f"starting the agent for pod {pod} ...")
        agent = harness.start_agent(log_dir, aggregator.address, serve_port, pod)
        stack.callback(lambda: exit_codes.setdefault("agent", agent.stop()))
        say(f"  agent probing {harness.proxy_url(serve_port)} (pid {agent.pid})")

        say()
        say("while it runs, try:")
        for command in harness.grpcurl_commands(aggregator.address, pod):
            say(f"  {command}")
        say()

        processes = (agent, aggregator)

        def step(title: str, action: Callable[[], object], state: ServeState) -> None:
            say(f"==> {title}")
            begun = time.monotonic()
            try:
                harness.call_with_timeout(action, CALL_TIMEOUT, title)
                acted = time.monotonic() - begun
                seen, took = inspector.wait_for_state(pod, state, STATE_TIMEOUT, logs=processes)
            except (harness.HarnessError, harness.StateTimeout) as error:
                raise DemoFailed(f"step {title!r}: {error}") from None
            say(
                f"    pod {pod} is {state.name} (label {seen.desired_label}) "
                f"{took:.2f}s after the call returned (the call took {acted:.2f}s)"
            )
            outcome.steps.append((title, acted, took, state.name))

        step("deploy a Serve application at /", harness.deploy_app, ServeState.SERVING)
        step("drain the proxy", lambda: harness.set_draining(True), ServeState.DRAINING)
        step("undrain the proxy", lambda: harness.set_draining(False), ServeState.SERVING)
        step("delete the application", harness.delete_app, ServeState.NOT_READY)
        step("shut Serve down", harness.shutdown_serve, ServeState.NO_PROXY)

        say()
        say("stopping: agent (SIGTERM), aggregator (SIGTERM), Ray ...")
        # Agent first, then the aggregator: its drain ends the watch stream; the ExitStack
        # then closes the channel and stops Ray. (On a failure the ExitStack does it all.)
        exit_codes["agent"] = agent.stop()
        exit_codes["aggregator"] = aggregator.stop()
        watcher.stop()
        outcome.transitions = len(watcher.transitions)
        outcome.watch_error = watcher.error


def _wait_for_watcher(aggregator: harness.AggregatorProcess) -> None:
    """The server registers a watcher when the stream's handler first runs; wait for it (the
    aggregator's ``serve_health_transition_watchers`` gauge), so no transition is missed."""
    deadline = time.monotonic() + WATCH_TIMEOUT
    while harness.metric_value(aggregator.metrics_port, "serve_health_transition_watchers") != 1:
        if time.monotonic() > deadline:
            raise harness.HarnessError(
                f"the WatchTransitions stream was not registered within {WATCH_TIMEOUT:g}s"
            )
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--deadline", type=int, default=DEADLINE, help=f"seconds (default {DEADLINE})"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-health-demo-"))
    say(f"ray-serve-health demo: logs in {log_dir}")

    def deadline_passed(signum: int, frame: object) -> None:
        raise DemoFailed(f"the demo did not finish within {args.deadline}s")

    # The deadline interrupts whatever the main thread waits for; cleanup still runs.
    previous = signal.signal(signal.SIGALRM, deadline_passed)
    signal.alarm(args.deadline)
    outcome = Outcome()
    try:
        run_demo(log_dir, outcome)
    except (DemoFailed, harness.HarnessError, harness.StateTimeout, TimeoutError) as error:
        say(f"\nFAILED: {error}")
        say(f"logs: {log_dir}")
        return 1
    except Exception as error:  # Ray's own errors, say: the traceback, then one FAILED line
        traceback.print_exc()
        say(f"\nFAILED: {type(error).__name__}: {error}")
        say(f"logs: {log_dir}")
        return 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

    total = time.monotonic() - started
    say()
    say("summary")
    for title, acted, took, state in outcome.steps:
        say(f"  {title:<34} call {acted:5.2f}s  -> {state:<9} {took:5.2f}s later")
    say(f"  transitions seen on the watch stream: {outcome.transitions}")
    codes = ", ".join(f"{name} {code}" for name, code in outcome.exit_codes.items())
    say(f"  exit codes on SIGTERM: {codes}")
    say(f"  logs: {log_dir}")
    say(f"  total wall time: {total:.1f}s")
    if outcome.watch_error:
        say(f"FAILED: the watch stream ended with {outcome.watch_error}")
        return 1
    if any(code != 0 for code in outcome.exit_codes.values()):
        say("FAILED: a process did not exit 0 on SIGTERM")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
