"""Assemble and run the aggregator: gRPC server, health, reflection, metrics, expiry loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aggregator import __version__
from aggregator.channel_options import server_options
from aggregator.core import Core
from aggregator.guard import Guard, make_guard
from aggregator.kube.api import KubeApi
from aggregator.kube.lease import KubeLeaseStore, LeaderElectionConfigError, make_elector
from aggregator.kube.registry import KubeRegistry, KubeSettings
from aggregator.leader import LeaderElector
from aggregator.metrics import Metrics
from aggregator.protection import Protection
from aggregator.puller import Puller, PullSettings
from aggregator.registry import MemoryRegistry, PodRegistry
from aggregator.services import InspectionService, ReportService
from aggregator.settings import Settings, split_host_port
from aggregator.tracker import Clock, Tracker, TrackerSettings
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.http import HTTPClient
from servehealth_common.kube.client import find_config, load_configuration
from servehealth_common.probe import Prober, make_session
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
#: Idle keep-alive connections the pull fallback keeps at most (one per pod it pulls).
PULL_MAX_IDLE = 4096


def make_registry(settings: Settings, metrics: Metrics) -> PodRegistry:
    """The backend the settings ask for; ``auto`` picks kubernetes when a config is found."""
    backend = settings.kube_backend
    if backend == "auto":
        found = find_config(settings.kubeconfig)
        backend = "kubernetes" if found else "memory"
        log.info(
            "--kube-backend auto: %s",
            f"using kubernetes ({found})" if found else "no Kubernetes configuration, using memory",
        )
    if backend == "memory":
        return MemoryRegistry(settings.label_key)
    api = KubeApi(
        load_configuration(settings.kubeconfig),
        timeout=settings.kube_timeout,
        concurrency=settings.kube_concurrency,
    )
    return KubeRegistry(
        api,
        KubeSettings(
            namespaces=settings.namespace,
            pod_selector=settings.pod_selector,
            proxy_port=settings.proxy_port,
            label_key=settings.label_key,
            mode=settings.mode,
            condition_type=settings.condition_type,
            events=settings.events,
            qps=settings.kube_qps,
            burst=settings.kube_burst,
            concurrency=settings.kube_concurrency,
        ),
        metrics,
    )


class Aggregator:
    """One aggregator process: ``await start()``, then ``await stop()`` (which drains)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: PodRegistry | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics(__version__)
        self.tracker = Tracker(
            TrackerSettings(
                heartbeat_ttl=settings.heartbeat_ttl,
                failure_threshold=settings.failure_threshold,
                success_threshold=settings.success_threshold,
                # A pulled pod is pulled again every pull interval at the latest.
                pull_ttl=settings.pull_interval + settings.heartbeat_ttl,
            ),
            clock,
        )
        self.registry = registry or make_registry(settings, self.metrics)
        #: With --leader-elect: the elector (None: this process leads from the start).
        self.elector: LeaderElector | None = None
        self._lease_store: KubeLeaseStore | None = None
        if settings.leader_elect:
            if not isinstance(self.registry, KubeRegistry):
                raise LeaderElectionConfigError(
                    f"--leader-elect needs the kubernetes backend, not {self.registry.name} "
                    "(with --kube-backend auto: no Kubernetes configuration was found)"
                )
            self.elector, self._lease_store = make_elector(
                settings, on_renew_failure=self.metrics.lease_renew_failures.inc
            )
        #: Why leadership was lost (None while it was not): the process should exit non-zero.
        self.lost: str | None = None
        self._finished = asyncio.Event()
        self._electing: asyncio.Task[None] | None = None
        self._registry_state = "new"  # new -> started -> stopped
        self._leading = False  # with --leader-elect: this replica holds the Lease
        self._stopping = False
        self.core = Core(
            self.tracker,
            self.registry,
            self.metrics,
            Protection(settings.panic_threshold, settings.heartbeat_ttl, clock),
            panic_settle=settings.panic_settle,
            panic_min_pods=settings.panic_min_pods,
        )
        self.clock = clock
        self.puller: Puller | None = None
        self._pull_session: HTTPClient | None = None
        self._pulling: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        #: Token checks (--auth, --inspection-auth tokenreview); None when neither asks.
        self.guard: Guard | None = make_guard(settings, self.metrics, self.registry)
        self._reports = ReportService(
            self.core,
            settings.heartbeat_interval,
            settings.ack_every,
            max_streams_per_peer=settings.max_streams_per_peer,
            max_pods_per_stream=settings.max_pods_per_stream,
            max_reports_per_second=settings.max_reports_per_second,
            hello_timeout=settings.hello_timeout,
            guard=self.guard if settings.auth == "tokenreview" else None,
        )
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._expiry: asyncio.Task[None] | None = None
        #: With --tls-cert: the fetcher that reloads rotated certificate files.
        self.tls: ReloadingServerCertificate | None = None

    async def start(self) -> None:
        """Serve. Without leader election: list the pods (seeding them from their labels),
        then serve everything. With it: serve as a standby (NOT_SERVING, reports refused) and
        take over in the background once this replica holds the Lease (:meth:`_lead`)."""
        settings = self.settings
        if self.elector is None:
            await self._start_registry()
        server = grpc.aio.server(options=server_options(settings))
        self._reports.register(server)  # undecodable messages: INVALID_ARGUMENT, not INTERNAL
        pb_grpc.add_InspectionServiceServicer_to_server(
            InspectionService(
                self.core,
                settings.label_key,
                guard=self.guard if settings.inspection_auth == "tokenreview" else None,
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
        host, port = split_host_port(settings.listen)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if settings.tls_cert:
            credentials, self.tls = server_credentials(
                settings.tls_cert, settings.tls_key, settings.tls_client_ca
            )
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {settings.listen}")
        standby = self.elector is not None
        self._reports.standby = standby  # before the port opens: no stream slips through
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES, LIVENESS):
            serving = not (standby and name in LEADER_ONLY)
            await self.health.set(name, SERVING if serving else NOT_SERVING)
        if settings.metrics_listen:
            await self._start_metrics(*split_host_port(settings.metrics_listen))
        if self.elector is None:
            self.metrics.leader.set(1)
            self._start_background()
        else:
            self._electing = asyncio.create_task(self._lead(), name="leader-election")
        log.info(
            "aggregator %s listening on %s:%d (%s, metrics %s), backend %s, label %s",
            __version__,
            host,
            self.port,
            ("mutual TLS" if settings.tls_client_ca else "TLS")
            if settings.tls_cert
            else "plaintext",
            f"{host}:{self.metrics_port}" if settings.metrics_listen else "off",
            self.registry.name,
            settings.label_key,
        )
        if self.elector is not None:
            log.info(
                "leader election on: a standby until %s holds lease %s (lease %gs, renew "
                "deadline %gs, retry %gs)",
                self.elector.identity,
                self.elector.store.describe(),
                settings.leader_elect_lease_duration,
                settings.leader_elect_renew_deadline,
                settings.leader_elect_retry_period,
            )

    # -- leadership ---------------------------------------------------------------------

    async def _start_registry(self) -> None:
        """List the pods (seeding the tracker from their labels), then watch and write."""
        await self.registry.start(self.core)
        self._registry_state = "started"
        if self.registry.seeds_from_cluster:
            self.tracker.hold_expiry(self.settings.effective_startup_grace)

    async def _stop_registry(self) -> None:
        """Stop discovery and every write (once)."""
        if self._registry_state != "stopped":
            self._registry_state = "stopped"
            await self.registry.stop()

    def _start_background(self) -> None:
        self._expiry = asyncio.create_task(self._expire_forever(), name="expiry")
        self._start_puller()

    async def _stop_background(self) -> None:
        for task in (self._expiry, self._pulling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._expiry = self._pulling = None
        self.core.puller = None
        if self._pull_session is not None:
            await self._pull_session.close()
            self._pull_session = None

    async def _lead(self) -> None:
        """A standby until this replica holds the Lease; then the leader until it loses it
        (the renew deadline passed, or another holder took it): then it stops every write
        and :meth:`wait` returns, with :attr:`lost` saying why (the process exits 1)."""
        try:
            reason = await self._elect_and_lead()
        except Exception as error:  # a bug: never stay a silent standby for ever
            log.exception("leader election failed")
            reason = f"leader election failed: {error!r}"
        await self._step_down(reason)

    async def _elect_and_lead(self) -> str:
        elector = self.elector
        assert elector is not None
        await elector.acquire()
        self._leading = True
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
        self._start_background()
        self._reports.standby = False
        for name in LEADER_ONLY:
            await self.health.set(name, SERVING)
        log.info("leader: serving, %d pods tracked", len(self.tracker))

    async def _step_down(self, reason: str) -> None:
        """Stop every write first (nothing is sent after this starts; requests already sent
        land or time out before it goes on), then stop serving reports; :meth:`wait` returns
        whatever fails on the way."""
        self.lost = reason
        self._reports.standby = True
        try:
            await self._stop_registry()
            led, self._leading = self._leading, False
            self.metrics.leader.set(0)
            if led:
                self.metrics.leader_transitions.labels("lost").inc()
            log.error(
                "leader election: %s %s: %s; every write stopped, exiting (the Deployment "
                "restarts this replica as a standby)",
                self.elector.identity if self.elector else "?",
                "lost the lease" if led else "never led",
                reason,
            )
            for name in LEADER_ONLY:
                await self.health.set(name, NOT_SERVING)
            self._reports.close_streams()
            await self._stop_background()
        finally:
            self._finished.set()

    def _start_puller(self) -> None:
        settings = self.settings
        self._pull_session = make_session(max_idle=PULL_MAX_IDLE, max_idle_per_host=1)
        self.puller = Puller(
            self.core,
            Prober(
                self._pull_session,
                settings.pull_timeout,
                self.clock,
                concurrency=settings.pull_concurrency,
            ),
            PullSettings(
                pull_interval=settings.pull_interval,
                pull_timeout=settings.pull_timeout,
                pull_concurrency=settings.pull_concurrency,
                heartbeat_ttl=settings.heartbeat_ttl,
            ),
            self.metrics,
            self.clock,
        )
        self.core.puller = self.puller
        self._pulling = asyncio.create_task(self.puller.run(), name="puller")

    async def _start_metrics(self, host: str, port: int) -> None:
        async def metrics(_: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._metrics_runner = runner
        self.metrics_port = runner.addresses[0][1]

    async def _expire_forever(self) -> None:
        interval = self.settings.expiry_interval
        while True:
            await asyncio.sleep(interval)
            try:
                self.core.expire()
            except Exception:  # keep expiring whatever one pass met
                log.exception("expiry pass failed")

    async def stop(self) -> None:
        """Drain: report NOT_SERVING, end every stream, stop writing, release the Lease (a
        standby takes over at once), stop serving. A second call does nothing."""
        if self._stopping:
            return
        self._stopping = True
        log.info("draining: health NOT_SERVING, closing streams")
        if self._electing is not None:  # first: no take-over may start anything from now on
            self._electing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # logged there
                await self._electing
        await self.health.enter_graceful_shutdown()
        self.core.close_watchers()
        self._reports.close_streams()
        await self._stop_background()
        await self._stop_registry()
        if self.elector is not None:
            await self.elector.release()  # only after the last write: the standby may write
        if self._lease_store is not None:
            self._lease_store.close()
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.guard is not None:
            self.guard.close()
        self._finished.set()
        log.info("aggregator stopped")

    async def wait(self) -> None:
        """Until :meth:`stop` ran, or leadership was lost (:attr:`lost` says why; then call
        :meth:`stop` and exit non-zero)."""
        await self._finished.wait()
