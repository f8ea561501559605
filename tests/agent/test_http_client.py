"""The probes' HTTP client (``servehealth_common.http``) against real servers on 127.0.0.1.

An aiohttp server for well-formed HTTP (keep-alive, ``Connection: close``, chunked and long
bodies), raw asyncio servers for what aiohttp would not do (close a kept-alive connection as a
request arrives, answer half, answer HTTP/1.0, never answer). Checks what the server saw
(connections, headers) and that the client pools, retries, cuts and closes as it should.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from servehealth_common.http import (
    MAX_BODY_BYTES,
    HTTPClient,
    HTTPClientError,
    InvalidURL,
    ServerDisconnected,
    Target,
    parse_url,
)
from tests.conftest import eventually
from tests.fakes import refused_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuccess"


@dataclass
class AiohttpServer:
    """Answers /ok, /close (then closes), /chunked and /big; records each request's client
    address (one per connection) and headers."""

    peers: list[tuple[str, int]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def connections(self) -> int:
        return len(set(self.peers))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        self.headers.append(dict(request.headers))
        if request.path == "/close":
            response = web.Response(text="success")
            response.force_close()
            return response
        if request.path == "/chunked":
            stream = web.StreamResponse()
            stream.enable_chunked_encoding()
            await stream.prepare(request)
            for part in (b"suc", b"ce", b"ss"):
                await stream.write(part)
            await stream.write_eof()
            return stream
        if request.path == "/big":
            return web.Response(body=b"x" * (MAX_BODY_BYTES * 4))
        return web.Response(text="success")


@pytest.fixture
async def server() -> AsyncIterator[AiohttpServer]:
    server = AiohttpServer()
    app = web.Application()
    app.router.add_get("/{path:.*}", server.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.port = runner.addresses[0][1]
    yield server
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    async with HTTPClient() as client:
        yield client


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class RawServer:
    """Runs ``serve(reader, writer, index)`` for the ``index``-th connection; counts them."""

    serve: Serve
    connections: int = 0
    finished: int = 0  # connections whose serve() returned (the server side closed them)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/-/healthz"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        index, self.connections = self.connections, self.connections + 1
        try:
            await self.serve(reader, writer, index)
        finally:
            writer.close()
            self.finished += 1
            self._tasks.discard(task)

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The head of the next request, or b"" once the client has closed."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await read_request(reader):
        writer.write(OK)
        await writer.drain()


# -- keep-alive ----------------------------------------------------------------------------


async def test_connection_is_kept_alive_and_reused(
    client: HTTPClient, server: AiohttpServer
) -> None:
    for _ in range(5):
        assert await client.get(server.url("/-/healthz")) == (200, b"success")
        assert client.idle_connections == 1
    assert len(server.peers) == 5
    assert server.connections == 1
    headers = server.headers[0]
    assert headers["Host"] == f"127.0.0.1:{server.port}"
    assert headers["Connection"] == "keep-alive"


async def test_idle_connections_are_bounded_per_host(server: AiohttpServer) -> None:
    async with HTTPClient(max_idle_per_host=1) as client:
        await asyncio.gather(*(client.get(server.url("/")) for _ in range(3)))
        assert server.connections == 3
        assert client.idle_connections == 1


async def test_idle_connections_are_bounded_in_all(server: AiohttpServer) -> None:
    async with (
        HTTPClient(max_idle=2) as client,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_a,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_b,
    ):
        for url in (server.url("/"), other_a.url, other_b.url):
            await client.get(url)
        assert client.idle_connections == 2
        await client.get(server.url("/"))  # the oldest (this one) was evicted
        assert server.connections == 2


async def test_close_closes_idle_connections(server: AiohttpServer) -> None:
    async with RawServer(lambda r, w, _: keep_alive(r, w)) as raw:
        client = HTTPClient()
        await client.get(raw.url)
        assert client.idle_connections == 1
        await client.close()
        assert client.idle_connections == 0
        await eventually(lambda: raw.finished == 1)


async def test_connection_close_answer_is_not_pooled(
    client: HTTPClient, server: AiohttpServer
) -> None:
    assert await client.get(server.url("/close")) == (200, b"success")
    assert client.idle_connections == 0
    await client.get(server.url("/close"))
    assert server.connections == 2


async def test_connection_closed_while_idle_leaves_the_pool(client: HTTPClient) -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(OK)  # keep-alive as far as the headers go, then hang up

    async with RawServer(answer_once) as raw:
        assert await client.get(raw.url) == (200, b"success")
        await eventually(lambda: client.idle_connections == 0)
        assert await client.get(raw.url) == (200, b"success")
        assert raw.connections == 2


async def test_kept_alive_connection_closed_on_reuse_is_retried_once(client: HTTPClient) -> None:
    """The server closes the idle connection just as the next request arrives (its keep-alive
    timeout): the request goes again on a new connection, unnoticed by the caller."""

    async def close_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int):
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        if i == 0:
            await read_request(reader)  # the reuse: hang up without a word
            return
        await keep_alive(reader, writer)

    async with RawServer(close_on_second) as raw:
        assert await client.get(raw.url) == (200, b"success")
        assert await client.get(raw.url) == (200, b"success")
        assert raw.connections == 2
        assert client.idle_connections == 1


async def test_no_retry_after_part_of_an_answer(client: HTTPClient) -> None:
    async def half_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuc")
        await writer.drain()

    async with RawServer(half_on_second) as raw:
        await client.get(raw.url)
        with pytest.raises(HTTPClientError):
            await client.get(raw.url)
        assert raw.connections == 1
        assert client.idle_connections == 0


async def test_fresh_connection_closed_without_answer_is_not_retried(client: HTTPClient) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)

    async with RawServer(hang_up) as raw:
        with pytest.raises(ServerDisconnected, match="without answering"):
            await client.get(raw.url)
        assert raw.connections == 1


# -- bodies --------------------------------------------------------------------------------


async def test_chunked_body(client: HTTPClient, server: AiohttpServer) -> None:
    assert await client.get(server.url("/chunked")) == (200, b"success")
    await client.get(server.url("/chunked"))
    assert server.connections == 1


async def test_long_body_is_cut_and_its_connection_closed(
    client: HTTPClient, server: AiohttpServer
) -> None:
    status, body = await client.get(server.url("/big"))
    assert (status, body) == (200, b"x" * MAX_BODY_BYTES)
    assert client.idle_connections == 0
    await client.get(server.url("/-/healthz"))
    assert server.connections == 2


async def test_http_1_0_answer_delimited_by_close(client: HTTPClient) -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"HTTP/1.0 503 Service Unavailable\r\n\r\nThis node is being drained.")

    async with RawServer(http10) as raw:
        assert await client.get(raw.url) == (503, b"This node is being drained.")
        assert client.idle_connections == 0


async def test_redirect_is_a_status(client: HTTPClient) -> None:
    async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n")
        await keep_alive(reader, writer)

    async with RawServer(redirect) as raw:
        assert await client.get(raw.url) == (302, b"")
        assert raw.connections == 1


async def test_garbage_is_an_http_client_error(client: HTTPClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")

    async with RawServer(garbage) as raw:
        with pytest.raises(HTTPClientError, match="Invalid HTTP answer"):
            await client.get(raw.url)


# -- failures, timeouts, cancellation ------------------------------------------------------


async def test_refused_port(client: HTTPClient) -> None:
    with pytest.raises(ConnectionRefusedError):
        await client.get(f"http://127.0.0.1:{refused_port()}/-/healthz")


async def test_timeout_closes_the_connection(client: HTTPClient) -> None:
    eof = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        await reader.read()  # returns at EOF: once the client has given up
        eof.set()

    async with RawServer(silent) as raw:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await client.get(raw.url)
        await asyncio.wait_for(eof.wait(), 5)
        assert client.idle_connections == 0


async def test_cancellation_mid_answer_closes_the_connection(client: HTTPClient) -> None:
    sent = asyncio.Event()

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuc")
        await writer.drain()
        sent.set()
        await reader.read()  # until the client hangs up

    async with RawServer(half) as raw:
        task = asyncio.create_task(client.get(raw.url))
        await asyncio.wait_for(sent.wait(), 5)
        await asyncio.sleep(0)  # let the client take in what was sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: raw.finished == 1)
        assert client.idle_connections == 0


# -- URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "target"),
    [
        pytest.param(
            "http://127.0.0.1:8000/-/healthz",
            Target("http", "127.0.0.1", 8000, "127.0.0.1:8000", "/-/healthz"),
            id="ipv4",
        ),
        pytest.param(
            "http://[fd00::1]:8000/-/routes",
            Target("http", "fd00::1", 8000, "[fd00::1]:8000", "/-/routes"),
            id="ipv6",
        ),
        pytest.param(
            "http://proxy/-/healthz?x=1",
            Target("http", "proxy", 80, "proxy", "/-/healthz?x=1"),
            id="host-default-port-query",
        ),
        pytest.param(
            "https://proxy:8443", Target("https", "proxy", 8443, "proxy:8443", "/"), id="https"
        ),
    ],
)
def test_parse_url(url: str, target: Target) -> None:
    assert parse_url(url) == target


@pytest.mark.parametrize(
    "url", ["ftp://proxy/x", "http:///-/healthz", "http://proxy:99999/", "127.0.0.1:8000"]
)
def test_parse_url_rejects(url: str) -> None:
    with pytest.raises(InvalidURL):
        parse_url(url)
