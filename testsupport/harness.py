"""Run the real thing locally: aggregator and agent subprocesses, Ray Serve, and a gRPC client.

Shared by ``scripts/demo.py``, ``bench/shutdown_detection.py`` and the end-to-end tests in
``tests/e2e``. Everything listens on 127.0.0.1. Ray is imported lazily, so importing this module
is cheap and does not need Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import IO, Any, TypeVar

import grpc

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.states import ServeState

HOST = "127.0.0.1"
#: The checkout this module belongs to. Subprocesses run here, so ``python -m aggregator`` and
#: ``python -m node_agent`` import this checkout's code whatever the caller's directory.
REPO_ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")

#: The agent settings of the brief: probe every second, give one probe 500 ms.
AGENT_INTERVAL = "750ms"  # the agent's default --interval
AGENT_PROBE_TIMEOUT = "500ms"

_LISTENING = re.compile(r"listening on (?P<host>\S+):(?P<port>\d+)")
# "... listening on HOST:PORT (plaintext, metrics HOST:PORT), backend ..."
_METRICS = re.compile(r"[(,] ?metrics (?P<host>[^\s,()]+):(?P<port>\d+)\)")
_AGENT_CONNECTED = re.compile(r"connected to aggregator ")


class HarnessError(RuntimeError):
    """A process did not start, or did not say what it should have."""


class StateTimeout(AssertionError):
    """The aggregator did not report the expected pod state in time."""


def code_version(exclude: Sequence[str] = ()) -> str | None:
    """The commit measured, ``+dirty`` with uncommitted changes (outside the ``exclude``
    paths); None outside a git checkout."""
    pathspec = ["--", ".", *(f":!{path}" for path in exclude)] if exclude else []

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", *pathspec)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if dirty else commit


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the OS may hand it out again later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def state_name(value: int) -> str:
    """``1`` -> ``"SERVING"``; also for values the enum does not know."""
    try:
        return ServeState(value).name
    except ValueError:
        return f"STATE_{value}"


def call_with_timeout(action: Callable[[], T], timeout: float, what: str = "") -> T:
    """``action()`` on a daemon thread; HarnessError if it does not return within ``timeout``.

    For Ray calls that have no timeout of their own (``serve.run`` waits for replicas for as
    long as it takes). A call that times out keeps running in the background.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(action())
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=run, name=what or "bounded-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise HarnessError(f"{what or action} did not return within {timeout:g}s")
    if failure:
        raise failure[0]
    return outcome[0]


# -- processes ----------------------------------------------------------------------------


@dataclass
class Process:
    """A subprocess whose stdout and stderr go to ``log_path``."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        text = self.log_text().splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def wait_for_log(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """Wait until the log matches ``pattern``; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            match = pattern.search(self.log_text())
            if match:
                return match
            if not self.alive:
                raise HarnessError(
                    f"{self.name} exited with {self.popen.returncode} before logging "
                    f"{pattern.pattern!r}\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{self.name} did not log {pattern.pattern!r} within {timeout:g}s\n"
                    f"{self.tail()}"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code.

        Only this process (by its pid) is signalled. Safe to call more than once.
        """
        try:
            if self.alive:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(5)
            return self.popen.returncode
        finally:
            self._log.close()


P = TypeVar("P", bound=Process)


def spawn(
    name: str,
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    kind: type[P] = Process,  # type: ignore[assignment]
) -> P:
    """Start ``python <args>`` with this interpreter, its output going to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    try:
        popen = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            # Its own process group: a Ctrl-C in a terminal reaches only the parent, which
            # then stops its children in order.
            start_new_session=True,
        )
    except BaseException:
        log.close()
        raise
    return kind(name, popen, log_path, log)


@dataclass
class AggregatorProcess(Process):
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


def start_aggregator(
    log_dir: Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 20.0,
) -> AggregatorProcess:
    """``python -m aggregator`` (memory backend) on ``port`` (a free one if None); returns
    once it logged "listening on"."""
    port = free_port() if port is None else port
    aggregator = spawn(
        "aggregator",
        [
            "-m",
            "aggregator",
            "--listen",
            f"{HOST}:{port}",
            "--metrics-listen",
            f"{HOST}:0",
            "--kube-backend",
            "memory",
            # Agents here carry no ServiceAccount token (tests/kube/test_auth.py tests tokens).
            "--auth",
            "none",
            *extra_args,
        ],
        log_dir / "aggregator.log",
        kind=AggregatorProcess,
    )
    try:
        listening = aggregator.wait_for_log(_LISTENING, timeout)
        aggregator.port = int(listening["port"])
        metrics = _METRICS.search(listening.string[listening.start() :])
        aggregator.metrics_port = int(metrics["port"]) if metrics else 0
    except BaseException:
        aggregator.stop()
        raise
    if aggregator.port != port:
        aggregator.stop()
        raise HarnessError(f"aggregator listens on {aggregator.port}, asked for {port}")
    return aggregator


@dataclass(frozen=True)
class PodIdentity:
    """The downward-API identity an agent reports for."""

    namespace: str = "default"
    name: str = "ray-head-0"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    node_name: str = "node-0"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    def environ(self) -> dict[str, str]:
        return {
            "POD_NAMESPACE": self.namespace,
            "POD_NAME": self.name,
            "POD_UID": self.uid,
            "NODE_NAME": self.node_name,
        }


def proxy_url(port: int) -> str:
    return f"http://{HOST}:{port}/-/healthz"


def agent_environ(pod: PodIdentity | None = None) -> dict[str, str]:
    """This process's environment without SERVE_HEALTH_* settings, plus ``pod``'s downward-API
    variables: what an agent process is started with."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SERVE_HEALTH_")}
    if pod is not None:
        env.update(pod.environ())
    return env


def start_agent(
    log_dir: Path,
    aggregator_address: str,
    serve_port: int,
    pod: PodIdentity,
    *,
    name: str = "agent",
    timeout: float = 20.0,
    extra_args: Sequence[str] = (),
) -> Process:
    """``python -m node_agent`` for ``pod``, probing a Serve proxy on ``serve_port`` (and
    ``extra_args``); returns once it is connected to the aggregator."""
    env = agent_environ(pod)
    process = spawn(
        name,
        [
            "-m",
            "node_agent",
            "--aggregator",
            aggregator_address,
            "--proxy-url",
            proxy_url(serve_port),
            "--interval",
            AGENT_INTERVAL,
            "--probe-timeout",
            AGENT_PROBE_TIMEOUT,
            *extra_args,
        ],
        log_dir / f"{name}.log",
        env,
    )
    try:
        process.wait_for_log(_AGENT_CONNECTED, timeout)
    except BaseException:
        process.stop()
        raise
    return process


def spawn_daemonset_agent(
    log_dir: Path,
    aggregator_address: str,
    kubeconfig: Path | str,
    node_name: str,
    *,
    name: str = "agent",
    extra_args: Sequence[str] = (),
) -> Process:
    """``python -m node_agent --mode daemonset`` for the Ray pods of ``node_name``, found with
    ``kubeconfig`` (only ``NODE_NAME`` is set); returns at once. :func:`wait_connected` waits
    until it is connected to the aggregator."""
    env = agent_environ()
    env["NODE_NAME"] = node_name
    return spawn(
        name,
        [
            "-m",
            "node_agent",
            "--mode",
            "daemonset",
            "--kubeconfig",
            str(kubeconfig),
            "--aggregator",
            aggregator_address,
            "--interval",
            AGENT_INTERVAL,
            "--probe-timeout",
            AGENT_PROBE_TIMEOUT,
            *extra_args,
        ],
        log_dir / f"{name}.log",
        env,
    )


def stop_child(process: subprocess.Popen[Any], timeout: float = 30.0) -> int:
    """End a child that stops by itself when its stdin closes (a benchmark's fleet): close its
    stdin, wait ``timeout``, kill it if it is still running; its exit code."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def wait_connected(agent: Process, timeout: float = 20.0) -> None:
    """Wait until ``agent`` logged that it is connected to the aggregator (stopped if not)."""
    try:
        agent.wait_for_log(_AGENT_CONNECTED, timeout)
    except BaseException:
        agent.stop()
        raise


# -- Ray Serve ----------------------------------------------------------------------------


#: The raylet starts Ray's workers (Serve's controller, proxies and replicas among them) at
#: nice 15 unless told otherwise, so that on a machine whose cores are busy with anything else
#: they hardly run: with two busy loops on two cores, Serve's proxy did not start within Ray's
#: own 60 s and serve.start failed. A local Ray for the demo, the tests and the benchmarks runs
#: its workers at the same priority as everything else.
RAY_WORKER_NICENESS = "RAY_worker_niceness"


def start_ray(*, quiet: bool = False, attempts: int = 2, dashboard_port: int = 0) -> int:
    """A light local Ray instance: 2 CPUs, small object store, its node on 127.0.0.1; no
    dashboard, or one on ``127.0.0.1:dashboard_port`` (the Serve REST API is served there).
    Returns the dashboard's port (0: none).

    ``ray.init`` is tried ``attempts`` times: rarely (2 of ~40 starts here, not reproducible on
    demand; more often with the dashboard on a loaded machine) the raylet did not come up
    within Ray's own 30 s and ``ray.init`` gave up. The failed attempt's dashboard may live on
    and keep its port: a retry takes a fresh one.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(RAY_WORKER_NICENESS, "0")
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=bool(dashboard_port),
                dashboard_host=HOST,
                dashboard_port=dashboard_port or None,
                _node_ip_address=HOST,
                log_to_driver=False,
                object_store_memory=100 * 1024 * 1024,
                logging_level="warning" if quiet else "info",
            )
            break
        except Exception as error:  # Ray raises a bare Exception when its node does not start
            ray.shutdown()
            if attempt == attempts:
                raise
            print(f"ray.init failed ({error}); trying again", file=sys.stderr, flush=True)
            if dashboard_port:
                dashboard_port = free_port()
    if quiet:
        import logging

        import ray.serve  # configures the "ray.serve" logger on import: quiet it afterwards

        logging.getLogger(ray.serve.__name__).setLevel(logging.WARNING)
    return dashboard_port


def stop_ray() -> None:
    import ray

    with contextlib.suppress(Exception):
        shutdown_serve()
    ray.shutdown()


#: Ray's own test servicer (``UserDefinedService``): a gRPC proxy starts only when some
#: servicer function is given.
GRPC_SERVICER_FUNCTIONS = (
    "ray.serve.generated.serve_pb2_grpc.add_UserDefinedServiceServicer_to_server",
)


def start_serve(port: int, *, grpc_port: int = 0, proxy_location: str | None = None) -> None:
    """Serve's controller and HTTP proxy on ``127.0.0.1:port``; with ``grpc_port``, its gRPC
    proxy on ``127.0.0.1:grpc_port`` too (Ray's test servicer); ``proxy_location``:
    ``EveryNode`` (Ray's default), ``HeadOnly`` or ``Disabled``."""
    from ray import serve

    options: dict[str, Any] = {"http_options": {"host": HOST, "port": port}}
    if grpc_port:
        from ray.serve.config import gRPCOptions

        options["grpc_options"] = gRPCOptions(
            port=grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)
        )
    if proxy_location is not None:
        options["proxy_location"] = proxy_location
    serve.start(**options)


def shutdown_serve() -> None:
    from ray import serve

    serve.shutdown()


def hello_app() -> Any:
    """A one-replica application that answers ``hello``."""
    from ray import serve

    # Defined here (not at module level) so Ray pickles it by value: replicas need not import
    # this module.
    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self, request: Any) -> str:
            return "hello\n"

    return Hello.bind()


def deploy_app(name: str = "app", route_prefix: str = "/") -> None:
    """Deploy :func:`hello_app` at ``route_prefix`` and wait until it runs."""
    from ray import serve

    serve.run(hello_app(), name=name, route_prefix=route_prefix)


def delete_app(name: str = "app") -> None:
    from ray import serve

    serve.delete(name)


def proxy_actor() -> Any:
    """The Serve proxy actor of this (the head) node."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    node_id = ray.get_runtime_context().get_node_id()
    return ray.get_actor(format_actor_name(SERVE_PROXY_NAME, node_id), namespace=SERVE_NAMESPACE)


def set_draining(draining: bool, timeout: float = 10.0) -> None:
    """Drain (or undrain) the proxy directly through its actor.

    The controller calls ``update_draining`` only when its own view of the node changes
    (``ProxyState.reconcile``: HEALTHY -> DRAINING when the node drains, and back), so it does
    not undo this call on a node that is not being drained.
    """
    import ray

    ray.get(proxy_actor().update_draining.remote(draining), timeout=timeout)


def controller_proxy_status() -> str:
    """What Serve's controller thinks of this node's proxy: ``HEALTHY``, ``DRAINING``, ..."""
    import ray
    from ray import serve

    status = serve.status().proxies.get(ray.get_runtime_context().get_node_id())
    return "" if status is None else str(status.value)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """``(status, body)``; status 0 when there was no HTTP answer. Ignores *_proxy variables."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:
        return 0, str(error)


# -- gRPC ---------------------------------------------------------------------------------


class Inspector:
    """A blocking client of ``servehealth.v1.InspectionService``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InspectionServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get_pod(self, pod: PodIdentity, timeout: float = 2.0) -> pb.Pod | None:
        """The aggregator's view of ``pod``; None while it is not tracked."""
        try:
            return self.stub.GetPod(
                pb.GetPodRequest(namespace=pod.namespace, name=pod.name), timeout=timeout
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def wait_for(
        self,
        pod: PodIdentity,
        check: Callable[[pb.Pod], bool],
        what: str,
        timeout: float,
        *,
        interval: float = 0.02,
        logs: Iterable[Process] = (),
    ) -> tuple[pb.Pod, float]:
        """Poll GetPod until ``check(pod)``; returns the pod and the seconds it took."""
        started = time.monotonic()
        last: pb.Pod | None = None
        while True:
            last = self.get_pod(pod)
            elapsed = time.monotonic() - started
            if last is not None and check(last):
                return last, elapsed
            if elapsed > timeout:
                seen = (
                    f"{state_name(last.state)} (label {last.desired_label!r}, "
                    f"reason {last.reason!r})"
                    if last is not None
                    else "not tracked"
                )
                details = "\n".join(process.tail() for process in logs)
                raise StateTimeout(
                    f"pod {pod} not {what} within {timeout:g}s: still {seen}\n{details}"
                )
            time.sleep(interval)

    def wait_for_state(
        self,
        pod: PodIdentity,
        state: ServeState,
        timeout: float,
        *,
        logs: Iterable[Process] = (),
    ) -> tuple[pb.Pod, float]:
        return self.wait_for(pod, lambda seen: seen.state == state, state.name, timeout, logs=logs)

    def watch(self, namespace: str = "") -> Iterator[pb.Transition]:
        """Every transition from now on, until the aggregator ends the stream (or cancel)."""
        return self.stub.WatchTransitions(pb.WatchTransitionsRequest(namespace=namespace))


def metric_value(metrics_port: int, name: str) -> float | None:
    """One unlabelled sample of the aggregator's /metrics, or None."""
    status, body = http_get(f"http://{HOST}:{metrics_port}/metrics")
    if status != 200:
        return None
    for line in body.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return None


def format_transition(transition: pb.Transition) -> str:
    """``12:00:01.234  default/ray-head-0  NOT_READY -> SERVING  label=true  reason``."""
    at = transition.time.ToDatetime(tzinfo=UTC).astimezone()
    source = pb.Source.Name(transition.source).removeprefix("SOURCE_").lower()
    if source == "unspecified":
        source = "ttl"
    return (
        f"{at:%H:%M:%S}.{at.microsecond // 1000:03d}  "
        f"{transition.namespace}/{transition.name}  "
        f"{state_name(transition.from_state)} -> {state_name(transition.to_state)}  "
        f"label={transition.desired_label}  ({source}) {transition.reason}"
    )


def grpcurl_commands(address: str, pod: PodIdentity) -> list[str]:
    """Commands a person can paste to look at a running aggregator."""
    get_pod = f'{{"namespace": "{pod.namespace}", "name": "{pod.name}"}}'
    return [
        f"grpcurl -plaintext {address} list",
        f"grpcurl -plaintext {address} describe servehealth.v1.InspectionService",
        f"grpcurl -plaintext {address} grpc.health.v1.Health/Check",
        f"grpcurl -plaintext {address} servehealth.v1.InspectionService/ListPods",
        f"grpcurl -plaintext -d '{get_pod}' {address} servehealth.v1.InspectionService/GetPod",
        f"grpcurl -plaintext {address} servehealth.v1.InspectionService/GetSummary",
        f"grpcurl -plaintext -d '{{}}' {address} servehealth.v1.InspectionService/WatchTransitions",
    ]
