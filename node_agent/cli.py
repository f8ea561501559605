"""``serve-health-agent`` / ``python -m node_agent``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from node_agent.agent import Agent
from node_agent.identity import Identity, MissingIdentity
from node_agent.settings import Settings
from servehealth_common.config import load
from servehealth_common.probe import Prober, make_session

DESCRIPTION = (
    "Probe the local Ray Serve HTTP proxy and stream its health to the ray-serve-health "
    "aggregator. Identity comes from the downward API: POD_NAMESPACE, POD_NAME, POD_UID, "
    "NODE_NAME."
)

log = logging.getLogger("node_agent")


async def run(settings: Settings, identity: Identity) -> None:
    async with make_session(max_connections=4) as session:
        agent = Agent(settings, identity, Prober(session, settings.probe_timeout))
        task = asyncio.create_task(agent.run())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("agent stopped")


def main(argv: Sequence[str] | None = None) -> int:
    settings = load(Settings, argv, os.environ, "serve-health-agent", DESCRIPTION)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        identity = Identity.from_environ(os.environ)
    except MissingIdentity as error:
        print(f"serve-health-agent: error: {error}", file=sys.stderr)
        return 2
    log.info(
        "agent for pod %s on node %s: probing %s every %gs, reporting to %s",
        identity,
        identity.node_name,
        settings.proxy_url,
        settings.interval,
        settings.aggregator,
    )
    asyncio.run(run(settings, identity))
    return 0
