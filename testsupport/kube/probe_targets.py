"""Real servers on loopback for the kubelet emulation's probes (testsupport/kube/kubelet.py), beside
:class:`testsupport.fakes.FakeServeProxy` (a Serve proxy's ``/-/healthz``):

- :class:`FakeRayletAgent`: a Ray dashboard agent's health endpoints, the ones KubeRay's
  injected probes call: ``/api/local_raylet_healthz`` (every release's wget probe) and
  ``/api/healthz`` (KubeRay 1.6+ on Ray 2.53+: an ``httpGet``), plus the head's
  ``/api/gcs_healthz``. Healthy, each answers 200 ``success`` (the body the probes grep for);
  a dead raylet answers 503 ``Local Raylet failed``, as Ray's ``HealthzAgent`` does.
- :class:`FakeGrpcHealth`: a ``grpc.health.v1.Health`` server (``grpc`` probes), with a
  status per service name.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

HEALTHY = (200, "success")
RAYLET_DEAD = (503, "Local Raylet failed")

RAYLET_HEALTH_PATH = "/api/local_raylet_healthz"
NODE_HEALTH_PATH = "/api/healthz"
GCS_HEALTH_PATH = "/api/gcs_healthz"


@dataclass
class FakeRayletAgent:
    """``answer`` (status, body) for every health path; ``hang`` holds requests until the next
    :meth:`set`; ``requests`` counts them, by path in ``paths``."""

    answer: tuple[int, str] = HEALTHY
    hang: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    requests: int = 0
    paths: dict[str, int] = field(default_factory=dict)
    _runner: web.AppRunner | None = field(default=None, repr=False)
    _release: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def set(self, answer: tuple[int, str] = HEALTHY, *, hang: bool = False) -> None:
        """Answer like this from now on; requests left hanging are answered too."""
        self.answer, self.hang = answer, hang
        self._release.set()
        self._release = asyncio.Event()

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.paths[request.path] = self.paths.get(request.path, 0) + 1
        if self.hang:
            await self._release.wait()
        status, body = self.answer
        return web.Response(status=status, text=body)

    async def start(self) -> FakeRayletAgent:
        app = web.Application()
        for path in (RAYLET_HEALTH_PATH, NODE_HEALTH_PATH, GCS_HEALTH_PATH):
            app.router.add_get(path, self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Stop listening: from now on the port refuses connections (a dead agent)."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass
class FakeGrpcHealth:
    """``grpc.health.v1.Health/Check`` on a loopback port: ``statuses`` maps a service name
    (``""``: the server as a whole) to ``SERVING``, ``NOT_SERVING``, ...; an unknown service
    answers ``NOT_FOUND``, as grpcio's ``HealthServicer`` does. ``hang`` holds calls until the
    next :meth:`set`."""

    statuses: dict[str, str] = field(default_factory=lambda: {"": "SERVING"})
    hang: bool = False
    port: int = 0
    calls: int = 0
    _server: Any = field(default=None, repr=False)
    _release: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def set(self, service: str, status: str, *, hang: bool = False) -> None:
        self.statuses[service] = status
        self.hang = hang
        self._release.set()
        self._release = asyncio.Event()

    async def start(self) -> FakeGrpcHealth:
        import grpc
        from grpc_health.v1 import health_pb2

        async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls += 1
            if self.hang:
                await self._release.wait()
            status = self.statuses.get(request.service)
            if status is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.ServingStatus.Value(status)
            )

        handler = grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health",
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    check,
                    request_deserializer=health_pb2.HealthCheckRequest.FromString,
                    response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
                )
            },
        )
        self._server = grpc.aio.server(handlers=(handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    async def stop(self) -> None:
        self._release.set()
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
