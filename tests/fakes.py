"""Real servers that behave like parts of a Ray Serve proxy, for tests and benchmarks.

A :class:`FakeServeProxy` is a real aiohttp HTTP server on a loopback port that answers
``/-/healthz`` and ``/-/routes`` the way Ray Serve's proxy does in each of its states.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field

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
