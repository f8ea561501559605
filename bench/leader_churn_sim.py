"""How often does a leader lose its Lease on a slow API server? The election's own code
(``aggregator/leader/elector.py``'s LeaderElector: the renew loop, the per-call deadlines, the
standby's polling) on a simulated clock, for many simulated hours: the rates that a real-process run
(``bench/failover.py --quiet``, minutes long) can only bound.

Two candidates share one in-memory Lease with resourceVersions. Every Lease call (get, create,
update) takes a delay drawn from ``--api-latency`` (``bench/api_latency.py``, one independent
draw per call, as ``bench/failover.py`` injects it into the emulator); a call its caller
abandons (its deadline passed) is never applied, as the emulator and an API server drop a
request whose client went away while it was queued. The leader renews (``hold()``); when it
loses the Lease it tries to release it (as the aggregator does on its way out), and
``--restart-delay`` later starts again as a standby with a new identity, as the kubelet
restarts the container. The standby polls (``acquire()``) and takes over.

Counted: leadership losses (per hour), and the time without a leader after each (from the
loss to the next acquisition). Not modelled: HTTP, the client's threads, the process's
other work and CPU contention (the real-process bench has them), requests other than the
Lease's. The event loop's clock is simulated: hours take seconds, e.g.::

    .venv/bin/python -m bench.leader_churn_sim --api-latency p99-1s --hours 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import selectors
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.leader.elector import ElectionSettings, LeaderElector, Lease, LeaseRecord
from bench import api_latency
from servehealth_common.kube.errors import APIConflictError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "leader_churn_sim.json"
#: The timings measured by default: lease / renew deadline / retry period (seconds).
DEFAULT_SETTINGS = "3/2/0.5,4/3/0.5,8/6/1,15/10/2"


# -- an event loop on a simulated clock ------------------------------------------------------


class _Clock:
    now = 0.0


class _SimulatedSelector(selectors.SelectSelector):
    """Waiting for ``timeout`` seconds moves the clock on instead: nothing here does I/O."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing scheduled, nothing ready")
        self._clock.now += max(0.0, timeout)
        return []


class SimulatedLoop(asyncio.SelectorEventLoop):
    """asyncio on a simulated clock: sleeps and timeouts take no real time."""

    def __init__(self) -> None:
        self.clock = _Clock()
        super().__init__(_SimulatedSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


# -- the Lease ---------------------------------------------------------------------------------


@dataclass
class SlowLeaseStore:
    """One Lease; each call waits its delay, then happens (if its caller still waits)."""

    delay: Any  # () -> seconds
    lease: Lease | None = None
    version: int = 0
    calls: int = 0

    def describe(self) -> str:
        return "sim/lease"

    async def _wait(self) -> None:
        self.calls += 1
        await asyncio.sleep(self.delay())  # a cancelled caller cancels this: nothing happens

    def _put(self, record: LeaseRecord) -> str:
        self.version += 1
        self.lease = Lease(record, str(self.version))
        return self.lease.version

    async def get(self) -> Lease | None:
        await self._wait()
        return self.lease

    async def create(self, record: LeaseRecord) -> str:
        await self._wait()
        if self.lease is not None:
            raise APIConflictError("create lease: HTTP 409: AlreadyExists", 409)
        return self._put(record)

    async def update(self, record: LeaseRecord, version: str) -> str:
        await self._wait()
        if self.lease is None or self.lease.version != version:
            raise APIConflictError("update lease: HTTP 409: Conflict", 409)
        return self._put(record)


@dataclass
class Outcome:
    settings: str
    simulated_hours: float
    losses: int
    lease_calls: int
    leaderless_s: list[float] = field(default_factory=list)

    @property
    def per_hour(self) -> float:
        return self.losses / self.simulated_hours

    def summary(self) -> dict[str, Any]:
        gaps = sorted(self.leaderless_s)
        return {
            "settings": self.settings,
            "simulated_hours": self.simulated_hours,
            "losses": self.losses,
            "losses_per_hour": round(self.per_hour, 4),
            "hours_between_losses": round(1 / self.per_hour, 1) if self.losses else None,
            "leaderless_after_loss_median_s": round(statistics.median(gaps), 2) if gaps else None,
            "leaderless_after_loss_max_s": round(gaps[-1], 2) if gaps else None,
            "lease_calls": self.lease_calls,
        }


async def simulate(
    settings: ElectionSettings,
    latency: api_latency.Latency,
    hours: float,
    seed: int,
    restart_delay: float,
    start_time: float,
) -> Outcome:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    store = SlowLeaseStore(latency.sampler(seed))
    end = loop.time() + hours * 3600
    generation = 0
    losses = 0
    gaps: list[float] = []
    lost_at: list[float] = []

    def candidate() -> LeaderElector:
        nonlocal generation
        generation += 1
        return LeaderElector(
            store,
            f"replica-{generation}",
            settings,
            clock=loop.time,
            rng=random.Random(rng.random()),
        )

    async def replica(elector: LeaderElector) -> None:
        """One process: a standby until it leads, then the leader until it loses the Lease;
        then it releases what it can and exits (the caller restarts it)."""
        nonlocal losses
        await elector.acquire()
        if lost_at:
            gaps.append(loop.time() - lost_at.pop())
        await elector.hold()
        losses += 1
        lost_at.append(loop.time())
        await elector.release()

    async def supervised() -> None:
        await asyncio.sleep(rng.uniform(0, 0.5))
        while True:
            await replica(candidate())
            await asyncio.sleep(restart_delay + start_time)

    tasks = [asyncio.create_task(supervised()) for _ in range(2)]
    await asyncio.sleep(max(0.0, end - loop.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    name = f"{settings.lease_duration:g}/{settings.renew_deadline:g}/{settings.retry_period:g}"
    return Outcome(name, hours, losses, store.calls, gaps)


def parse_settings(text: str) -> list[ElectionSettings]:
    found = []
    for item in text.split(","):
        lease, deadline, retry = (float(x) for x in item.split("/"))
        if lease != int(lease) or not lease > deadline > retry * 1.2 > 0:
            raise argparse.ArgumentTypeError(f"{item}: needs whole LEASE > DEADLINE > 1.2 x RETRY")
        found.append(ElectionSettings(int(lease), deadline, retry))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--api-latency",
        dest="latency",
        type=api_latency.parse,
        default=api_latency.parse("p99-1s"),
        help="the Lease calls' delays (bench/api_latency.py; p99-1s)",
    )
    parser.add_argument(
        "--settings",
        type=parse_settings,
        default=parse_settings(DEFAULT_SETTINGS),
        help=f"LEASE/DEADLINE/RETRY seconds, comma-separated ({DEFAULT_SETTINGS})",
    )
    parser.add_argument("--hours", type=float, default=200.0, help="simulated hours each (200)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--restart-delay", type=float, default=1.0, help="kubelet restart, seconds (1)"
    )
    parser.add_argument(
        "--start-time", type=float, default=1.0, help="a process's start, seconds (1)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    # Every failed call would be logged (a WARNING per kind): thousands of hours of them.
    logging.getLogger("aggregator.leader.elector").setLevel(logging.CRITICAL)
    started = time.monotonic()
    print(
        f"leader churn, simulated: {args.hours:g} h per setting, API {args.latency.describe()}",
        flush=True,
    )
    results = []
    for settings in args.settings:
        loop = SimulatedLoop()
        try:
            outcome = loop.run_until_complete(
                simulate(
                    settings,
                    args.latency,
                    args.hours,
                    args.seed,
                    args.restart_delay,
                    args.start_time,
                )
            )
        finally:
            loop.close()
        summary = outcome.summary()
        results.append(summary)
        between = summary["hours_between_losses"]
        print(
            f"  lease/renew/retry {outcome.settings:>10}: {outcome.losses:>5} losses in "
            f"{args.hours:g} h = {outcome.per_hour:.3f}/h"
            + (f" (one every {between:g} h)" if between else "")
            + (
                f", leaderless after a loss: median {summary['leaderless_after_loss_median_s']}"
                f" s, max {summary['leaderless_after_loss_max_s']} s"
                if outcome.losses
                else ""
            ),
            flush=True,
        )
    result = {
        "benchmark": "leader_churn_sim",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "api_latency": {"spec": args.latency.spec, "described": args.latency.describe()},
        "hours_each": args.hours,
        "seed": args.seed,
        "restart_delay_s": args.restart_delay,
        "start_time_s": args.start_time,
        "results": results,
        "wall_time_s": round(time.monotonic() - started, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} ({result['wall_time_s']}s wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
