"""What the agent process loads: not aiohttp (about 11.5 MiB of RSS in the sidecar), not Ray
(its gRPC ingress probe is a generic call: the agent never needs Ray's generated stubs), and
not prometheus_client unless ``--metrics-listen`` asks for its endpoint (``node_agent.metrics``
is imported only then).

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
