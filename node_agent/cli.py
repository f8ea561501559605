"""``serve-health-agent`` / ``python -m node_agent``."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from node_agent import watchdog
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import (
    InvalidIdentity,
    MissingIdentity,
    SidecarPod,
    node_name_from_environ,
)
from node_agent.sink import NO_METRICS
from node_agent.watchdog import Watchdog
from servehealth_common import logs, runtime
from servehealth_common.config import load
from servehealth_common.grpc_healthz import GrpcHealthz
from servehealth_common.listening import CannotListen
from servehealth_common.probe import Prober, make_session

if TYPE_CHECKING:  # the Kubernetes client costs ~30 MiB: only DaemonSet mode loads it
    from node_agent.daemonset import NodeAgent

DESCRIPTION = (
    "Probe Ray Serve proxies (HTTP, and gRPC with --grpc-proxy-port) and stream their health "
    "to the ray-serve-health aggregator. "
    "Sidecar mode: the local proxy, identity from the downward API (POD_NAMESPACE, POD_NAME, "
    "POD_UID, NODE_NAME). DaemonSet mode: every Ray pod on the node NODE_NAME, found by listing "
    "and watching pods."
)

log = logging.getLogger("node_agent")

#: Builds the agent once the probe session exists (it must be made inside the event loop):
#: ``make_agent(prober, watchdog=..., metrics=...)``.
MakeAgent = Callable[..., "Agent | NodeAgent"]


async def run(settings: AgentFlags, make_agent: MakeAgent) -> None:
    """Run the agent until SIGTERM or SIGINT; with ``--metrics-listen``, its endpoint too
    (bound first: :class:`CannotListen` before anything started)."""
    grpc_healthz = GrpcHealthz(settings.probe_timeout)  # no channel until a gRPC probe
    try:
        async with make_session() as session:
            prober = Prober(
                session,
                settings.probe_timeout,
                concurrency=settings.probe_concurrency,
                grpc=grpc_healthz,
            )
            stall_timeout = settings.effective_stall_timeout
            dog = Watchdog(stall_timeout) if stall_timeout else None
            if not settings.metrics_listen:
                agent = make_agent(prober, watchdog=dog, metrics=NO_METRICS)
                await _run_until_signalled(agent, dog)
                return
            from node_agent import metrics  # prometheus_client: only with --metrics-listen

            sink = metrics.AgentMetrics()
            agent = make_agent(prober, watchdog=dog, metrics=sink)
            async with metrics.serving(settings.metrics_listen, sink, agent, dog):
                await _run_until_signalled(agent, dog)
    finally:
        await grpc_healthz.close()


async def _run_until_signalled(agent: Agent | NodeAgent, dog: Watchdog | None) -> None:
    task = asyncio.create_task(agent.run())
    if dog is not None:
        beat = asyncio.create_task(watchdog.beat_forever(dog), name="watchdog beat")
        task.add_done_callback(lambda _: beat.cancel())
        watchdog.start(dog)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("agent stopped")


def main(argv: Sequence[str] | None = None) -> int:
    settings = load(AgentFlags, argv, os.environ, "serve-health-agent", DESCRIPTION)
    logs.setup(settings.log_level, settings.log_format)
    try:
        if settings.mode == "daemonset":
            return _run_daemonset(settings)
        return _run_sidecar(settings)
    except (MissingIdentity, InvalidIdentity) as error:
        print(f"serve-health-agent: error: {error}", file=sys.stderr)
        return 2
    except CannotListen as error:  # --metrics-listen: the address, the flag and why
        log.error("cannot start: %s", error)
        return 1


def _run_sidecar(settings: AgentFlags) -> int:
    identity = SidecarPod.from_environ(os.environ)
    grpc = settings.grpc_proxy_address
    log.info(
        "agent for pod %s on node %s: probing %s every %gs, reporting to %s",
        identity,
        identity.node_name,
        settings.proxy_url + (f" and gRPC proxy {grpc}" if grpc else ""),
        settings.interval,
        settings.aggregator,
    )
    runtime.run(run(settings, functools.partial(Agent, settings, identity)))
    return 0


def _run_daemonset(settings: AgentFlags) -> int:
    from node_agent.daemonset import NodeAgent
    from node_agent.kube_client import make_kube_client
    from servehealth_common.kube.client import NoKubeConfig

    node_name = node_name_from_environ(os.environ)
    try:
        client = make_kube_client(settings)
    except NoKubeConfig as error:
        print(f"serve-health-agent: error: {error}", file=sys.stderr)
        return 2
    log.info(
        "agent for node %s: probing the Ray pods on it (selector %r, %s) every %gs, "
        "reporting to %s",
        node_name,
        settings.pod_selector,
        f"namespaces {', '.join(settings.namespace)}" if settings.namespace else "all namespaces",
        settings.interval,
        settings.aggregator,
    )
    try:
        runtime.run(run(settings, functools.partial(NodeAgent, settings, node_name, client=client)))
    finally:
        client.close()
    return 0
