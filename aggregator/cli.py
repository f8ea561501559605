"""``serve-health-aggregator`` / ``python -m aggregator``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from aggregator.kube.api import NoKubeConfig
from aggregator.server import Aggregator
from aggregator.settings import Settings
from servehealth_common.config import load

DESCRIPTION = (
    "Aggregate Ray Serve proxy health pushed by node agents, and decide which pods carry the "
    "serve label."
)


def parse(argv: Sequence[str] | None = None) -> Settings:
    return load(Settings, argv, os.environ, "serve-health-aggregator", DESCRIPTION)


async def run(settings: Settings) -> None:
    aggregator = Aggregator(settings)
    await aggregator.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await aggregator.stop()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(run(settings))
    except NoKubeConfig as error:
        logging.getLogger("aggregator").error("cannot start: %s", error)
        return 1
    except OSError as error:
        logging.getLogger("aggregator").error("cannot start: %s", error)
        return 1
    return 0
