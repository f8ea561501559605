"""The README's first command, run the way the README says: ``scripts/demo`` from the
repository's root. It must exit 0, print its summary with every step and both processes' exit
codes, and print no ``FAILED``. (It stayed broken through three merges because nothing ran it.)

The demo starts its own Ray (a second local instance beside a worker's session Ray is fine: it
binds only free ports on 127.0.0.1) and ends by itself within its own deadline (300 s).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The demo's own deadline is 300 s; bootstrap is a no-op once .venv is installed.
DEMO_TIMEOUT = 420

STEPS = (
    "deploy a Serve application at /",
    "drain the proxy",
    "undrain the proxy",
    "delete the application",
    "shut Serve down",
)


@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_the_readme_demo_exits_0_with_its_summary() -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run(
        ["scripts/demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert not failures, output[-6000:]
    summary = result.stdout.split("\nsummary\n", 1)
    assert len(summary) == 2, f"no summary in the demo's output:\n{result.stdout[-4000:]}"
    for step in STEPS:
        assert step in summary[1], f"{step!r} missing from the summary:\n{summary[1]}"
    assert "exit codes on SIGTERM: agent 0, aggregator 0" in summary[1], summary[1]
    assert "transitions seen on the watch stream: " in summary[1], summary[1]
