"""Session fixtures for the end-to-end tests: real subprocesses, real Ray Serve.

The aggregator and the agent start once per session, as ``python -m aggregator`` and
``python -m node_agent`` on free loopback ports; their output goes to log files under the
session's tmp dir (printed by the tests when something fails). Ray starts only for tests that
ask for ``ray_serve``: the agent does not need a proxy to exist (it then reports NO_PROXY), so
the gRPC-only tests run without Ray.

Under pytest-xdist (``scripts/test`` runs the suite on parallel workers) the modules that use
the session's Ray run on one worker, in file order, with one Ray for them all, and the modules of
Ray in HAProxy mode (a Ray of their own each, in a subprocess) on one worker too, so that no two
of those Rays start at once: the groups are in tests/parallel.py. Session fixtures are per
worker; the Rays are package-scoped, so each stops as soon as its worker leaves tests/e2e (an
idle Ray with Serve costs a tenth of a core for as long as it lives).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import ray_haproxy
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.states import ServeState
from tests.conftest import require_haproxy
from testsupport import harness


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def serve_port() -> int:
    """The port the Serve proxy will listen on, chosen up front so the agent can probe it."""
    return harness.free_port()


@pytest.fixture(scope="session")
def pod() -> harness.PodIdentity:
    return harness.PodIdentity(namespace="default", name="ray-head-e2e", node_name="node-e2e")


@pytest.fixture(scope="session")
def aggregator_process(e2e_log_dir: Path) -> Iterator[harness.AggregatorProcess]:
    process = harness.start_aggregator(e2e_log_dir, harness.free_port())
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def agent_process(
    e2e_log_dir: Path,
    aggregator_process: harness.AggregatorProcess,
    serve_port: int,
    pod: harness.PodIdentity,
) -> Iterator[harness.Process]:
    process = harness.start_agent(e2e_log_dir, aggregator_process.address, serve_port, pod)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def processes(
    aggregator_process: harness.AggregatorProcess, agent_process: harness.Process
) -> tuple[harness.Process, ...]:
    """Both subprocesses, for the log tails in failure messages."""
    return (agent_process, aggregator_process)


@pytest.fixture(scope="session")
def inspector(aggregator_process: harness.AggregatorProcess) -> Iterator[harness.Inspector]:
    with harness.Inspector(aggregator_process.address) as client:
        yield client


@pytest.fixture
def tracked_pod(
    inspector: harness.Inspector,
    pod: harness.PodIdentity,
    processes: tuple[harness.Process, ...],
) -> pb.Pod:
    """The agent's pod as the aggregator sees it, once observed (any state but UNKNOWN)."""
    seen, _ = inspector.wait_for(
        pod,
        lambda record: record.state != ServeState.UNKNOWN,
        "observed by its agent",
        timeout=10,
        logs=processes,
    )
    return seen


@pytest.fixture(scope="session")
def serve_grpc_port() -> int:
    """The port of Serve's gRPC proxy (gRPC ingress with Ray's test servicer)."""
    return harness.free_port()


@pytest.fixture(scope="session")
def ray_ports() -> dict[str, int]:
    """Ports Ray took as it started (its dashboard's: a retried start takes a fresh one)."""
    return {}


@pytest.fixture(scope="package")
def ray_dashboard_port(ray_serve: int, ray_ports: dict[str, int]) -> int:
    """The port of the session Ray's dashboard, where the Serve REST API answers."""
    return ray_ports["dashboard"]


@pytest.fixture(scope="package")
def ray_serve(serve_port: int, serve_grpc_port: int, ray_ports: dict[str, int]) -> Iterator[int]:
    """A local Ray instance (its node on 127.0.0.1, its dashboard on ``ray_dashboard_port``)
    with Serve's HTTP proxy on ``127.0.0.1:serve_port`` and its gRPC proxy on
    ``serve_grpc_port``; yields the HTTP port.

    Serve runs with ``proxy_location: HeadOnly``: on one node the same as the default
    (``EveryNode``), and what the Serve controller then reports to the dashboard is what
    a cluster whose workers have no proxy by design reports.

    Torn down (Serve, then Ray) when the worker leaves tests/e2e, whatever the tests did to Serve.
    """
    ray_ports["dashboard"] = harness.start_ray(dashboard_port=harness.free_port())
    try:
        harness.start_serve(serve_port, grpc_port=serve_grpc_port, proxy_location="HeadOnly")
        yield serve_port
    finally:
        harness.stop_ray()


@pytest.fixture(scope="session")
def haproxy_binary() -> str:
    """Debian's haproxy (``tests.conftest.require_haproxy``)."""
    return require_haproxy()


@pytest.fixture(scope="package")
def serve_haproxy(haproxy_binary: str, e2e_log_dir: Path) -> Iterator[ray_haproxy.RayHAProxy]:
    """Ray Serve in HAProxy mode (``bench/ray_haproxy.py``) with Debian's haproxy, HTTP only,
    in a subprocess with its own Ray cluster, so the session's Ray (``ray_serve``, in this
    process) is not disturbed. Stopped at the end of the session, its Ray processes and any
    haproxy it left included, whatever the tests did."""
    with ray_haproxy.running(haproxy_binary, e2e_log_dir / "ray_haproxy.log") as process:
        yield process
