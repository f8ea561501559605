"""Real servers that behave like parts of a Ray Serve proxy, for tests and benchmarks.

A :class:`FakeServeProxy` is a real aiohttp HTTP server on a loopback port that answers
``/-/healthz`` and ``/-/routes`` the way Ray Serve's proxy does in each of its states.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

HEALTHY = (200, "success")
NOT_POPULATED = (503, "Route table is not populated yet.")
NO_REPLICAS = (503, "No replicas are available yet.")
DRAINING = (503, "This node is being drained.")
ROUTES = (200, json.dumps({"/": "app"}))
NO_ROUTES = (200, "{}")


@dataclass
class FakeServeProxy:
    """``healthz``/``routes`` are (status, body); ``hang`` makes every request wait forever."""

    healthz: tuple[int, str] = HEALTHY
    routes: tuple[int, str] = ROUTES
    hang: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    requests: int = 0
    _runner: web.AppRunner | None = field(default=None, repr=False)
    _release: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/-/healthz"

    def set(self, healthz: tuple[int, str], routes: tuple[int, str] = ROUTES) -> None:
        """Answer like this from now on; requests left hanging are answered too."""
        self.healthz, self.routes, self.hang = healthz, routes, False
        self._release.set()
        self._release = asyncio.Event()

    async def _answer(self, answer: tuple[int, str]) -> web.Response:
        self.requests += 1
        if self.hang:
            await self._release.wait()
        status, body = answer
        return web.Response(status=status, text=body)

    async def start(self) -> FakeServeProxy:
        async def healthz(_: web.Request) -> web.Response:
            return await self._answer(self.healthz)

        async def routes(_: web.Request) -> web.Response:
            return await self._answer(self.routes)

        app = web.Application()
        app.router.add_get("/-/healthz", healthz)
        app.router.add_get("/-/routes", routes)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Stop listening: from now on the port refuses connections."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def silent_server(host: str = "127.0.0.1") -> asyncio.Server:
    """A TCP server that accepts connections and never answers (a hung proxy)."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # keep the connection open, say nothing

    return await asyncio.start_server(hold, host, 0)


#: Sockets that hold refused ports for the whole session (bound, never listening).
_HELD: list[socket.socket] = []


def refused_port(host: str = "127.0.0.1") -> int:
    """A loopback port that refuses connections: bound but never listening, and held for the
    session so that no other server of the suite can take it in the meantime."""
    sock = socket.socket()
    sock.bind((host, 0))
    _HELD.append(sock)
    return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


#: What a fake gRPC proxy answers ``Healthz``: a status name and the message (OK: the
#: response's ``message``, ``None`` for none at all, as HAProxy answers; otherwise the details).
GrpcAnswer = tuple[str, str | None]

GRPC_HEALTHY: GrpcAnswer = ("OK", "success")
GRPC_HAPROXY_HEALTHY: GrpcAnswer = ("OK", None)
GRPC_NOT_POPULATED: GrpcAnswer = ("UNAVAILABLE", NOT_POPULATED[1])
GRPC_DRAINING: GrpcAnswer = ("UNAVAILABLE", DRAINING[1])
GRPC_HAPROXY_NO_BACKEND: GrpcAnswer = ("UNAVAILABLE", "Service Unavailable")


@dataclass
class FakeGrpcServeProxy:
    """A real ``grpc.aio`` server on a loopback port answering Ray Serve's
    ``/ray.serve.RayServeAPIService/Healthz`` with ``answer``; ``hang`` makes calls wait until
    the next :meth:`set`; ``raw`` (bytes), if set, is sent as the OK response instead."""

    answer: GrpcAnswer = GRPC_HEALTHY
    hang: bool = False
    raw: bytes | None = None
    port: int = 0
    calls: int = 0
    _server: Any = field(default=None, repr=False)
    _release: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _called: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def called(self) -> None:
        """Return once a call has arrived (since the start)."""
        await self._called.wait()

    def set(self, answer: GrpcAnswer, *, hang: bool = False) -> None:
        self.answer, self.hang, self.raw = answer, hang, None
        self._release.set()
        self._release = asyncio.Event()

    async def start(self) -> FakeGrpcServeProxy:
        import grpc
        from google.protobuf import wrappers_pb2

        async def healthz(_: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.calls += 1
            self._called.set()
            if self.hang:
                await self._release.wait()
            if self.raw is not None:
                return self.raw
            code, message = self.answer
            if code != "OK":
                await context.abort(grpc.StatusCode[code], message or "")
            if message is None:  # HAProxy's trailers-only OK: no message at all
                return b""
            return wrappers_pb2.StringValue(value=message).SerializeToString()

        handler = grpc.method_handlers_generic_handler(
            "ray.serve.RayServeAPIService",
            {"Healthz": grpc.unary_unary_rpc_method_handler(healthz)},
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
