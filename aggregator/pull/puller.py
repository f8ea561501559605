"""The pull fallback: the aggregator probes pods itself when no agent speaks for them.

When: at once for every pod of an agent whose stream closed; for a pod whose agent is silent
(SILENT); for pods whose agent is gone, a little before each heartbeat TTL runs out, so they
never go SILENT while their proxy answers; every ``pull_interval`` for pods that never had an
agent (pure-pull mode). How: GET the pod's ``http://<podIP>:<serve port>/-/healthz`` (and
``/-/routes``), classified exactly as the agent does (one shared module), a failure confirmed
by a second probe (a hung pod by a hedged one that goes unanswered too: one ``pull_timeout``
in all, unless the hedge waited for a concurrency slot or the event loop was too busy to tell;
see ``Prober.probe_confirmed``), with ``pull_timeout`` per probe and at most
``pull_concurrency`` in flight over one keep-alive HTTP client (``servehealth_common.http``).
Never one after another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aggregator.decision.fleet_look import OnLooked
from aggregator.decision.tracker import Observation, PodRecord
from aggregator.metrics import Metrics
from servehealth_common.grpc_healthz import GrpcHealthz
from servehealth_common.http import HTTPClient
from servehealth_common.kube.pods import grpc_address, healthz_url
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.probe import Prober, ProbeResult, make_session
from servehealth_common.runtime import cancel_and_wait
from servehealth_common.states import ServeState, Source

if TYPE_CHECKING:
    from aggregator.decision.core import Core

log = logging.getLogger(__name__)

#: Idle keep-alive connections the pull fallback keeps at most (one per pod it pulls).
PULL_MAX_IDLE = 4096


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
    """Pulls for the core it was started for (:meth:`start`, while this replica leads); asked
    to pull while stopped, it does nothing."""

    def __init__(
        self,
        settings: PullSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._clock = clock
        self._core: Core | None = None
        self._session: HTTPClient | None = None
        self._grpc: GrpcHealthz | None = None
        self._prober: Prober | None = None
        self._loop: asyncio.Task[None] | None = None
        self._in_flight: dict[PodKey, asyncio.Task[None]] = {}
        self._looks: set[asyncio.Task[None]] = set()

    # -- what the core asks (PullTrigger) -----------------------------------------------

    def _addressed(self, key: PodKey) -> PodInfo | None:
        """The pod, if this puller runs and the pod's address is known."""
        pod = self._core.pod_info(key) if self._core is not None else None
        return pod if pod is not None and pod.pod_ip else None

    def url(self, key: PodKey) -> str | None:
        """Where the pod's proxy answers, if this puller runs and the pod's address is known."""
        pod = self._addressed(key)
        return healthz_url(pod.pod_ip, pod.serve_port) if pod and pod.serve_port else None

    def grpc_address(self, key: PodKey) -> str | None:
        """Where the pod's gRPC proxy answers, if it declares one (container port
        ``serve-grpc``): a pull then asks both proxies, as the agents do."""
        pod = self._addressed(key)
        return grpc_address(pod.pod_ip, pod.grpc_port) if pod and pod.grpc_port else None

    def can_pull(self, key: PodKey) -> bool:
        return self.url(key) is not None

    def pull_now(self, keys: Iterable[PodKey]) -> list[asyncio.Task[None]]:
        """Start a pull of each of ``keys`` not being pulled already; the pulls started."""
        started = []
        for key in keys:
            url = self.url(key)
            if url is not None and key not in self._in_flight:
                task = asyncio.create_task(self._pull(key, url), name=f"pull {key}")
                self._in_flight[key] = task
                started.append(task)
        return started

    def look(self, keys: Sequence[PodKey], on_looked: OnLooked) -> Callable[[], None]:
        """Probe each of ``keys`` at once for self-protection
        (:mod:`aggregator.decision.fleet_look`); a pod no agent speaks for counts as pulled too.
        Returns a canceller."""
        tasks: list[asyncio.Task[None]] = []
        for key in keys:
            task = asyncio.create_task(self._look_at(key, on_looked), name=f"look {key}")
            self._looks.add(task)
            task.add_done_callback(self._looks.discard)
            tasks.append(task)

        def cancel() -> None:
            for task in tasks:
                task.cancel()

        return cancel

    async def _look_at(self, key: PodKey, on_looked: OnLooked) -> None:
        url = self.url(key)  # None: nothing to look at (answered, not failing)
        state = ServeState.UNKNOWN if url is None else await self._probe(key, url, looking=True)
        on_looked(key, state)

    # -- the work -----------------------------------------------------------------------

    async def _pull(self, key: PodKey, url: str) -> None:
        try:
            await self._probe(key, url)
        finally:
            self._in_flight.pop(key, None)

    async def _probe(self, key: PodKey, url: str, *, looking: bool = False) -> ServeState:
        """Probe the pod and hand what it says to the core (a look: only if no agent speaks for
        the pod); the state it answered (UNKNOWN if the probe failed)."""
        core, prober = self._core, self._prober
        assert core is not None
        assert prober is not None
        state = ServeState.UNKNOWN
        try:
            record = core.pod(key)
            previous = record.state if record is not None else None
            started = self._clock()
            # The prober bounds probes in flight (pull_concurrency); a slot is not held while
            # a failure waits for its confirmation.
            result = await prober.probe_confirmed(
                url, previous, self.settings.confirm_delay, self.grpc_address(key)
            )
            self._metrics.pull_probes.labels(result.state.name).inc()
            self._metrics.pull_latency.observe(result.latency)
            state = result.state
            if not looking or (record is not None and not core.agent_speaks(record, self._clock())):
                core.pulled(key, observation(result), started)
        except Exception:  # one pod's surprise must not stop the others
            log.exception("look at pod %s failed" if looking else "pull of pod %s failed", key)
        return state

    def _due(self, core: Core, record: PodRecord, now: float) -> bool:
        """Whether ``record`` should be pulled now."""
        if core.agent_speaks(record, now):
            return False
        if record.observed_at is None:
            return True
        interval = (
            self.settings.orphan_interval  # it had an agent: keep it fresh within the TTL
            if record.pushed_at is not None
            else self.settings.pull_interval  # it never had one: pure-pull mode
        )
        return now - record.observed_at >= interval

    def start(self, core: Core) -> None:
        """Pull for ``core`` from now on (this replica leads), until :meth:`stop`."""
        settings = self.settings
        self._session = make_session(max_idle=PULL_MAX_IDLE, max_idle_per_host=1)
        self._grpc = GrpcHealthz(settings.pull_timeout)  # no channel until a pod declares one
        self._prober = Prober(
            self._session,
            settings.pull_timeout,
            self._clock,
            concurrency=settings.pull_concurrency,
            grpc=self._grpc,
        )
        self._core = core
        self._loop = asyncio.create_task(self._run(core), name="puller")

    async def stop(self) -> None:
        """Stop pulling: every pull in flight is cancelled, the HTTP client closed."""
        loop, self._loop = self._loop, None
        self._core = None
        await cancel_and_wait(loop)
        tasks = [*self._in_flight.values(), *self._looks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._grpc is not None:
            await self._grpc.close()
        self._session = self._prober = self._grpc = None

    async def _run(self, core: Core) -> None:
        """Every tick, pull the pods that are due."""
        tick = self.settings.tick
        while True:
            now = self._clock()
            if not core.in_grace():  # during it, agents are reconnecting: let them speak
                # A pod kept alive by its agent's open stream is never due: skipped first,
                # cheaply (most of a large fleet).
                self.pull_now(
                    record.key
                    for record in core.pods()
                    if not (record.kept and record.agent is not None)
                    and record.key not in self._in_flight
                    and self._due(core, record, now)
                )
            await asyncio.sleep(tick)


def observation(result: ProbeResult) -> Observation:
    return Observation(result.state, result.reason, result.http_status, result.latency, Source.PULL)
