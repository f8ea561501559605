"""SIGTERM drains a real aggregator process: health NOT_SERVING, streams closed, exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testsupport.fakes import free_port
from testsupport.messages import open_stream, read_until_error, report


async def test_sigterm_drains_and_exits_zero() -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aggregator",
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        "",
        "--kube-backend",
        "memory",
        "--auth",
        "none",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stderr is not None
        async with asyncio.timeout(30):
            while b"listening on" not in await process.stderr.readline():
                pass
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = await open_stream(channel)
            await call.write(report(1, 1))
            await call.read()
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            process.send_signal(signal.SIGTERM)
            update = await asyncio.wait_for(watch.read(), 10)
            assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # The agent's stream is closed by the server at once, not left hanging.
            error = await asyncio.wait_for(read_until_error(call), 10)
            assert error.code() is grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (error.details() or "")
            watch.cancel()
        assert await asyncio.wait_for(process.wait(), 15) == 0
        stderr = (await process.stderr.read()).decode()
        assert "aggregator stopped" in stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
