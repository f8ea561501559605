"""A Kubernetes Service, emulated over loopback: the kubelet's readiness probes, the endpoints
controller and kube-proxy, in one small TCP forwarder.

The aggregator's Service selects its pods by labels (``ray-serve-health/leader: "true"``, the
label the leader puts on its own pod) and, like every Service, only the Ready ones. Here:

- **readiness** (the kubelet): every ``probe_period`` the router GETs each replica's
  ``/readyz`` (plaintext HTTP on its metrics port, as the Deployment's probe does);
- **selection** (the endpoints controller): at each new connection the router reads the pods of
  the emulator (``testsupport/kube/emulator.py``) and keeps those whose labels match the selector;
- **forwarding** (kube-proxy): a new TCP connection goes to one such endpoint at random, and
  stays there; with no endpoint it is closed at once (as a Service without endpoints rejects).

Connections already open are not moved when the endpoints change (conntrack keeps them): a
standby that gets a stream refuses it and the agent reconnects, as in a cluster. Not emulated:
kube-proxy's own programming delay (usually well under a second). Loopback only; everything
stops with :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from testsupport.kube.emulator import PODS, KubeEmulator

HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Backend:
    """One replica: where its gRPC port and its metrics port (``/readyz``) listen."""

    grpc_port: int
    metrics_port: int


class ServiceRouter:
    def __init__(
        self,
        emulator: KubeEmulator,
        namespace: str,
        selector: Mapping[str, str],
        backends: Mapping[str, Backend],
        *,
        probe_period: float = 1.0,
    ) -> None:
        self._emulator = emulator
        self._namespace = namespace
        self._selector = dict(selector)
        #: Pod name -> its replica's ports.
        self.backends = dict(backends)
        self._probe_period = probe_period
        self._ready: dict[str, bool] = {}
        self._server: asyncio.Server | None = None
        self._prober: asyncio.Task[None] | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._rng = random.Random()
        self.port = 0
        #: Connections forwarded, per pod (and refused: no endpoint).
        self.forwarded: dict[str, int] = {}
        self.refused = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    async def start(self) -> ServiceRouter:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1))
        await self._probe_all()
        self._prober = asyncio.create_task(self._probe_forever(), name="router-readiness")
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in [self._prober, *self._pipes]:
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in [self._prober, *self._pipes] if t is not None), return_exceptions=True
        )
        await self._session.close()

    def ready(self, pod: str) -> bool:
        """The last readiness probe of ``pod``'s replica answered 200."""
        return self._ready.get(pod, False)

    def endpoints(self) -> list[str]:
        """The pods the Service routes to now: selected by label, and Ready."""
        selected = []
        for pod in self._emulator.list_objects(PODS, self._namespace):
            name = pod["metadata"]["name"]
            labels = pod["metadata"].get("labels") or {}
            chosen = all(labels.get(k) == v for k, v in self._selector.items())
            if name in self.backends and chosen and self.ready(name):
                selected.append(name)
        return selected

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._probe_period)
            await self._probe_all()

    async def _probe_all(self) -> None:
        answers = await asyncio.gather(*(self._probe(b) for b in self.backends.values()))
        self._ready = dict(zip(self.backends, answers, strict=True))

    async def _probe(self, backend: Backend) -> bool:
        try:
            async with self._session.get(f"http://{HOST}:{backend.metrics_port}/readyz") as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoints = self.endpoints()
        if not endpoints:
            self.refused += 1
            writer.transport.abort()
            return
        pod = self._rng.choice(endpoints)
        self.forwarded[pod] = self.forwarded.get(pod, 0) + 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                HOST, self.backends[pod].grpc_port
            )
        except OSError:
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        except asyncio.CancelledError:
            pass  # stop(): start_server's task must not end in an exception (it would log it)
        finally:
            self._pipes.discard(task)
            for end in (writer, upstream_writer):
                end.transport.abort()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until EOF or an error; then half-close (or abort) the other side."""
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.transport.abort()
