"""What the agent process loads: not aiohttp (about 11.5 MiB of RSS in the sidecar), not Ray
(its gRPC ingress probe is a generic call: the agent never needs Ray's generated stubs), and
not prometheus_client unless ``--metrics-listen`` asks for its endpoint (``node_agent.metrics``
is imported only then).

The sidecar does not load the Kubernetes client either (about 30 MiB of RSS) until its fallback
begins (no aggregator answered it for ``--fallback-after``): its modules, the fallback's
decider and runner included, import neither ``kubernetes`` nor ``urllib3``; only the fallback's
writer (``node_agent.fallback.writer``, imported when fallback first begins) and the DaemonSet
agent do.

Checked in a fresh interpreter, since this test process has aiohttp loaded for its servers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: aiohttp and what only it brings in; Ray; prometheus_client (only with --metrics-listen).
HEAVY = ("aiohttp", "yarl", "multidict", "ray", "prometheus_client")

IMPORT_AGENT = """
import sys
import node_agent.agent, node_agent.cli, node_agent.daemonset, node_agent.stream
import servehealth_common.probe, servehealth_common.grpc_healthz
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)))
"""

HELP_AGENT = """
import sys, runpy
sys.argv = ["serve-health-agent", "--help"]
try:
    runpy.run_module("node_agent", run_name="__main__")
except SystemExit:
    pass
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("script", "stream"),
    [
        pytest.param(IMPORT_AGENT, "stdout", id="agent-modules"),
        pytest.param(HELP_AGENT, "stderr", id="python-m-node_agent--help"),
    ],
)
def test_agent_imports_neither_aiohttp_nor_ray(script: str, stream: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", script.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = getattr(done, stream).strip().splitlines()[-1:]
    assert loaded in ([], [""]), f"the agent imports {loaded}"


#: What the sidecar must not load before its fallback begins.
KUBERNETES = ("kubernetes", "urllib3", "yaml")

IMPORT_SIDECAR = """
import sys
import node_agent.agent, node_agent.cli, node_agent.stream, node_agent.fallback.decider
import node_agent.fallback.rules, node_agent.fallback.runner
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)))
"""

#: The sidecar, built as its command line builds it, with a kubeconfig, never in fallback.
BUILD_SIDECAR = """
import asyncio, sys
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth_common.probe import Prober, make_session

async def main():
    settings = AgentFlags(
        aggregator="127.0.0.1:1", kubeconfig="/nonexistent", fallback_write="condition"
    )
    async with make_session() as session:
        Agent(settings, SidecarPod("ns", "pod", "uid", "node"), Prober(session, 0.5))

asyncio.run(main())
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)))
"""


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(IMPORT_SIDECAR, id="sidecar-modules"),
        pytest.param(BUILD_SIDECAR, id="sidecar-built-with-fallback-on"),
    ],
)
def test_the_sidecar_loads_no_kubernetes_client_before_fallback(script: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", script.format(heavy=KUBERNETES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = done.stdout.strip().splitlines()[-1:]
    assert loaded in ([], [""]), f"the sidecar imports {loaded} before any fallback"


def test_the_fallback_writer_is_what_loads_it() -> None:
    """The control: the writer module does load the client (else the test above proves
    nothing)."""
    script = "import sys, node_agent.fallback.writer; print('kubernetes' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True"
