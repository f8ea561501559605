"""A cancel (SIGTERM) always stops a probe loop, even one that came with a probe's surprise
(issue 26, bug 1, elsewhere).

The probe loop catches ``Exception`` so that one probe's surprise does not end the agent. A
probe with gRPC ingress gathers its HTTP and gRPC halves (``asyncio.gather``); on Python 3.11,
when a half fails in the same loop iteration as a cancel of the loop's task, the task gets the
half's error and the cancel is spent: the loop would log "probe failed" and go on for ever,
and the agent's task group would wait for it. The race is made here with futures the test
completes, on uvloop, without sleeping; the prober is the real one, its clients fakes.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from node_agent.probing import PodProbe
from servehealth_common.probe import Prober


class CarriedOn(Exception):
    """The loop went on to its next turn after its task was cancelled."""


class Waiting:
    """The probe's HTTP session and gRPC ``Healthz`` client: every call waits; the gRPC calls
    wait for futures the test completes."""

    def __init__(self) -> None:
        self.checks: list[asyncio.Future[object]] = []
        self.hedged = asyncio.Event()  # the first probe's and its hedge's calls are in flight

    async def get(self, url: str) -> tuple[int, bytes]:
        await asyncio.get_running_loop().create_future()
        raise AssertionError("never answered")

    async def check(self, address: str) -> object:
        answer: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.checks.append(answer)
        if len(self.checks) == 2:
            self.hedged.set()
        return await answer


async def test_a_cancel_with_a_probe_s_surprise_in_the_same_iteration_stops_the_loop() -> None:
    clients = Waiting()
    prober = Prober(clients, 30.0, grpc=clients)  # type: ignore[arg-type]

    async def next_turn(seconds: float) -> None:
        raise CarriedOn

    probe = PodProbe(
        "http://127.0.0.1:1/-/healthz",
        prober,
        interval=1.0,
        confirm_delay=0.0,  # the loop's task awaits the first probe itself (hedged at once)
        on_result=lambda result, changed: None,
        rng=random.Random(1),
        name="test proxy",
        grpc_address="127.0.0.1:2",
        sleep=next_turn,
    )
    task = asyncio.create_task(probe.run())
    try:
        async with asyncio.timeout(10):  # a guard only
            await clients.hedged.wait()
        # The first probe's gRPC half fails; the agent is cancelled before the gather hears of
        # it (its done callback runs in the next iteration).
        clients.checks[0].set_exception(RuntimeError("a surprise"))
        asyncio.get_running_loop().call_soon(task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        task.cancel()
        await asyncio.wait((task,))
