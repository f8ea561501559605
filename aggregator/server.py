"""Run the aggregator: the gRPC port, health, reflection, /metrics, and the phases.

Every component arrives built (:mod:`aggregator.wiring`); this module only starts and stops
them, in the order the phases (:mod:`aggregator.lifecycle`) call for:

- without leader election: list the pods (seeding them from their labels), open the port,
  lead (expiry and pulls run);
- with it: open the port as a standby (NOT_SERVING, reports refused); once the Lease is held,
  list the pods, start expiry and pulls, then serve reports (LEADING); on losing the Lease,
  step down (stop every write first) and let the process exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aggregator import __version__
from aggregator.channel_options import GrpcServerSettings, server_options
from aggregator.core import Core
from aggregator.expiry import ExpiryLoop
from aggregator.guard import Guard
from aggregator.inspection_service import InspectionService
from aggregator.kube.lease import KubeLeaseStore
from aggregator.leader import LeaderElector
from aggregator.lifecycle import Lifecycle, Phase
from aggregator.metrics import Metrics
from aggregator.puller import Puller
from aggregator.registry import PodRegistry
from aggregator.report_service import ReportService
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.config import split_host_port
from servehealth_common.metrics_http import MetricsServer
from servehealth_common.tls import ReloadingServerCertificate, server_credentials

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["ReportService"].full_name,
    pb.DESCRIPTOR.services_by_name["InspectionService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)
#: grpc.health.v1 names that only the leader serves (with --leader-elect): the Service's
#: readiness probe asks for "", so a standby gets no agents.
LEADER_ONLY = ("", SERVICE_NAMES[0])
#: A grpc.health.v1 name SERVING for as long as the process runs, leader or standby: for the
#: liveness and startup probes (a standby must not be restarted for being a standby).
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


class Aggregator:
    """One aggregator process: ``await start()``, then ``await stop()`` (which drains)."""

    def __init__(
        self,
        settings: PortSettings,
        *,
        lifecycle: Lifecycle,
        core: Core,
        registry: PodRegistry,
        metrics: Metrics,
        puller: Puller,
        expiry: ExpiryLoop,
        reports: ReportService,
        inspection: InspectionService,
        metrics_server: MetricsServer | None,
        guard: Guard | None,
        election: Election | None,
    ) -> None:
        self._settings = settings
        self.lifecycle = lifecycle
        self.core = core
        self.registry = registry
        self.metrics = metrics
        self.puller = puller
        self._expiry = expiry
        self._reports = reports
        self._inspection = inspection
        self.metrics_server = metrics_server
        self._guard = guard
        self.election = election
        self.health = health.aio.HealthServicer()
        self.port = 0
        #: With --tls-cert: the fetcher that reloads rotated certificate files (kept alive
        #: here: gRPC's C core calls it at each handshake).
        self._tls: ReloadingServerCertificate | None = None
        self._server: grpc.aio.Server | None = None
        self._finished = asyncio.Event()
        self._electing: asyncio.Task[None] | None = None

    @property
    def lost(self) -> str | None:
        """Why leadership was lost (None while it was not): the process should exit 1."""
        return self.lifecycle.step_down_reason

    async def start(self) -> None:
        """Serve; see the module's docstring for the order. Both ports are bound before the gRPC
        server starts. A start that fails (OSError "cannot listen on ..." for a port that cannot
        be bound) stops what it had started, then raises: nothing is left to a closed loop."""
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop("start failed: stopping what was started")
            except Exception:  # the start's own error is the one to report
                log.exception("stopping after a failed start failed as well")
            raise

    async def _start(self) -> None:
        if self.election is None:
            await self._start_registry()
            self.lifecycle.move_to(Phase.LEADING, "no leader election: this replica leads")
        server = self._server = grpc.aio.server(options=server_options(self._settings.grpc))
        self._reports.register(server)  # undecodable messages: INVALID_ARGUMENT, not INTERNAL
        pb_grpc.add_InspectionServiceServicer_to_server(self._inspection, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
        self.port = await self._add_port(server)
        if self.metrics_server is not None:
            await self._start_metrics(self.metrics_server)
        standby = self.election is not None
        if standby:  # before the port opens: no stream slips through
            self.lifecycle.move_to(Phase.STANDBY, "leader election: waiting for the Lease")
        await server.start()
        for name in ("", *SERVICE_NAMES, LIVENESS):
            serving = not (standby and name in LEADER_ONLY)
            await self.health.set(name, SERVING if serving else NOT_SERVING)
        if self.election is None:
            self.metrics.leader.set(1)
            self._start_leader_tasks()
        else:
            self._electing = asyncio.create_task(self._lead(), name="leader-election")
        self._log_start()

    async def _add_port(self, server: grpc.aio.Server) -> int:
        """Bind the gRPC port; OSError naming the address and why it cannot be bound. Asked
        of the socket layer first: gRPC's own failure says only "Failed to bind to address",
        and writes a log line of its own."""
        settings = self._settings
        host, port = split_host_port(settings.listen)
        if problem := await _bind_problem(host, port):
            raise _cannot_listen(settings.listen, "--listen", problem)
        address = _host_port(host, port)
        try:
            if not settings.tls_cert:
                return server.add_insecure_port(address)
            credentials, self._tls = server_credentials(
                settings.tls_cert, settings.tls_key, settings.tls_client_ca
            )
            return server.add_secure_port(address, credentials)
        except RuntimeError:  # "Failed to bind": taken since, or credentials gRPC refused
            tls = " with the files of --tls-cert and --tls-key" if settings.tls_cert else ""
        raise _cannot_listen(settings.listen, "--listen", f"gRPC failed to bind it{tls}")

    @staticmethod
    async def _start_metrics(metrics_server: MetricsServer) -> None:
        try:
            await metrics_server.start()
        except OSError as error:
            host, port = metrics_server.settings.host, metrics_server.settings.port
            reason = _why(error, host)
            raise _cannot_listen(_host_port(host, port), "--metrics-listen", reason) from None

    def _log_start(self) -> None:
        settings = self._settings
        metrics = _host_port(*self.metrics_server.address) if self.metrics_server else "off"
        log.info(
            "aggregator %s listening on %s (%s, metrics %s), backend %s, label %s",
            __version__,
            _host_port(split_host_port(settings.listen)[0], self.port),
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
        if self.registry.seeds_from_cluster:
            self.core.hold_expiry(self._settings.startup_grace)

    def _start_leader_tasks(self) -> None:
        self._expiry.start()
        self.puller.start(self.core)

    async def _stop_leader_tasks(self) -> None:
        await self._expiry.stop()
        await self.puller.stop()

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
        taking_over = asyncio.create_task(self._take_over(), name="take-over")
        try:
            await asyncio.wait((holding, taking_over), return_when=asyncio.FIRST_COMPLETED)
            if holding.done():
                return holding.result()
            if (error := taking_over.exception()) is not None:
                return f"could not take over as the leader: {error}"
            return await holding
        finally:
            for task in (holding, taking_over):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _take_over(self) -> None:
        await self._start_registry()
        self._start_leader_tasks()
        self.lifecycle.move_to(Phase.LEADING, "holding the Lease; pods listed")
        for name in LEADER_ONLY:
            await self.health.set(name, SERVING)
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
            self._reports.close_streams()
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
        if self._electing is not None:  # first: no take-over may start anything from now on
            self._electing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # logged there
                await self._electing
        await self.health.enter_graceful_shutdown()
        self.core.close_watchers()
        self._reports.close_streams()
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
                async with asyncio.timeout(self._settings.shutdown_grace):
                    await self._reports.closed()
                    await self._inspection.idle()
            await self._server.stop(None)  # what is left (health watches) is cancelled
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self._guard is not None:
            self._guard.close()
        self.lifecycle.move_to(Phase.STOPPED, "aggregator stopped")
        self._finished.set()
        log.info("aggregator stopped")

    async def wait(self) -> None:
        """Until :meth:`stop` ran, or leadership was lost (:attr:`lost` says why; then call
        :meth:`stop` and exit non-zero)."""
        await self._finished.wait()


# -- binding ------------------------------------------------------------------------------


def _host_port(host: str, port: int) -> str:
    """``127.0.0.1:50051``, ``[::1]:50051``: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cannot_listen(address: str, flag: str, reason: str) -> OSError:
    return OSError(f"cannot listen on {address} ({flag}): {reason}")


def _why(error: OSError, host: str) -> str:
    """Why ``error`` happened, readable: address already in use, cannot resolve 'x' (...)."""
    if isinstance(error, socket.gaierror):
        return f"cannot resolve {host!r} ({error.strerror})"
    if error.errno:
        return os.strerror(error.errno).lower()
    return str(error)


async def _bind_problem(host: str, port: int) -> str | None:
    """Why no address ``host`` resolves to can be bound at ``port``; None when one can (gRPC
    binds every address it can, and fails only when none)."""
    loop = asyncio.get_running_loop()
    try:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return _why(error, host)
    problems: list[str] = []
    for family, kind, protocol, _, address in found:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
            except OSError as error:
                problems.append(_why(error, host))
                continue
        return None
    return problems[0] if problems else f"{host!r} resolves to no address"
