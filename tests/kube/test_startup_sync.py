"""Starting while the Kubernetes API does not answer (issue 12, point 5): the aggregator opens
its gRPC port at once and retries the first pod list with capped backoff for as long as it
fails. Meanwhile grpc.health.v1 answers NOT_SERVING for ``""`` (readiness) and the Report
service, SERVING for ``liveness`` (the kubelet's startup and liveness probes: no restart, no
crash loop), and Report streams are refused with UNAVAILABLE and a message that says why. The
failure is one WARNING when it starts and one when it changes (each attempt in between at
debug level); once a list succeeds the aggregator leads as after any start, and never exits on
its own. A stop (SIGTERM) during the wait is prompt and clean.

In process (``Aggregator.open()``, built by ``aggregator.wiring.build_aggregator``): the
emulator answering 503, then 500, to the list, then healing; an API server that is not there
at all (nothing listens on its port) and then comes up; with ``--leader-elect`` (as deploy/
runs), Lease reads refused and then answered; a stop during the wait. As a real
process (``python -m aggregator``): SIGTERM during the wait exits 0 at once, with one warning
and no line from urllib3's own retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import kmock
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.flags import AggregatorFlags
from aggregator.ingest.report_service import STARTING_MESSAGE
from aggregator.lifecycle import Phase
from aggregator.server import LIVENESS, SERVICE_NAMES, Aggregator
from aggregator.wiring import build_aggregator
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from tests.conftest import eventually
from testsupport.fakes import free_port, refused_port
from testsupport.kube.emulator import LEASES, PODS, KubeEmulator
from testsupport.messages import open_stream
from testsupport.processes import StderrLines

NS = "ray"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPORT_SERVICE = SERVICE_NAMES[0]
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
FIRST_LIST = "initial pod list"

Build = Callable[..., Aggregator]


@pytest.fixture
async def build() -> AsyncIterator[Build]:
    """``build(kubeconfig)``: an aggregator on the kubernetes backend, not started; stopped
    after the test (a second stop does nothing)."""
    built: list[Aggregator] = []

    def make(kubeconfig: pathlib.Path, **overrides: Any) -> Aggregator:
        settings = AggregatorFlags(
            **{
                "listen": "127.0.0.1:0",
                "metrics_listen": "",
                "kube_backend": "kubernetes",
                "kubeconfig": str(kubeconfig),
                "auth": "none",
                "shutdown_grace": 0.2,
                **overrides,
            }
        )
        aggregator = build_aggregator(settings)
        built.append(aggregator)
        return aggregator

    yield make
    for aggregator in built:
        await aggregator.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="aggregator")
    # Last: set_level also sets the level of caplog's handler.
    caplog.set_level(logging.DEBUG, logger="servehealth_common.kube.watch")
    return caplog


def serve_pods(emulator: KubeEmulator, count: int = 3) -> list[dict[str, Any]]:
    """Ray pods already labelled in service (the aggregator seeds them SERVING)."""
    labels = {"ray.io/node-type": "worker", "ray.io/serve": "true"}
    return [emulator.add_pod(NS, f"ray-worker-{i}", labels=labels) for i in range(count)]


def kubeconfig_for(server: str, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig whose one cluster is ``server`` (no credentials)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(json.dumps(config))
    return path


def first_list_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == level and record.getMessage().startswith(FIRST_LIST)
    ]


def listed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("listed ")]


async def health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return answer.status


async def health_becomes(port: int, status: int, within: float, service: str = "") -> None:
    """Until grpc.health.v1 says ``status`` for ``service`` (a Watch: told of each change)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=within)
        try:
            async for answer in call:
                if answer.status == status:
                    return
        except grpc.aio.AioRpcError as error:
            raise AssertionError(f"health of {service!r} not {status} within {within}s") from error
        finally:
            call.cancel()
    raise AssertionError(f"the health watch of {service!r} ended")


async def refused_report(port: int) -> grpc.aio.AioRpcError:
    """What a Report stream gets (it must be refused as it opens, before any hello: writing one
    could fail on the client's side, INTERNAL, when the refusal came first)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ReportServiceStub(channel).Report()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(call.read(), 5)
    return refused.value


async def assert_waiting(port: int) -> None:
    """What an aggregator that has not listed the pods yet answers."""
    assert await health(port) == NOT_SERVING
    assert await health(port, REPORT_SERVICE) == NOT_SERVING
    assert await health(port, LIVENESS) == SERVING
    refused = await refused_report(port)
    assert refused.code() is grpc.StatusCode.UNAVAILABLE
    assert refused.details() == STARTING_MESSAGE


# -- in process ---------------------------------------------------------------------------


async def test_a_failing_first_list_is_retried_and_health_says_not_serving_until_it_succeeds(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    build: Build,
    logs: pytest.LogCaptureFixture,
) -> None:
    pods = serve_pods(kube_emulator)
    unavailable = kube_emulator.fail_next(10_000, status=503, verb="list")
    aggregator = build(kubeconfig_path)
    await aggregator.open()
    # The port is open while the list fails, and the list is retried: two failed attempts.
    await kube_emulator.wait_until(lambda: len(unavailable) >= 2, within=10)
    assert aggregator.lifecycle.phase is Phase.STARTING
    await assert_waiting(aggregator.port)
    (warning,) = first_list_lines(logs, logging.WARNING)  # once, not per attempt
    assert "HTTP 503" in warning
    assert "(attempt 1)" in warning
    assert "retrying with backoff" in warning

    # The failure changes (another status), then the API heals.
    failed_503 = len(unavailable)
    kube_emulator.clear_faults()
    failing = kube_emulator.fail_next(1, status=500, verb="list")
    await health_becomes(aggregator.port, SERVING, within=30)
    assert len(failing) == 1
    attempts = failed_503 + 1
    assert aggregator.lifecycle.phase is Phase.LEADING
    assert aggregator.lost is None
    assert await health(aggregator.port, REPORT_SERVICE) == SERVING
    assert await health(aggregator.port, LIVENESS) == SERVING
    first, changed = first_list_lines(logs, logging.WARNING)
    assert first == warning
    assert "HTTP 500" in changed
    assert f"(attempt {attempts}; was HTTP 503: {failed_503} failed attempts in " in changed
    repeats = first_list_lines(logs, logging.DEBUG)
    assert len(repeats) == failed_503 - 1, repeats
    assert all("HTTP 503" in line for line in repeats)
    (listed,) = listed_lines(logs)
    assert listed.startswith("listed 3 pods (all namespaces, selector 'ray.io/node-type')")
    assert f"after {attempts} failed attempts in " in listed
    assert listed.endswith("(last: HTTP 500)")

    # Then everything proceeds as after any start: pods seeded from their labels (no write),
    # the watch open, reports served.
    assert all(aggregator.core.pod(PodKey(NS, pod["metadata"]["name"])) is not None for pod in pods)
    await kube_emulator.wait_for_watches(1)
    assert kube_emulator.requests("PATCH", resource=PODS) == []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "ray-worker-0", NS, uid=pods[0]["metadata"]["uid"])
        call.cancel()


async def test_an_api_server_that_is_not_there_yet_then_comes_up(
    build: Build, logs: pytest.LogCaptureFixture, tmp_path: pathlib.Path
) -> None:
    port = free_port()  # nothing listens there yet: every connection is refused
    aggregator = build(kubeconfig_for(f"http://127.0.0.1:{port}", tmp_path / "kubeconfig"))
    await aggregator.open()
    await eventually(lambda: first_list_lines(logs, logging.WARNING), timeout=10)
    await assert_waiting(aggregator.port)
    (warning,) = first_list_lines(logs, logging.WARNING)
    assert "Connection refused" in warning

    async with KubeEmulator() as emulator, kmock.Server(emulator, port=port):
        try:
            serve_pods(emulator)
            await health_becomes(aggregator.port, SERVING, within=30)
            assert aggregator.lifecycle.phase is Phase.LEADING
            assert aggregator.core.tracked() == 3
            assert first_list_lines(logs, logging.WARNING) == [warning]
            (listed,) = listed_lines(logs)
            assert listed.endswith("(last: no answer)")
        finally:
            # Before the emulator goes: its open watch would hold its shutdown.
            await aggregator.stop()
            await emulator.close()


async def test_with_leader_election_a_replica_that_cannot_read_the_lease_stays_a_live_standby(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    build: Build,
    logs: pytest.LogCaptureFixture,
) -> None:
    """deploy/ runs with --leader-elect: there the API is needed first for the Lease."""
    serve_pods(kube_emulator)
    failing = kube_emulator.fail_next(10_000, status=503, resource=LEASES)
    aggregator = build(
        kubeconfig_path,
        leader_elect=True,
        leader_elect_namespace="ray-serve-health",
        leader_elect_lease_duration=2.0,
        leader_elect_renew_deadline=1.2,
        leader_elect_retry_period=0.3,
    )
    await aggregator.open()
    await kube_emulator.wait_until(lambda: len(failing) >= 3, within=10)  # polled, refused
    assert aggregator.lifecycle.phase is Phase.STANDBY
    assert await health(aggregator.port) == NOT_SERVING
    assert await health(aggregator.port, LIVENESS) == SERVING
    assert (await refused_report(aggregator.port)).code() is grpc.StatusCode.UNAVAILABLE
    (warning,) = lease_lines(logs, logging.WARNING)  # once, not every retry period
    assert "cannot read lease ray-serve-health/ray-serve-health-aggregator" in warning
    assert "HTTP 503" in warning
    failed = len(failing)

    kube_emulator.clear_faults()
    await health_becomes(aggregator.port, SERVING, within=15)
    assert aggregator.lifecycle.phase is Phase.LEADING
    assert aggregator.core.tracked() == 3
    assert lease_lines(logs, logging.WARNING) == [warning]
    assert any(
        f"answers again, after {failed} failed attempts (last: cannot read lease" in line
        for line in lease_lines(logs, logging.INFO)
    )


def lease_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == level
        and record.name == "aggregator.leader.elector"
        and "lease ray-serve-health/" in record.getMessage()
    ]


async def test_a_stop_during_the_wait_is_prompt_and_start_returns(
    kube_emulator: KubeEmulator, kubeconfig_path: pathlib.Path, build: Build
) -> None:
    serve_pods(kube_emulator)
    unavailable = kube_emulator.fail_next(10_000, status=503, verb="list")
    aggregator = build(kubeconfig_path)
    starting = asyncio.create_task(aggregator.start())  # waits for the first list
    try:
        await kube_emulator.wait_until(lambda: len(unavailable) >= 2, within=30)
        assert not starting.done()
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await asyncio.wait_for(aggregator.stop(), 30)
        lists = len(unavailable)
        # Returns (no error) once the stop ended the wait: the list would fail 10,000 times
        # more, so a start that still waited for it would never return.
        await asyncio.wait_for(starting, 30)
    finally:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    print(f"start returned {loop.time() - stopped:.2f}s after the stop began")
    assert len(unavailable) == lists  # no list was tried after the stop
    assert aggregator.lifecycle.phase is Phase.STOPPED
    assert aggregator.lost is None
    # It never got further: no watch, no write.
    assert kube_emulator.requests(verb="watch") == []
    assert kube_emulator.requests("PATCH") == []


# -- as a real process --------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["unreachable", "503"])
async def test_sigterm_while_waiting_for_the_api_exits_0_at_once(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    tmp_path: pathlib.Path,
    fault: str,
) -> None:
    unavailable = None
    if fault == "unreachable":  # a loopback port held bound, never listening: refused
        kubeconfig = kubeconfig_for(f"http://127.0.0.1:{refused_port()}", tmp_path / "kc")
    else:
        kubeconfig = kubeconfig_path
        unavailable = kube_emulator.fail_next(10_000, status=503, verb="list")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_HEALTH_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aggregator",
        "--kube-backend=kubernetes",
        f"--kubeconfig={kubeconfig}",
        "--auth=none",
        "--listen=127.0.0.1:0",
        "--metrics-listen=",
        env={**environ, "PYTHONUNBUFFERED": "1"},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    stderr = StderrLines(process)
    try:
        port = int((await stderr.line_where(LISTENING.search)).group(1))
        warning = await stderr.line_where(lambda line: FIRST_LIST in line and line)
        if unavailable is not None:  # and retried
            await kube_emulator.wait_until(lambda: len(unavailable) >= 2, within=10)
        await assert_waiting(port)
        loop = asyncio.get_running_loop()
        signalled = loop.time()
        rest = await stderr.stop()  # waits 30 s at most: only a hang takes that long
        took = loop.time() - signalled
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    lines = stderr.lines + rest.splitlines()
    text = "".join(stderr.lines) + rest
    assert process.returncode == 0, text
    print(f"SIGTERM to exit: {took:.2f}s")
    assert " WARNING servehealth_common.kube.watch: initial pod list" in warning
    assert [line for line in lines if FIRST_LIST in line] == [warning], text
    assert "urllib3" not in text  # its per-retry warnings are not logged at info level
    assert "Traceback" not in text
    assert "aggregator phase: starting -> stopping" in text
    assert lines[-1].rstrip().endswith("aggregator stopped")
