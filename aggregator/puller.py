"""The pull fallback: the aggregator probes pods itself when no agent speaks for them.

When: at once for every pod of an agent whose stream closed; for a pod whose agent is silent
(SILENT); for pods whose agent is gone, a little before each heartbeat TTL runs out, so they
never go SILENT while their proxy answers; every ``pull_interval`` for pods that never had an
agent (pure-pull mode). How: GET the pod's ``http://<podIP>:<serve port>/-/healthz`` (and
``/-/routes``), classified exactly as the agent does (one shared module), a failure confirmed
by a second probe, with ``pull_timeout`` per probe and at most ``pull_concurrency`` in flight
over one keep-alive HTTP client (``servehealth_common.http``). Never one after another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aggregator.core import Core
from aggregator.metrics import Metrics
from aggregator.tracker import Observation, PodKey, PodRecord
from servehealth_common.probe import Prober, ProbeResult
from servehealth_common.states import Source

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullSettings:
    pull_interval: float
    pull_timeout: float
    pull_concurrency: int
    heartbeat_ttl: float
    confirm_delay: float = 0.1
    tick: float = 0.5  # each tick scans every record: keep it cheap at 10,000 pods

    @property
    def orphan_interval(self) -> float:
        """How often a pod whose agent is gone is pulled: early enough that the pull (and its
        confirmation) lands before the heartbeat TTL runs out."""
        margin = 2 * self.pull_timeout + self.confirm_delay + self.tick
        return max(self.heartbeat_ttl - margin, self.tick)


class Puller:
    def __init__(
        self,
        core: Core,
        prober: Prober,
        settings: PullSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = core
        self._prober = prober
        self.settings = settings
        self._metrics = metrics
        self._clock = clock
        self._in_flight: dict[PodKey, asyncio.Task[None]] = {}

    # -- what the core asks -------------------------------------------------------------

    def url(self, key: PodKey) -> str | None:
        pod = self._core.registry.pod(key)
        if pod is None or not pod.pod_ip or not pod.serve_port:
            return None
        host = f"[{pod.pod_ip}]" if ":" in pod.pod_ip else pod.pod_ip
        return f"http://{host}:{pod.serve_port}/-/healthz"

    def can_pull(self, key: PodKey) -> bool:
        return self.url(key) is not None

    def pull_now(self, keys: Iterable[PodKey]) -> None:
        for key in keys:
            url = self.url(key)
            if url is not None and key not in self._in_flight:
                task = asyncio.create_task(self._pull(key, url), name=f"pull {key}")
                self._in_flight[key] = task

    async def sweep(self, keys: Iterable[PodKey]) -> None:
        """Pull ``keys`` now and wait until every pull is done (a full sweep)."""
        self.pull_now(keys)
        await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    # -- the work -----------------------------------------------------------------------

    async def _pull(self, key: PodKey, url: str) -> None:
        try:
            record = self._core.tracker.get(key)
            previous = record.state if record is not None else None
            started = self._clock()
            # The prober bounds probes in flight (pull_concurrency); a slot is not held while
            # a failure waits for its confirmation.
            result = await self._prober.probe_confirmed(url, previous, self.settings.confirm_delay)
            self._record(result)
            self._core.pulled(key, observation(result), started)
        except Exception:  # one pod's surprise must not stop the others
            log.exception("pull of pod %s failed", key)
        finally:
            self._in_flight.pop(key, None)

    def _record(self, result: ProbeResult) -> None:
        self._metrics.pull_probes.labels(result.state.name).inc()
        self._metrics.pull_latency.observe(result.latency)

    def due(self, record: PodRecord, now: float) -> bool:
        """Whether ``record`` should be pulled now."""
        if self._core.tracker.agent_speaks(record, now):
            return False
        if record.observed_at is None:
            return True
        interval = (
            self.settings.orphan_interval  # it had an agent: keep it fresh within the TTL
            if record.pushed_at is not None
            else self.settings.pull_interval  # it never had one: pure-pull mode
        )
        return now - record.observed_at >= interval

    async def run(self) -> None:
        """Every tick, pull the pods that are due."""
        try:
            while True:
                now = self._clock()
                if self._core.tracker.in_grace():  # agents are reconnecting: let them speak
                    await asyncio.sleep(self.settings.tick)
                    continue
                self.pull_now(
                    record.key
                    for record in self._core.tracker.records()
                    if record.key not in self._in_flight and self.due(record, now)
                )
                await asyncio.sleep(self.settings.tick)
        finally:
            for task in list(self._in_flight.values()):
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)


def observation(result: ProbeResult) -> Observation:
    return Observation(result.state, result.reason, result.http_status, result.latency, Source.PULL)
