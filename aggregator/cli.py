"""``serve-health-aggregator`` / ``python -m aggregator``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence

from aggregator import heap
from aggregator.flags import AggregatorFlags
from aggregator.leader.lease import LeaderElectionConfigError
from aggregator.wiring import build_aggregator
from servehealth_common import logs, runtime
from servehealth_common.config import load
from servehealth_common.kube.client import NoKubeConfig

DESCRIPTION = (
    "Aggregate Ray Serve proxy health pushed by node agents, and decide which pods carry the "
    "serve label."
)


def parse(argv: Sequence[str] | None = None) -> AggregatorFlags:
    return load(AggregatorFlags, argv, os.environ, "serve-health-aggregator", DESCRIPTION)


async def run(settings: AggregatorFlags) -> int:
    """Serve until SIGTERM/SIGINT (exit 0), or until leadership is lost (exit 1: the
    Deployment restarts the replica, which comes back as a standby)."""
    # The handlers first: a SIGTERM during the start is a stop right after it, not a kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    _check_open_files(settings.max_connections)
    aggregator = build_aggregator(settings)
    # Returns once the port is open: the first pod list (retried while the Kubernetes API does
    # not answer) and the election go on in the background, and a SIGTERM meanwhile ends them.
    await aggregator.open()
    long_lived = heap.LongLived()
    long_lived.install()
    thaw = asyncio.create_task(long_lived.thaw_forever(), name="gc thaw")
    waiters = (
        asyncio.create_task(stop.wait(), name="signals"),
        asyncio.create_task(aggregator.wait(), name="aggregator"),
    )
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    thaw.cancel()
    long_lived.uninstall()
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    await aggregator.stop()
    if aggregator.lost:
        logging.getLogger("aggregator").error("exiting: %s", aggregator.lost)
        return 1
    return 0


def _check_open_files(max_connections: int) -> None:
    """Raise the open-files limit; warn when it cannot hold --max-connections agents (each
    holds a socket), since accepting more would fail."""
    soft, _ = runtime.raise_open_files_limit()
    if soft < max_connections:
        logging.getLogger("aggregator").warning(
            "the open-files limit (%d) is below --max-connections (%d): connections beyond "
            "it will fail; raise the limit (ulimit -n) or lower --max-connections",
            soft,
            max_connections,
        )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    logs.setup(settings.log_level, settings.log_format)
    try:
        return runtime.run(run(settings))
    except (NoKubeConfig, LeaderElectionConfigError, OSError) as error:
        logging.getLogger("aggregator").error("cannot start: %s", error)
        return 1
