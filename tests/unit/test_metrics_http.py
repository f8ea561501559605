"""``servehealth_common.metrics_http``: the h11 ``/metrics`` server, driven over raw sockets.

A real server on 127.0.0.1 (a free port) and ``asyncio.open_connection`` clients. Covers the
scrape (text format, OpenMetrics by ``Accept``, an ``Accept`` prometheus_client chokes on, a
query string, HEAD), 404 and 405, keep-alive and ``Connection: close``, a request body dropped;
and the bounds against hostile clients: the header deadline (first request and kept-alive),
the idle timeout, the connection cap, a 4xx for garbage logged at DEBUG only, stop() cutting
open connections; and the validation of the settings. The server closing a connection is
awaited as an event (EOF) under an outer timeout, never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import h11
import pytest
from prometheus_client import CollectorRegistry, Counter

from servehealth_common.metrics_http import MetricsServer, MetricsServerSettings

#: Outer bound on waiting for an answer or for the server to close a connection.
WAIT = 5.0
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
LOGGER = "servehealth_common.metrics_http"

StartServer = Callable[..., Awaitable[MetricsServer]]


class Client:
    """One raw connection; requests and answers are framed with an h11 client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT)

    async def request(
        self,
        method: str = "GET",
        target: str = "/metrics",
        headers: tuple[tuple[str, str], ...] = (),
        body: bytes = b"",
    ) -> tuple[h11.Response, bytes]:
        http = self.http
        if body:
            headers = (*headers, ("Content-Length", str(len(body))))
        request = h11.Request(method=method, target=target, headers=[("Host", "x"), *headers])
        data = http.send(request) or b""
        if body:
            data += http.send(h11.Data(data=body)) or b""
        self.writer.write(data + (http.send(h11.EndOfMessage()) or b""))
        response: h11.Response | None = None
        received = b""
        async with asyncio.timeout(WAIT):
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    http.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    received += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(f"unexpected {event!r}")
        assert response is not None
        if http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
        return response, received

    async def read_to_eof(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        async with asyncio.timeout(WAIT):
            return await self.reader.read()


class TimeoutLogged(logging.Handler):
    """``event`` is set when the server logs a connection closed on a TimeoutError."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and any(
            isinstance(arg, TimeoutError) for arg in record.args
        ):
            self.event.set()


def header(response: h11.Response, name: bytes) -> str:
    return dict(response.headers)[name].decode()


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("test_scrapes", "A counter in a registry of the test's own.", registry=registry).inc(3)
    return registry


@pytest.fixture
async def start_server(registry: CollectorRegistry) -> AsyncIterator[StartServer]:
    """``await start_server(header_timeout=0.2, ...)``: a started server on 127.0.0.1:0."""
    servers: list[MetricsServer] = []

    async def start(**overrides: Any) -> MetricsServer:
        """``refused``: a list that gets one entry per connection the server refused."""
        refused: list[None] = overrides.pop("refused", [])
        checks = overrides.pop("checks", None)
        server = MetricsServer(
            registry,
            MetricsServerSettings("127.0.0.1", 0, **overrides),
            on_refused=lambda: refused.append(None),
            checks=checks,
        )
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[MetricsServer], Awaitable[Client]]]:
    """``await connect(server)``: a raw connection, closed after the test."""
    clients: list[Client] = []

    async def open_client(server: MetricsServer) -> Client:
        client = Client(*await asyncio.open_connection(*server.address))
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.writer.close()
        with contextlib.suppress(OSError):
            await client.writer.wait_closed()


@pytest.fixture
async def server(start_server: StartServer) -> MetricsServer:
    return await start_server()


@pytest.fixture
def no_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture every log record; fail if one is at WARNING or above."""
    caplog.set_level(logging.DEBUG)
    yield caplog
    loud = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert not loud, [record.getMessage() for record in loud]


async def test_scrape_returns_the_registry_as_text(server: MetricsServer, connect: Any) -> None:
    client = await connect(server)
    response, body = await client.request()
    assert response.status_code == 200
    assert header(response, b"content-type").startswith("text/plain; version=")
    assert int(header(response, b"content-length")) == len(body)
    assert b"\ntest_scrapes_total 3.0\n" in body


async def test_query_string_is_ignored(server: MetricsServer, connect: Any) -> None:
    response, body = await (await connect(server)).request(target="/metrics?name[]=x&debug=1")
    assert response.status_code == 200
    assert b"test_scrapes_total 3.0" in body


async def test_openmetrics_when_accepted(server: MetricsServer, connect: Any) -> None:
    accept = ("Accept", "application/openmetrics-text; version=1.0.0, text/plain;q=0.5")
    response, body = await (await connect(server)).request(headers=(accept,))
    assert response.status_code == 200
    assert header(response, b"content-type").startswith("application/openmetrics-text")
    assert b"test_scrapes_total 3.0\n" in body
    assert body.endswith(b"# EOF\n")


@pytest.mark.parametrize(
    "accept", ["application/openmetrics-text; version=1.x", "text/plain; version=abc"]
)
async def test_an_accept_prometheus_client_chokes_on_gets_text(
    server: MetricsServer, connect: Any, no_warnings: Any, accept: str
) -> None:
    response, body = await (await connect(server)).request(headers=(("Accept", accept),))
    assert response.status_code == 200
    assert header(response, b"content-type").startswith("text/plain")
    assert b"test_scrapes_total 3.0" in body


async def test_head_has_headers_and_no_body(server: MetricsServer, connect: Any) -> None:
    client = await connect(server)
    client.writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = (await client.read_to_eof()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"content-length: 0" not in head.lower()
    assert body == b""


@pytest.mark.parametrize(
    ("method", "target", "status", "allow"),
    [
        pytest.param("GET", "/", 404, None, id="root"),
        pytest.param("GET", "/metricsx", 404, None, id="other-path"),
        pytest.param("POST", "/metrics", 405, "GET, HEAD", id="post"),
        pytest.param("DELETE", "/metrics", 405, "GET, HEAD", id="delete"),
    ],
)
async def test_other_paths_and_methods(
    server: MetricsServer,
    connect: Any,
    method: str,
    target: str,
    status: int,
    allow: str | None,
) -> None:
    response, _ = await (await connect(server)).request(method, target)
    assert response.status_code == status
    assert dict(response.headers).get(b"allow") == (allow.encode() if allow else None)


async def test_health_checks_answer_200_or_503_with_the_reason(
    start_server: StartServer, connect: Any
) -> None:
    ready: list[str | None] = [None]

    def broken() -> str | None:
        raise RuntimeError("a bug in a check")

    server = await start_server(
        checks={"/livez": lambda: None, "/readyz": lambda: ready[0], "/broken": broken}
    )
    client = await connect(server)
    assert (await client.request("GET", "/livez"))[0].status_code == 200
    response, body = await client.request("GET", "/readyz?verbose")
    assert (response.status_code, body) == (200, b"ok\n")
    ready[0] = "standby: waiting for the first pod list"
    response, body = await client.request("GET", "/readyz")
    assert (response.status_code, body) == (503, b"standby: waiting for the first pod list\n")
    response, body = await client.request("HEAD", "/readyz")
    assert (response.status_code, body) == (503, b"")
    assert (await client.request("POST", "/readyz"))[0].status_code == 405
    assert (await client.request("GET", "/broken"))[0].status_code == 500
    # Without checks, the paths do not exist.
    assert (await (await connect(await start_server())).request("GET", "/readyz"))[
        0
    ].status_code == 404


async def test_keep_alive_then_connection_close(server: MetricsServer, connect: Any) -> None:
    client = await connect(server)
    for _ in range(2):
        response, body = await client.request()
        assert response.status_code == 200
        assert b"test_scrapes_total 3.0" in body
    response, _ = await client.request(body=b"x" * 5000, method="POST")  # read and dropped
    assert response.status_code == 405
    response, _ = await client.request(headers=(("Connection", "close"),))
    assert response.status_code == 200
    assert await client.read_to_eof() == b""


@pytest.mark.parametrize("kept_alive", [False, True], ids=["first-request", "kept-alive"])
async def test_a_half_sent_request_is_cut_after_header_timeout(
    start_server: StartServer, connect: Any, kept_alive: bool
) -> None:
    server = await start_server(header_timeout=0.2)  # idle_timeout stays 30 s
    client = await connect(server)
    if kept_alive:
        assert (await client.request())[0].status_code == 200
    client.writer.write(HALF_SENT)
    assert await client.read_to_eof() == b""  # closed without an answer, well before WAIT


async def test_an_idle_kept_alive_connection_is_closed(
    start_server: StartServer, connect: Any
) -> None:
    server = await start_server(idle_timeout=0.2)
    client = await connect(server)
    assert (await client.request())[0].status_code == 200
    assert await client.read_to_eof() == b""


async def test_connections_beyond_the_cap_are_closed_at_once(
    start_server: StartServer, connect: Any
) -> None:
    refused: list[None] = []
    server = await start_server(max_connections=3, header_timeout=2.0, refused=refused)
    held = [await connect(server) for _ in range(3)]
    for client in held:  # an answer proves the server counts the connection
        assert (await client.request())[0].status_code == 200
        client.writer.write(HALF_SENT)
    extra = await connect(server)
    assert await extra.read_to_eof() == b""
    assert len(refused) == 1
    for client in held:  # then the header deadline cuts the half-open ones ...
        assert await client.read_to_eof() == b""
    response, _ = await (await connect(server)).request()  # ... and their places are free
    assert response.status_code == 200
    assert len(refused) == 1


async def test_a_client_that_does_not_read_is_cut(
    start_server: StartServer,
    connect: Any,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    padding = Counter("test_padding", "Makes an answer ~100 kB.", ["name"], registry=registry)
    for index in range(2000):
        padding.labels(f"padding-{index:06d}").inc()
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    timeouts = TimeoutLogged()
    logging.getLogger(LOGGER).addHandler(timeouts)
    try:
        refused: list[None] = []
        server = await start_server(max_connections=1, header_timeout=0.3, refused=refused)
        stuck = await connect(server)
        assert (await stuck.request())[0].status_code == 200  # it holds the only place
        stuck.writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 300)  # never read
        async with asyncio.timeout(WAIT):  # the stuck drain times out: the place is freed
            await timeouts.event.wait()
    finally:
        logging.getLogger(LOGGER).removeHandler(timeouts)
    response, _ = await (await connect(server)).request()
    assert response.status_code == 200
    assert not refused


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", id="tls-hello"),
        pytest.param(b"GET /metrics HTTP/1.1\r\n\r\n", id="no-host"),
        pytest.param(b"GET /metrics HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n", id="bad-header"),
        pytest.param(
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n",
            id="bad-content-length",
        ),
    ],
)
async def test_garbage_gets_400_and_no_warning(
    server: MetricsServer, connect: Any, no_warnings: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    client = await connect(server)
    client.writer.write(garbage)
    answer = await client.read_to_eof()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert any(record.name == LOGGER for record in no_warnings.records)


async def test_stop_closes_open_connections_and_is_idempotent(
    server: MetricsServer, connect: Any
) -> None:
    idle = await connect(server)
    assert (await idle.request())[0].status_code == 200
    half_sent = await connect(server)
    half_sent.writer.write(HALF_SENT)
    await server.stop()
    assert await idle.read_to_eof() == b""
    with contextlib.suppress(ConnectionResetError):  # if cut before the server read the bytes
        assert await half_sent.read_to_eof() == b""
    await server.stop()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(*server.address)


async def test_start_raises_oserror_when_the_port_is_taken(
    server: MetricsServer, registry: CollectorRegistry
) -> None:
    host, port = server.address
    with pytest.raises(OSError, match="in use"):
        await MetricsServer(registry, MetricsServerSettings(host, port)).start()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"header_timeout": 0}, "header_timeout", id="header-timeout-zero"),
        pytest.param({"header_timeout": float("nan")}, "header_timeout", id="header-timeout-nan"),
        pytest.param({"idle_timeout": -1.0}, "idle_timeout", id="idle-timeout-negative"),
        pytest.param({"idle_timeout": float("inf")}, "idle_timeout", id="idle-timeout-inf"),
        pytest.param({"max_connections": 0}, "max_connections", id="max-connections-zero"),
        pytest.param({"max_header_bytes": 0}, "max_header_bytes", id="max-header-bytes-zero"),
        pytest.param({"port": -1}, "port", id="port-negative"),
        pytest.param({"port": 65536}, "port", id="port-too-big"),
    ],
)
def test_settings_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MetricsServerSettings(**{"host": "127.0.0.1", "port": 0, **overrides})
