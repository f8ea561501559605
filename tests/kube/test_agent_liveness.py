"""An agent's liveness comes from its connection (issue 14), with the real programs: a real
aggregator process on the Kubernetes API emulator and real agent processes.

- A frozen agent (SIGSTOP) still holds its TCP connection, but its gRPC core no longer answers
  the aggregator's pings: the stream ends, the pod is pulled; once thawed the agent reconnects.
- An agent whose event loop is stuck while its process lives (here: blocked writing to a log
  pipe nobody reads; its gRPC core would still answer pings) is ended by its own watchdog.
- An agent of the previous version (0.1.0, taken from git history) still works: heartbeats,
  state changes, and its death.

How fast each is, is a benchmark (bench/liveness.py), not these tests: the bounds here are
only there so that a test never hangs.
"""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node_agent.watchdog import EXIT_STALLED
from servehealth.v1 import servehealth_pb2 as pb
from tests.conftest import eventually
from testsupport import fakes, harness
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import KubeEmulator

LABEL = "ray.io/serve"
#: The last commit of the agent before it reported on change (version 0.1.0).
PREVIOUS_AGENT = "4ebf43ea5a2b475c1ddf3eb9c4664b842e12319d"
#: Fast keepalive, so that the tests are short (the defaults are 2 s and 1 s).
FAST_KEEPALIVE = ["--keepalive-time", "300ms", "--keepalive-timeout", "500ms"]


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    started = await FakeServeProxy().start()
    try:
        yield started
    finally:
        await started.stop()


async def start_aggregator(tmp_path: Path, kubeconfig: Path) -> harness.AggregatorProcess:
    return await asyncio.to_thread(
        harness.start_aggregator,
        tmp_path,
        None,
        ["--kube-backend", "kubernetes", "--kubeconfig", str(kubeconfig), *FAST_KEEPALIVE],
    )


def add_pod(kube: KubeEmulator, proxy: FakeServeProxy, name: str = "pod-0") -> harness.PodIdentity:
    pod = kube.add_pod("default", name, pod_ip="127.0.0.1", serve_port=proxy.port)
    return harness.PodIdentity("default", name, pod["metadata"]["uid"], "node-1")


async def pod_view(inspector: harness.Inspector, pod: harness.PodIdentity) -> pb.Pod | None:
    return await asyncio.to_thread(inspector.get_pod, pod)


async def test_a_frozen_agents_stream_ends_its_pod_is_pulled_and_it_comes_back(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, proxy: FakeServeProxy, tmp_path: Path
) -> None:
    pod = add_pod(kube_emulator, proxy)
    aggregator = await start_aggregator(tmp_path, kubeconfig_path)
    agent = None
    try:
        agent = await asyncio.to_thread(
            harness.start_agent, tmp_path, aggregator.address, proxy.port, pod
        )
        with harness.Inspector(aggregator.address) as inspector:

            async def view() -> pb.Pod | None:
                return await pod_view(inspector, pod)

            async def pushed() -> bool:
                seen = await view()
                return bool(seen and seen.agent_connected and seen.source == pb.SOURCE_PUSH)

            await eventually(pushed, timeout=20)
            agent.popen.send_signal(signal.SIGSTOP)
            try:

                async def pulled() -> bool:
                    seen = await view()
                    return bool(seen and not seen.agent_connected and seen.source == pb.SOURCE_PULL)

                await eventually(pulled, timeout=20)
                seen = await view()
                assert seen is not None
                assert seen.state == pb.SERVE_STATE_SERVING  # the proxy is fine: it stays in
            finally:
                agent.popen.send_signal(signal.SIGCONT)
            # Thawed, the agent finds its connection gone and reconnects.
            await eventually(pushed, timeout=20)
        assert "disconnected" in aggregator.log_text()
        assert kube_emulator.pod_labels("default", pod.name).get(LABEL) == "true"
    finally:
        if agent is not None:
            agent.stop()
        aggregator.stop()


def spawn_agent(
    pod: harness.PodIdentity,
    aggregator: str,
    proxy: FakeServeProxy,
    flags: list[str],
    *,
    stderr: int,
    cwd: Path = harness.REPO_ROOT,
    pythonpath: str = "",
) -> subprocess.Popen[bytes]:
    """``python -m node_agent`` for ``pod`` (from ``cwd``: ``-m`` finds the agent there)."""
    env = harness.agent_environ(pod)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node_agent",
            "--aggregator",
            aggregator,
            "--proxy-url",
            harness.proxy_url(proxy.port),
            *flags,
        ],
        stdin=subprocess.DEVNULL,
        stdout=stderr,
        stderr=stderr,
        env=env,
        cwd=cwd,
    )


def fill_pipe(write_end: int) -> int:
    """Write into the pipe until it is full (without blocking); the bytes written."""
    flags = fcntl.fcntl(write_end, fcntl.F_GETFL)
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    written = 0
    try:
        while True:
            written += os.write(write_end, b"x" * 4096)
    except BlockingIOError:
        return written
    finally:
        fcntl.fcntl(write_end, fcntl.F_SETFL, flags)


async def test_an_agent_whose_event_loop_is_stuck_exits_and_its_pod_is_pulled(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, proxy: FakeServeProxy, tmp_path: Path
) -> None:
    pod = add_pod(kube_emulator, proxy)
    aggregator = await start_aggregator(tmp_path, kubeconfig_path)
    read_end, write_end = os.pipe()
    agent = spawn_agent(
        pod,
        aggregator.address,
        proxy,
        ["--interval", "200ms", "--probe-timeout", "100ms", "--stall-timeout", "1s"],
        stderr=write_end,
    )
    os.close(write_end)
    try:
        with harness.Inspector(aggregator.address) as inspector:

            async def connected() -> bool:
                seen = await pod_view(inspector, pod)
                return bool(seen and seen.agent_connected)

            await eventually(connected, timeout=20)
            # Nobody reads the agent's stderr any more, and it is full: the next line the
            # agent logs blocks its event loop. Its proxy flaps, each state held longer than a
            # probe and its confirmation, so that the agent logs a change soon.
            writer = os.open(f"/proc/{agent.pid}/fd/2", os.O_WRONLY)
            try:
                assert fill_pipe(writer) > 0
            finally:
                os.close(writer)
            for turn in range(60):  # bounded: 30 s at most
                if agent.poll() is not None:
                    break
                proxy.set(fakes.HEALTHY if turn % 2 else fakes.NO_REPLICAS)
                await asyncio.sleep(0.5)
            assert agent.poll() == EXIT_STALLED

            async def pulled() -> bool:
                seen = await pod_view(inspector, pod)
                return bool(seen and not seen.agent_connected and seen.source == pb.SOURCE_PULL)

            await eventually(pulled, timeout=20)
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)
        os.close(read_end)
        aggregator.stop()


def previous_agent(directory: Path) -> Path:
    """The agent of version 0.1.0 (and what it imports), unpacked from git history. A clone
    without that history (a shallow one) cannot run it: skipped, saying why."""
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{PREVIOUS_AGENT}^{{commit}}"],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if known.returncode != 0:
        pytest.skip(f"needs the git history of commit {PREVIOUS_AGENT} (a full clone)")
    archive = subprocess.run(
        [
            "git",
            "archive",
            "--format=tar",
            PREVIOUS_AGENT,
            "node_agent",
            "servehealth_common",
            "proto",
        ],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


async def test_an_agent_of_the_previous_version_still_works(
    kube_emulator: KubeEmulator, kubeconfig_path: Path, proxy: FakeServeProxy, tmp_path: Path
) -> None:
    old = await asyncio.to_thread(previous_agent, tmp_path / "agent-0.1.0")
    assert '__version__ = "0.1.0"' in (old / "node_agent" / "__init__.py").read_text()
    pod = add_pod(kube_emulator, proxy)
    aggregator = await start_aggregator(tmp_path, kubeconfig_path)
    with (tmp_path / "agent-0.1.0.log").open("wb") as log:
        agent = spawn_agent(
            pod,
            aggregator.address,
            proxy,
            [],
            stderr=log.fileno(),
            cwd=old,
            pythonpath=f"{old}{os.pathsep}{old / 'proto'}",
        )
    try:
        await eventually(lambda: "version 0.1.0, heartbeats" in aggregator.log_text(), 20)
        label = lambda: kube_emulator.pod_labels("default", pod.name).get(LABEL)  # noqa: E731
        with harness.Inspector(aggregator.address) as inspector:

            async def pushed_for(seconds: float) -> bool:
                """Reported by push within the heartbeat TTL, continuously for ``seconds``."""
                deadline = asyncio.get_running_loop().time() + seconds
                while asyncio.get_running_loop().time() < deadline:
                    seen = await pod_view(inspector, pod)
                    if not (seen and seen.agent_connected and seen.source == pb.SOURCE_PUSH):
                        return False
                    if seen.last_report_age.ToNanoseconds() > 1.5e9:  # heartbeats: 1 s
                        return False
                    await asyncio.sleep(0.1)
                return True

            await eventually(lambda: label() == "true", 20)
            assert await pushed_for(4.0)  # past the heartbeat TTL (3 s): its heartbeats count
            proxy.set(fakes.NO_REPLICAS)
            await eventually(lambda: label() == "false", 20)
            proxy.set(fakes.HEALTHY)
            await eventually(lambda: label() == "true", 20)
            agent.kill()
            agent.wait(10)

            async def detached() -> bool:
                seen = await pod_view(inspector, pod)
                return bool(seen and not seen.agent_connected)

            await eventually(detached, timeout=20)
        assert label() == "true"  # its pull finds the proxy serving
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)
        aggregator.stop()
