"""A TCP relay on loopback that can black-hole its traffic, for ``bench.liveness``.

A client (an agent) connects to the relay instead of its server (the aggregator); the relay
opens its own connection to the server and copies bytes both ways. :meth:`Relay.blackhole`
stops the forwarding in both directions at once while keeping every socket open: the relay
still reads what each side sends (the kernels on both sides keep ACKing, as on a network whose
packets are lost further on), and throws it away. Nothing is closed, so neither end learns of
the loss from TCP: only an application-level liveness check (HTTP/2 keepalive PINGs) can. A
connection that arrives while black-holed is accepted and held, never forwarded (a client that
reconnects is cut off too). :meth:`Relay.close` closes everything.

Everything runs on the caller's asyncio event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

HOST = "127.0.0.1"
CHUNK = 65536


@dataclass
class Relay:
    """Listen on ``HOST`` (a free port), forward every connection to ``upstream`` (host, port)."""

    upstream: tuple[str, int]
    blackholed: bool = False
    port: int = 0
    #: Bytes thrown away since :meth:`blackhole`, per direction.
    dropped_to_upstream: int = 0
    dropped_to_client: int = 0
    connections: int = 0
    _server: asyncio.Server | None = field(default=None, repr=False)
    _writers: list[asyncio.StreamWriter] = field(default_factory=list, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def blackhole(self) -> None:
        """From now on forward nothing, in either direction; close nothing."""
        self.blackholed = True

    async def close(self) -> None:
        """Stop listening, close every socket, end every copy (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        self._writers.clear()

    async def _accept(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        self._writers.append(client_out)
        if self.blackholed:  # hold it, forward nothing
            self._spawn(self._pump(client_in, None, to_upstream=True))
            return
        try:
            upstream_in, upstream_out = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), 5.0
            )
        except (OSError, TimeoutError):
            client_out.close()
            return
        self._writers.append(upstream_out)
        self._spawn(self._pump(client_in, upstream_out, to_upstream=True))
        self._spawn(self._pump(upstream_in, client_out, to_upstream=False))

    def _spawn(self, coroutine: object) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        target: asyncio.StreamWriter | None,
        *,
        to_upstream: bool,
    ) -> None:
        """Copy ``source`` to ``target`` until EOF; while black-holed, read and drop."""
        try:
            while data := await source.read(CHUNK):
                if self.blackholed or target is None:
                    if to_upstream:
                        self.dropped_to_upstream += len(data)
                    else:
                        self.dropped_to_client += len(data)
                    continue
                target.write(data)
                await target.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        # One side closed. Forwarding: pass the close on. Black-holed: the other side must
        # learn nothing, so its socket stays open until close().
        if target is not None and not self.blackholed:
            target.close()
