"""The README tells the truth: every flag is documented as the code defines it, and every
grpcurl command in it runs, exactly as written, against a live aggregator."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path

import grpc
import pytest

from aggregator.server import Aggregator
from aggregator.settings import Settings as AggregatorSettings
from node_agent.settings import Settings as AgentSettings
from servehealth_common.config import describe
from tests.messages import open_stream, report

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GRPCURL = Path(sys.executable).parent / "grpcurl"
DOCUMENTED_ADDRESS = "127.0.0.1:50051"


def bash_blocks(markdown: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL)


def grpcurl_commands() -> list[str]:
    return [
        line.strip()
        for block in bash_blocks(README)
        for line in block.splitlines()
        if line.strip().startswith("grpcurl ")
    ]


@pytest.mark.parametrize(
    "row",
    [
        *[pytest.param(row, id=f"aggregator{row['flag']}") for row in describe(AggregatorSettings)],
        *[pytest.param(row, id=f"agent{row['flag']}") for row in describe(AgentSettings)],
    ],
)
def test_every_flag_is_in_the_readme_with_its_env_and_default(row: dict[str, str]) -> None:
    lines = [line for line in README.splitlines() if line.startswith(f"| `{row['flag']}` |")]
    assert lines, f"{row['flag']} is not documented in README.md"
    default = f"`{row['default']}`" if row["default"] else "(required)"
    assert any(f"`{row['env']}` | {default} |" in line for line in lines), (
        f"README row for {row['flag']} does not say env {row['env']} and default {default}"
    )


def test_readme_has_grpcurl_commands() -> None:
    assert len(grpcurl_commands()) >= 5


async def test_every_grpcurl_command_in_the_readme_runs(aggregator: Aggregator) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        call = await open_stream(channel, name="my-pod")  # the pod the README asks about
        await call.write(report(1, 1, "success"))
        await call.read()
        for command in grpcurl_commands():
            argv = shlex.split(command.replace(DOCUMENTED_ADDRESS, address))
            process = await asyncio.create_subprocess_exec(
                str(GRPCURL),
                *argv[1:],
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
            assert process.returncode == 0, f"{command}\n{stderr.decode()}"
            assert stdout.strip(), f"{command} printed nothing"
        call.cancel()
