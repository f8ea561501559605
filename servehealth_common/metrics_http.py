"""A Prometheus ``/metrics`` server on asyncio streams and h11, bounded against hostile clients.

Why hand-glued on h11: the runtime loads no aiohttp (h11 already carries the probes' client,
:mod:`servehealth_common.http`), and prometheus_client's ``start_http_server`` (http.server, a
thread per connection) bounds nothing: not the connections open at once, not the time a
request's head may take, not a client that never reads its answer. This one serves ``GET`` and
``HEAD /metrics`` (query ignored; the format ``Accept`` asks for, by ``choose_encoder``), and
the health checks it is given (``/livez``, ``/readyz``: 200 ``ok`` or 503 with why, for the
kubelet's probes, which stay plaintext when the gRPC port is TLS), 404 and 405 otherwise, with
keep-alive, and bounds all three: a request must arrive within ``header_timeout`` (of the
connection, or of its first byte on a kept-alive one), an idle connection lives
``idle_timeout``, a write not taken within ``header_timeout`` closes its connection; past
``max_connections`` a connection is closed at once. A request body is dropped (413 beyond
:data:`MAX_BODY_BYTES`); a malformed request gets h11's status hint (400, or 431 for a head over
``max_header_bytes``). Nothing a client can cause is logged above DEBUG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus

import h11
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

#: A request body (scrapers send none) is read and dropped up to this; 413 beyond.
MAX_BODY_BYTES = 65536
_READ_BYTES = 65536
_TEXT = "text/plain; charset=utf-8"
Headers = list[tuple[str, str]]
Answer = tuple[int, Headers, bytes]  # status, headers, body
#: A health check: None when healthy, else why not (one short line, sent with the 503).
HealthCheck = Callable[[], str | None]


@dataclass(frozen=True, slots=True)
class MetricsServerSettings:
    host: str
    port: int  # 0: pick a free one
    header_timeout: float = 5.0  # seconds for a request's head (and body); also bounds writes
    idle_timeout: float = 30.0  # seconds a kept-alive connection may wait for its next request
    max_connections: int = 64  # open at once; one more is accepted and closed at once
    max_header_bytes: int = 16384  # h11's max_incomplete_event_size

    def __post_init__(self) -> None:
        for name in ("header_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        for name in ("max_connections", "max_header_bytes"):
            if (value := getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, not {value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, not {self.port!r}")


class MetricsServer:
    """Serves ``registry`` at ``/metrics``: ``await start()``, then ``await stop()``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        settings: MetricsServerSettings,
        on_refused: Callable[[], None] = lambda: None,
        checks: Mapping[str, HealthCheck] | None = None,
    ) -> None:
        self._registry = registry
        self._settings = settings
        #: Path (``/readyz``) to its check: 200 ``ok`` while it returns None, else 503 and why.
        self._checks = {path.encode(): check for path, check in (checks or {}).items()}
        #: Called for each connection closed at once (``max_connections`` open, or stopping).
        self._on_refused = on_refused
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._stopping = False

    async def start(self) -> None:
        """Bind and listen; OSError if the address cannot be bound."""
        if self._server is not None or self._stopping:
            raise RuntimeError("MetricsServer.start() called twice or after stop()")
        settings = self._settings
        self._server = await asyncio.start_server(self._handle, settings.host, settings.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = (host, port)

    @property
    def settings(self) -> MetricsServerSettings:
        """Where it listens (as asked: port 0 is not resolved here) and its bounds."""
        return self._settings

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the first bound socket."""
        if self._address is None:
            raise RuntimeError("MetricsServer is not started")
        return self._address

    async def stop(self) -> None:
        """Close the listener and every open connection (at once, answers or not)."""
        self._stopping = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task, writer in list(self._connections.items()):
            writer.transport.abort()
            task.cancel()  # _handle swallows it: see there
        await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.header_timeout):
                    await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, in start_server's task. Never raises, not even when stop() cancels
        it: Python 3.11's streams log an error for a task that ends in an exception (and a
        cancelled one makes its done-callback fail)."""
        peer = writer.get_extra_info("peername")
        task = asyncio.current_task()
        assert task is not None
        if self._stopping or len(self._connections) >= self._settings.max_connections:
            self._on_refused()
            log.debug(
                "metrics: %d connections open, closing one from %s", len(self._connections), peer
            )
            writer.transport.abort()
            return
        self._connections[task] = writer
        try:
            await self._serve(reader, writer, peer)
            writer.close()  # the last answer may still be buffered: flush it, in bounded time
            async with asyncio.timeout(self._settings.header_timeout):
                await writer.wait_closed()
        except (TimeoutError, OSError, asyncio.CancelledError) as error:
            log.debug("metrics: connection from %s closed: %r", peer, error)
        except Exception:  # a bug here, not the client's doing
            log.exception("metrics: connection from %s failed", peer)
        finally:
            del self._connections[task]  # before the client can see the close
            writer.transport.abort()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object
    ) -> None:
        """Answer requests until the connection is to close; TimeoutError past a deadline."""
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=self._settings.max_header_bytes)
        first = True
        while True:
            try:
                request, body_fits = await self._read_request(http, reader, first)
            except h11.RemoteProtocolError as error:
                log.debug("metrics: bad request from %s: %s", peer, error)
                if http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    close = [("Connection", "close")]
                    await self._send(writer, http, (error.error_status_hint, close, b""), False)
                return
            if request is None:
                return  # the client closed the connection between requests
            answer = self._answer(request) if body_fits else (413, [("Connection", "close")], b"")
            await self._send(writer, http, answer, request.method == b"HEAD")
            if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
                return  # Connection: close, HTTP/1.0, or a body left unread
            http.start_next_cycle()
            first = False

    async def _read_request(
        self, http: h11.Connection, reader: asyncio.StreamReader, first: bool
    ) -> tuple[h11.Request | None, bool]:
        """The next request, body read and dropped, and whether that body fit the bound.
        ``(None, True)`` if the client closed the connection first."""
        settings, loop = self._settings, asyncio.get_running_loop()
        idle = not first and not http.trailing_data[0]
        request: h11.Request | None = None
        body_bytes = 0
        async with asyncio.timeout(
            settings.idle_timeout if idle else settings.header_timeout
        ) as deadline:
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(_READ_BYTES)
                    if idle and data:  # a request begins: its head is due within header_timeout
                        idle = False
                        deadline.reschedule(loop.time() + settings.header_timeout)
                    http.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body_bytes += len(event.data)
                    if body_bytes > MAX_BODY_BYTES:
                        return request, False
                elif isinstance(event, h11.EndOfMessage):
                    return request, True
                else:  # h11.ConnectionClosed (or PAUSED, which ends the connection as well)
                    return None, True

    def _answer(self, request: h11.Request) -> Answer:
        path = request.target.partition(b"?")[0]
        check = self._checks.get(path)
        if path != b"/metrics" and check is None:
            return 404, [("Content-Type", _TEXT)], b"Not Found\n"
        if request.method not in (b"GET", b"HEAD"):
            return 405, [("Content-Type", _TEXT), ("Allow", "GET, HEAD")], b"Method Not Allowed\n"
        if check is not None:
            return _health_answer(check)
        accept = b",".join(value for name, value in request.headers if name == b"accept")
        try:
            encoder, content_type = choose_encoder(accept.decode("latin-1"))
        except (TypeError, ValueError) as error:  # it compares versions like "1.x" and fails
            log.debug("metrics: unusable Accept %r (%r): the text format instead", accept, error)
            encoder, content_type = choose_encoder("")
        try:
            body = encoder(self._registry)
        except Exception:  # a collector failed: the server's fault, not the client's
            log.exception("metrics: collecting the registry failed")
            return 500, [("Content-Type", _TEXT)], b"Internal Server Error\n"
        return 200, [("Content-Type", content_type)], body

    async def _send(
        self, writer: asyncio.StreamWriter, http: h11.Connection, answer: Answer, head: bool
    ) -> None:
        """Write one answer (no body to a HEAD), and drain it within ``header_timeout``."""
        status, headers, body = answer
        headers = [*headers, ("Content-Length", str(len(body)))]
        events: list[h11.Event] = [
            h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)
        ]
        if body and not head:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        writer.write(b"".join(http.send(event) or b"" for event in events))
        async with asyncio.timeout(self._settings.header_timeout):
            await writer.drain()


def _health_answer(check: HealthCheck) -> Answer:
    """200 ``ok``, or 503 with the check's reason (a failing check is the server's state, not
    an error: a bug in it answers 500 and is logged)."""
    try:
        problem = check()
    except Exception:
        log.exception("metrics: a health check failed")
        return 500, [("Content-Type", _TEXT)], b"Internal Server Error\n"
    if problem is None:
        return 200, [("Content-Type", _TEXT)], b"ok\n"
    return 503, [("Content-Type", _TEXT)], problem.encode("utf-8", "replace")[:1024] + b"\n"
