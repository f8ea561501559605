"""``serve-health-aggregator`` / ``python -m aggregator``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence

from aggregator.server import Aggregator
from aggregator.settings import Settings
from servehealth_common import logs, runtime
from servehealth_common.config import load
from servehealth_common.kube.client import NoKubeConfig

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
    logs.setup(settings.log_level, settings.log_format)
    try:
        runtime.run(run(settings))
    except NoKubeConfig as error:
        logging.getLogger("aggregator").error("cannot start: %s", error)
        return 1
    except OSError as error:
        logging.getLogger("aggregator").error("cannot start: %s", error)
        return 1
    return 0
