"""The kubelet probes deploy/ declares are answered by the real commands: every ``httpGet`` path
of the aggregator's Deployment and of the agents (DaemonSet, sidecar example) is served on the
plaintext port its ``--metrics-listen`` opens, 200 from a healthy process. Real processes on
loopback (the aggregator with the memory backend, an agent in sidecar mode with nothing to
probe), stopped after the module."""

from __future__ import annotations

import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import ROOT, find, pod_specs, render

AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"


def command(name: str, module: str) -> list[str]:
    beside = shutil.which(name, path=str(Path(sys.executable).parent))
    return [beside] if beside else [sys.executable, "-m", module]


def started(
    args: list[str], pattern: bytes, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``args``; the HOST:PORT its log line matching ``pattern`` names."""
    process = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert process.stderr is not None
    seen = b""
    deadline = time.monotonic() + 30
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(left):
            chunk = os.read(process.stderr.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
            match = re.search(pattern, seen)
            if match:
                return process, match[1].decode()
    stop(process)
    pytest.fail(f"{args[0]} did not say where it listens:\n{seen.decode()}")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def get(address: str, path: str, within: float = 10.0) -> int:
    """The status of GET ``path``, retried until 200 or ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        if status == 200 or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


@pytest.fixture(scope="module")
def aggregator() -> Iterator[str]:
    process, address = started(
        [
            *command("serve-health-aggregator", "aggregator"),
            "--kube-backend=memory",
            "--auth=none",
            "--listen=127.0.0.1:0",
            "--metrics-listen=127.0.0.1:0",
        ],
        rb"listening on .*\bmetrics (\S+?:\d+)\)",
        {},
    )
    try:
        yield address
    finally:
        stop(process)


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    process, address = started(
        [
            *command("serve-health-agent", "node_agent"),
            "--mode=sidecar",
            "--aggregator=127.0.0.1:9",
            "--proxy-url=http://127.0.0.1:9/-/healthz",
            "--token-file=",
            "--metrics-listen=127.0.0.1:0",
        ],
        rb"serving /livez, /readyz and /metrics on (\S+?:\d+)",
        {
            "POD_NAME": "worker-1",
            "POD_NAMESPACE": "ray",
            "POD_UID": "7f1c0e52-0000-4000-8000-000000000001",
            "NODE_NAME": "node-a",
        },
    )
    try:
        yield address
    finally:
        stop(process)


def probes(container: dict[str, Any]) -> dict[str, str]:
    """kind -> path of a container's HTTP probes."""
    return {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
        if kind in container
    }


def test_the_aggregator_answers_its_probes(aggregator: str) -> None:
    deployment = find(render("deploy/overlays/readiness-gate-mode"), "Deployment", AGGREGATOR)
    declared = probes(deployment["spec"]["template"]["spec"]["containers"][0])
    assert set(declared) == {"startupProbe", "livenessProbe", "readinessProbe"}
    for kind, path in declared.items():
        assert get(aggregator, path) == 200, (kind, path)


def test_the_agents_answer_their_probes(agent: str) -> None:
    daemonset = find(render("deploy/overlays/label-mode"), "DaemonSet", AGENT)
    declared = probes(daemonset["spec"]["template"]["spec"]["containers"][0])
    service = find(render("deploy/examples/rayservice-sidecar"), "RayService")
    for _, spec in pod_specs(service):
        for container in spec["containers"]:
            if container.get("command") == ["serve-health-agent"]:
                declared |= {f"sidecar {k}": v for k, v in probes(container).items()}
    assert {"livenessProbe", "readinessProbe", "sidecar livenessProbe"} <= set(declared)
    for kind, path in declared.items():
        assert get(agent, path) == 200, (kind, path)


def test_an_unknown_path_is_not_found(aggregator: str) -> None:
    """So that a 200 above means the path exists."""
    assert get(aggregator, "/healthz-nothing", within=0) == 404
