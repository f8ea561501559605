"""Assemble and run the aggregator: gRPC server, health, reflection, metrics, expiry loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aggregator import __version__
from aggregator.core import Core
from aggregator.kube.api import KubeApi
from aggregator.kube.registry import KubeRegistry, KubeSettings
from aggregator.metrics import Metrics
from aggregator.protection import Protection
from aggregator.puller import Puller, PullSettings
from aggregator.registry import MemoryRegistry, PodRegistry
from aggregator.services import InspectionService, ReportService
from aggregator.settings import Settings, split_host_port
from aggregator.tracker import Clock, Tracker, TrackerSettings
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.kube.client import find_config, load_configuration
from servehealth_common.probe import Prober, make_session
from servehealth_common.tls import ReloadingServerCertificate, server_credentials

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["ReportService"].full_name,
    pb.DESCRIPTOR.services_by_name["InspectionService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)


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
        self._pull_session: aiohttp.ClientSession | None = None
        self._pulling: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        self._reports = ReportService(
            self.core,
            settings.heartbeat_interval,
            settings.ack_every,
            max_streams_per_peer=settings.max_streams_per_peer,
            max_pods_per_stream=settings.max_pods_per_stream,
            max_reports_per_second=settings.max_reports_per_second,
        )
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._expiry: asyncio.Task[None] | None = None
        #: With --tls-cert: the fetcher that reloads rotated certificate files.
        self.tls: ReloadingServerCertificate | None = None

    async def start(self) -> None:
        settings = self.settings
        await self.registry.start(self.core)
        if self.registry.seeds_from_cluster:
            self.tracker.hold_expiry(settings.effective_startup_grace)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", 16 * 1024 * 1024),
                # Agents ping every 10 s to notice a dead aggregator; allow it.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        self._reports.register(server)  # undecodable messages: INVALID_ARGUMENT, not INTERNAL
        pb_grpc.add_InspectionServiceServicer_to_server(
            InspectionService(self.core, settings.label_key), server
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
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if settings.metrics_listen:
            await self._start_metrics(*split_host_port(settings.metrics_listen))
        self._expiry = asyncio.create_task(self._expire_forever(), name="expiry")
        self._start_puller()
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

    def _start_puller(self) -> None:
        settings = self.settings
        self._pull_session = make_session(max_connections=settings.pull_concurrency)
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
        """Drain: report NOT_SERVING, end every stream, stop serving."""
        log.info("draining: health NOT_SERVING, closing streams")
        await self.health.enter_graceful_shutdown()
        self.core.close_watchers()
        self._reports.close_streams()
        for task in (self._expiry, self._pulling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.core.puller = None
        if self._pull_session is not None:
            await self._pull_session.close()
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        await self.registry.stop()
        log.info("aggregator stopped")

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
