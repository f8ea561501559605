"""Run the aggregator: the gRPC port, health, reflection, /metrics, and the phases.

Every component arrives built (:mod:`aggregator.wiring`); this module only starts and stops
them, in the order the phases (:mod:`aggregator.lifecycle`) call for:

- the port opens first, whatever the Kubernetes API does: grpc.health.v1 answers ``liveness``
  SERVING at once, and ``""`` and the Report service NOT_SERVING until this replica leads;
- without leader election: list the pods (seeding them from their labels; the list is retried
  with backoff for as long as it fails, reports refused meanwhile, STARTING), then lead
  (expiry and pulls run, reports served, ``""`` SERVING);
- with it: a standby (reports refused) until the Lease is held; then list the pods, start
  expiry and pulls, and serve reports (LEADING); on losing the Lease, step down (stop every
  write first) and let the process exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aggregator import __version__
from aggregator.binding import add_grpc_port, host_port, start_metrics
from aggregator.channel_options import GrpcServerSettings, server_options
from aggregator.decision.core import Core
from aggregator.guard import Guard
from aggregator.ingest.report_service import ReportService
from aggregator.inspection_service import InspectionService
from aggregator.leader.elector import LeaderElector
from aggregator.leader.fallback_found import count_agent_writes
from aggregator.leader.label import LeaderLabel
from aggregator.leader.lease import KubeLeaseStore
from aggregator.lifecycle import Lifecycle, Phase
from aggregator.metrics import Metrics
from aggregator.pull.expiry import ExpiryLoop
from aggregator.pull.puller import Puller
from aggregator.registry import PodRegistry
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.config import split_host_port
from servehealth_common.metrics_http import MetricsServer
from servehealth_common.runtime import cancel_and_wait
from servehealth_common.tls import ReloadingServerCertificate

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["ReportService"].full_name,
    pb.DESCRIPTOR.services_by_name["InspectionService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)
#: grpc.health.v1 names SERVING only while this replica leads (pods listed; with
#: --leader-elect, the Lease held): for grpcurl and agents that know every replica. The
#: kubelet's probes use /livez and /readyz on the metrics port (plaintext, whatever TLS the gRPC
#: port has), and the Service selects the leader by its label (aggregator/leader/label.py).
LEADER_ONLY = ("", SERVICE_NAMES[0])
#: A grpc.health.v1 name SERVING for as long as the process runs, leader, standby or waiting
#: for the Kubernetes API: for the liveness and startup probes (a replica must not be restarted
#: for being a standby, or for an API server that does not answer yet).
LIVENESS = "liveness"


@dataclass(frozen=True, slots=True)
class PortSettings:
    """The gRPC port: where, with which certificates, how long a drain waits."""

    listen: str
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    shutdown_grace: float = 2.0
    #: After the pods were listed, how long no pod may go SILENT (agents reconnecting).
    startup_grace: float = 6.0
    label_key: str = "ray.io/serve"
    grpc: GrpcServerSettings = field(default_factory=GrpcServerSettings)


@dataclass(frozen=True, slots=True)
class Election:
    elector: LeaderElector
    store: KubeLeaseStore
    #: For the startup log line.
    timings: str
    #: The leader's label on its own pod (--leader-label), or None.
    label: LeaderLabel | None = None


@dataclass(eq=False, repr=False)
class Aggregator:
    """One aggregator process: ``await start()`` (or ``open()``, which does not wait for the
    first pod list), then ``await stop()`` (which drains)."""

    settings: PortSettings
    _: KW_ONLY
    lifecycle: Lifecycle
    core: Core
    registry: PodRegistry
    metrics: Metrics
    puller: Puller
    expiry: ExpiryLoop
    reports: ReportService
    inspection: InspectionService
    metrics_server: MetricsServer | None
    guard: Guard | None
    election: Election | None
    health: health.aio.HealthServicer = field(init=False, default_factory=health.aio.HealthServicer)
    port: int = field(init=False, default=0)
    #: With --tls-cert: the fetcher that reloads rotated certificate files (kept alive
    #: here: gRPC's C core calls it at each handshake).
    _tls: ReloadingServerCertificate | None = field(init=False, default=None)
    _server: grpc.aio.Server | None = field(init=False, default=None)
    _finished: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _electing: asyncio.Task[None] | None = field(init=False, default=None)
    #: Without leader election: the first pod list, then leading (stop() may cancel it).
    _syncing: asyncio.Task[None] | None = field(init=False, default=None)
    #: Why leading failed without leader election (a bug; see _lead_at_once).
    _failed: str | None = field(init=False, default=None)

    @property
    def lost(self) -> str | None:
        """Why leadership was lost, or never began (None while neither): the process should
        exit 1."""
        return self.lifecycle.step_down_reason or self._failed

    async def start(self) -> None:
        """:meth:`open`, then, without leader election, wait until this replica leads (its
        first pod list succeeded), or :meth:`stop` ended that wait, or leading failed
        (:attr:`lost` says why). With leader election it returns as soon as the port is open."""
        await self._or_stop(self._start())

    async def open(self) -> None:
        """Bind both ports (both before the gRPC server starts) and serve grpc.health.v1
        (``liveness`` SERVING, ``""`` NOT_SERVING), inspection and reflection; then become the
        leader in the background (see the module's docstring). Reports are refused until then."""
        await self._or_stop(self._open())

    async def _or_stop(self, starting: Coroutine[Any, Any, None]) -> None:
        """A start that fails (OSError "cannot listen on ..." for a port that cannot be bound)
        or is cancelled stops what it had started, then raises: nothing is left to a closed
        loop."""
        try:
            await starting
        except BaseException:
            try:
                await self.stop("start failed: stopping what was started")
            except Exception:  # the start's own error is the one to report
                log.exception("stopping after a failed start failed as well")
            raise

    async def _start(self) -> None:
        await self._open()
        if self._syncing is not None:
            await asyncio.wait((self._syncing,))  # also ends when stop() cancels it

    async def _open(self) -> None:
        settings = self.settings
        server = self._server = grpc.aio.server(options=server_options(settings.grpc))
        self.reports.register(server)  # undecodable messages: INVALID_ARGUMENT, not INTERNAL
        pb_grpc.add_InspectionServiceServicer_to_server(self.inspection, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
        self.port, self._tls = await add_grpc_port(
            server, settings.listen, settings.tls_cert, settings.tls_key, settings.tls_client_ca
        )
        if self.metrics_server is not None:
            await start_metrics(self.metrics_server)
        if self.election is not None:  # before the port opens: no stream slips through
            self.lifecycle.move_to(Phase.STANDBY, "leader election: waiting for the Lease")
        # Until this replica leads: NOT_SERVING for "" and reports (STARTING or STANDBY
        # refuse them), SERVING for liveness (the kubelet must not restart it for waiting).
        for name in ("", *SERVICE_NAMES, LIVENESS):
            await self.health.set(name, NOT_SERVING if name in LEADER_ONLY else SERVING)
        await server.start()
        self._log_start()
        if self.election is not None:
            if self.election.label is not None:
                self.election.label.start()
            self._electing = asyncio.create_task(self._lead(), name="leader-election")
        else:
            self._syncing = asyncio.create_task(self._lead_at_once(), name="first-pod-list")

    def _log_start(self) -> None:
        settings = self.settings
        metrics = host_port(*self.metrics_server.address) if self.metrics_server else "off"
        log.info(
            "aggregator %s listening on %s (%s, metrics %s), backend %s, label %s",
            __version__,
            host_port(split_host_port(settings.listen)[0], self.port),
            ("mutual TLS" if settings.tls_client_ca else "TLS")
            if settings.tls_cert
            else "plaintext",
            metrics,
            self.registry.name,
            settings.label_key,
        )
        if self.election is not None:
            log.info(
                "leader election on: a standby until %s holds lease %s (%s)",
                self.election.elector.identity,
                self.election.store.describe(),
                self.election.timings,
            )

    # -- leadership ---------------------------------------------------------------------

    async def _start_registry(self) -> None:
        """List the pods (seeding the tracker from their labels), then watch and write."""
        await self.registry.start(self.core)
        previous = self.election.elector.previous if self.election is not None else None
        count_agent_writes(self.registry, previous, self.metrics)
        if self.registry.seeds_from_cluster:
            self.core.hold_expiry(self.settings.startup_grace)

    async def _stop_leader_tasks(self) -> None:
        await self.expiry.stop()
        await self.puller.stop()

    async def _lead_at_once(self) -> None:
        """Without leader election: list the pods (retried for as long as the API fails:
        :meth:`~servehealth_common.kube.watch.PodWatch.list_all`), then lead. Any other
        failure (a bug) ends :meth:`wait`, :attr:`lost` saying why: the process exits 1 rather
        than stay up and never serve."""
        listed = "; pods listed" if self.registry.seeds_from_cluster else ""
        try:
            await self._take_over(f"no leader election: this replica leads{listed}")
        except Exception as error:
            log.exception("could not start leading")
            self._failed = f"could not start leading: {error!r}"
            self._finished.set()

    async def _lead(self) -> None:
        """A standby until this replica holds the Lease; then the leader until it loses it
        (the renew deadline passed, or another holder took it): then it steps down and
        :meth:`wait` returns, with :attr:`lost` saying why (the process exits 1)."""
        acquired: list[bool] = []  # set once the Lease is held (for the step-down log)
        try:
            reason = await self._elect_and_lead(acquired)
        except Exception as error:  # a bug: never stay a silent standby for ever
            log.exception("leader election failed")
            reason = f"leader election failed: {error!r}"
        await self._step_down(reason, led=bool(acquired))

    async def _elect_and_lead(self, acquired: list[bool]) -> str:
        assert self.election is not None
        elector = self.election.elector
        await elector.acquire()
        acquired.append(True)
        self.metrics.leader.set(1)
        self.metrics.leader_transitions.labels("acquired").inc()
        log.info(
            "leader election: %s leads; taking over from the labels pods carry", elector.identity
        )
        holding = asyncio.create_task(elector.hold(), name="lease-renewal")
        taking_over = asyncio.create_task(
            self._take_over("holding the Lease; pods listed"), name="take-over"
        )
        try:
            await asyncio.wait((holding, taking_over), return_when=asyncio.FIRST_COMPLETED)
            if holding.done():
                return holding.result()
            if (error := taking_over.exception()) is not None:
                return f"could not take over as the leader: {error}"
            return await holding
        finally:
            # What they raised is logged where they ran.
            await cancel_and_wait(holding, taking_over, ignore=(Exception,))

    async def _take_over(self, why: str) -> None:
        """List the pods (retried until the API answers), then lead: expiry, pulls, reports,
        ``""`` SERVING."""
        await self._start_registry()
        self.expiry.start()
        self.puller.start(self.core)
        self.lifecycle.move_to(Phase.LEADING, why)
        if self.election is None:
            self.metrics.leader.set(1)
        for name in LEADER_ONLY:
            await self.health.set(name, SERVING)
        if self.election is not None and self.election.label is not None:
            self.election.label.lead()
        log.info("leader: serving, %d pods tracked", self.core.tracked())

    async def _step_down(self, reason: str, *, led: bool) -> None:
        """Stop every write first (nothing is sent after this starts; requests already sent
        land or time out before it goes on), then stop serving reports; :meth:`wait` returns
        whatever fails on the way."""
        self.lifecycle.move_to(Phase.STEPPING_DOWN, reason)
        try:
            await self.registry.stop()
            self.metrics.leader.set(0)
            if led:
                self.metrics.leader_transitions.labels("lost").inc()
            log.error(
                "leader election: %s %s: %s; every write stopped, exiting (the Deployment "
                "restarts this replica as a standby)",
                self.election.elector.identity if self.election else "?",
                "lost the lease" if led else "never led",
                reason,
            )
            for name in LEADER_ONLY:
                await self.health.set(name, NOT_SERVING)
            await self._drop_label()
            self.reports.close_streams()
            await self._stop_leader_tasks()
        finally:
            self._finished.set()

    # -- stopping -----------------------------------------------------------------------

    async def stop(self, why: str = "draining: health NOT_SERVING, closing streams") -> None:
        """Drain: report NOT_SERVING, end every stream, stop writing, release the Lease (a
        standby takes over at once), stop serving. A second call does nothing."""
        if self.lifecycle.stopping():
            return
        self.lifecycle.move_to(Phase.STOPPING, why)
        # First: no take-over may start anything from now on (a first pod list still retrying
        # ends here, and start() returns).
        await cancel_and_wait(self._electing, self._syncing, ignore=(Exception,))
        await self.health.enter_graceful_shutdown()
        await self._drop_label()  # first: the Service stops sending agents here
        self.core.close_watchers()
        self.reports.close_streams()
        await self._stop_leader_tasks()
        await self.registry.stop()
        if self.election is not None:
            # Only after the last write: the standby may write once it holds the Lease.
            await self.election.elector.release()
            self.election.store.close()
        if self._server is not None:
            # The grace is for calls in flight (inspection; Report streams were ended above).
            # Not server.stop(grace): gRPC's graceful stop also waits, for the whole grace, for
            # each client to ack the PING of its GOAWAY, so one raw client that never does (a
            # Report stream that never said hello, an idle connection) held the exit for it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.shutdown_grace):
                    await self.reports.closed()
                    await self.inspection.idle()
            await self._server.stop(None)  # what is left (health watches) is cancelled
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.guard is not None:
            self.guard.close()
        self.lifecycle.move_to(Phase.STOPPED, "aggregator stopped")
        self._finished.set()
        log.info("aggregator stopped")

    async def _drop_label(self) -> None:
        if self.election is not None and self.election.label is not None:
            await self.election.label.stop()

    async def wait(self) -> None:
        """Until :meth:`stop` ran, or leadership was lost (:attr:`lost` says why; then call
        :meth:`stop` and exit non-zero)."""
        await self._finished.wait()
