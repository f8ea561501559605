"""Kubernetes Events on pods whose serve label (or condition) changes (best effort,
rate-limited): ``ServeHealthy``, ``ServeUnhealthy``, and ``ServeNoProxyByDesign`` (Normal: a pod
where Serve runs no proxy by design); and on the manual override: ``ServeOverrideApplied``,
``ServeOverrideRemoved`` (Normal), ``ServeOverrideIgnored`` (Warning: a value that is not one)."""

from __future__ import annotations

import asyncio
import logging

from aiolimiter import AsyncLimiter

from aggregator.decision.override import OverrideChange
from aggregator.decision.tracker import StateChange
from aggregator.kube.api import KubeApi
from aggregator.metrics import Metrics
from servehealth_common.kube.errors import APIError
from servehealth_common.pod_identity import PodInfo
from servehealth_common.pod_writes import bodies
from servehealth_common.pod_writes.times import utc_now
from servehealth_common.states import ServeState

log = logging.getLogger(__name__)

COMPONENT = "ray-serve-health"


class EventRecorder:
    """Sends at most ``qps`` events per second (bursts of ``burst``); drops the rest, counted.

    Events share nothing with label writes but the API server: a label is the truth and is
    never dropped; an event is a courtesy and is.
    """

    def __init__(self, api: KubeApi, metrics: Metrics, qps: float = 5, burst: int = 25) -> None:
        self._api = api
        self._metrics = metrics
        self._limiter = AsyncLimiter(burst, burst / qps)
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting = 0

    def record(self, pod: PodInfo, transition: StateChange) -> None:
        serving = transition.new is ServeState.SERVING
        if transition.new is ServeState.NO_PROXY_BY_DESIGN:  # a steady state, not a failure
            reason, kind = "ServeNoProxyByDesign", "Normal"
        else:
            reason, kind = ("ServeHealthy", "Normal") if serving else ("ServeUnhealthy", "Warning")
        message = f"Serve proxy {transition.old.name} -> {transition.new.name}: {transition.reason}"
        self._record(pod, reason, message, kind)

    def record_override(self, pod: PodInfo, change: OverrideChange) -> None:
        reason = f"ServeOverride{change.kind.capitalize()}"
        self._record(pod, reason, change.message, "Warning" if change.warning else "Normal")

    def _record(self, pod: PodInfo, reason: str, message: str, kind: str) -> None:
        # Tokens are taken when a send starts: count the sends already waiting for one, or a
        # burst of transitions would queue instead of being dropped.
        if not self._limiter.has_capacity(self._waiting + 1):
            self._metrics.events.labels("dropped").inc()
            return
        body = bodies.event_body(
            pod.key,
            pod.uid,
            reason=reason,
            message=message,
            kind=kind,
            component=COMPONENT,
            instance=COMPONENT,
            when=utc_now(),
        )
        self._waiting += 1
        task = asyncio.create_task(self._send(pod, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, pod: PodInfo, body: dict[str, object]) -> None:
        try:
            await self._limiter.acquire()
        finally:
            self._waiting -= 1
        try:
            await self._api.create_event(pod.key.namespace, body)
        except APIError as error:
            self._metrics.events.labels("error").inc()
            log.warning("event for pod %s not recorded: %s", pod.key, error)
        else:
            self._metrics.events.labels("sent").inc()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
