"""The README tells the truth: every flag is documented as the code defines it, and every
grpcurl command in it runs, exactly as written, against a live aggregator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.flags import AggregatorFlags
from aggregator.server import Aggregator
from node_agent.flags import AgentFlags
from servehealth_common.config import describe
from tests import grpcurl

ROOT = Path(__file__).resolve().parents[2]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCUMENTED_ADDRESS = "127.0.0.1:50051"


def grpcurl_commands() -> list[str]:
    return grpcurl.documented_commands(README_PATH)


def test_flag_tables_are_generated_from_the_settings() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "row",
    [
        *[pytest.param(row, id=f"aggregator{row['flag']}") for row in describe(AggregatorFlags)],
        *[pytest.param(row, id=f"agent{row['flag']}") for row in describe(AgentFlags)],
    ],
)
def test_every_flag_is_in_the_readme_with_its_env_and_default(row: dict[str, str]) -> None:
    expected = f"| `{row['flag']}` | `{row['env']}` | `{row['default']}` |"
    assert any(line.startswith(expected) for line in README.splitlines()), (
        f"README.md has no row starting {expected!r}"
    )


def test_readme_has_grpcurl_commands() -> None:
    assert len(grpcurl_commands()) >= 5


async def test_every_grpcurl_command_in_the_readme_runs(aggregator: Aggregator) -> None:
    # "my-pod" is the pod the README asks about.
    await grpcurl.run_documented(
        grpcurl_commands(), DOCUMENTED_ADDRESS, aggregator.port, pods=[("default", "my-pod")]
    )
