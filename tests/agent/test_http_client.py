"""The probes' HTTP client (``servehealth_common.http``) against real servers on 127.0.0.1.

An aiohttp server for well-formed HTTP (keep-alive, ``Connection: close``, chunked and long
bodies), raw asyncio servers for what aiohttp would not do (close a kept-alive connection as a
request arrives, answer half, answer HTTP/1.0, never answer). Checks what the server saw
(connections, headers) and that the client pools, retries, cuts and closes as it should.

The pool is observed from the servers' side only: a connection the client keeps idle is one
the next request reuses (the same client address) and that stays open; one it does not keep
is one it closes (the server reads the end of it) and that no request uses again.
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
from testsupport.fakes import refused_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuccess"


@dataclass
class AiohttpServer:
    """Answers /ok, /close (then closes), /chunked and /big; records each request's client
    address (one per connection) and headers, and each connection's transport."""

    peers: list[tuple[str, int]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    transports: dict[tuple[str, int], asyncio.BaseTransport] = field(default_factory=dict)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def connections(self) -> int:
        return len(set(self.peers))

    @property
    def open_connections(self) -> int:
        """Connections that carried a request and are not closed yet: aiohttp closes its end
        as soon as it reads the end of the client's (or when it answered ``/close``)."""
        return sum(not transport.is_closing() for transport in self.transports.values())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peer = request.transport.get_extra_info("peername")
        self.peers.append(peer)
        self.transports[peer] = request.transport
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
    #: connections whose serve() returned (the server side closed them); for a serve() that
    #: reads until the end of the connection (``keep_alive``), those the client closed
    finished: int = 0
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
    for i in range(5):
        assert await client.get(server.url("/-/healthz")) == (200, b"success")
        assert server.peers == [server.peers[0]] * (i + 1)  # all on the first connection
        assert server.open_connections == 1  # kept open after each answer
    assert len(server.peers) == 5
    assert server.connections == 1
    headers = server.headers[0]
    assert headers["Host"] == f"127.0.0.1:{server.port}"
    assert headers["Connection"] == "keep-alive"


async def test_idle_pool_is_bounded_per_host(server: AiohttpServer) -> None:
    async with HTTPClient(max_idle_per_host=1) as client:
        await asyncio.gather(*(client.get(server.url("/")) for _ in range(3)))
        assert server.connections == 3
        await eventually(lambda: server.open_connections == 1)  # the client closed two
        await client.get(server.url("/"))  # on the one it kept
        assert server.connections == 3
        assert server.open_connections == 1


async def test_idle_pool_is_bounded_in_all(server: AiohttpServer) -> None:
    async with (
        HTTPClient(max_idle=2) as client,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_a,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_b,
    ):
        for url in (server.url("/"), other_a.url, other_b.url):
            await client.get(url)
        await eventually(lambda: server.open_connections == 0)  # the oldest: closed, evicted
        for other in (other_a, other_b):  # the two others were kept: reused
            await client.get(other.url)
            assert (other.connections, other.finished) == (1, 0)
        await client.get(server.url("/"))  # the oldest (this one) was evicted
        assert server.connections == 2
        await eventually(lambda: other_a.finished == 1)  # now the oldest: evicted in its turn
        assert other_b.finished == 0


async def test_close_closes_the_idle_pool() -> None:
    async with (
        RawServer(lambda r, w, _: keep_alive(r, w)) as raw_a,
        RawServer(lambda r, w, _: keep_alive(r, w)) as raw_b,
    ):
        client = HTTPClient()
        for _ in range(2):  # two connections to a, one to b; the second round reuses them
            await asyncio.gather(client.get(raw_a.url), client.get(raw_a.url))
            await client.get(raw_b.url)
        assert (raw_a.connections, raw_b.connections) == (2, 1)
        assert raw_a.finished == raw_b.finished == 0
        await client.close()
        await eventually(lambda: (raw_a.finished, raw_b.finished) == (2, 1))


async def test_connection_close_answer_is_not_pooled(
    client: HTTPClient, server: AiohttpServer
) -> None:
    assert await client.get(server.url("/close")) == (200, b"success")
    await client.get(server.url("/close"))
    assert server.connections == 2

    async def close_in_words(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 7\r\n\r\nsuccess")
        await keep_alive(reader, writer)  # leaves the closing to the client

    async with RawServer(close_in_words) as raw:
        assert await client.get(raw.url) == (200, b"success")
        await eventually(lambda: raw.finished == 1)  # the client closed it
        assert await client.get(raw.url) == (200, b"success")
        assert raw.connections == 2


async def test_connection_closed_while_idle_leaves_the_pool() -> None:
    """Left in the pool, the dead connection would count against ``max_idle``: once it is
    gone from the pool, the pool still has room for two live ones."""

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(OK)  # keep-alive as far as the headers go, then hang up
        writer.write_eof()
        await read_request(reader)  # returns b"" once the client has closed its end too

    async with (
        HTTPClient(max_idle=2) as client,
        RawServer(answer_once) as raw,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_a,
        RawServer(lambda r, w, _: keep_alive(r, w)) as other_b,
    ):
        await client.get(other_a.url)  # the oldest idle connection
        assert await client.get(raw.url) == (200, b"success")
        await eventually(lambda: raw.finished == 1)  # the client saw the hang-up
        await client.get(other_b.url)  # the pool's second place: evicts nothing
        await client.get(other_a.url)
        assert (other_a.connections, other_a.finished) == (1, 0)
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
        assert await client.get(raw.url) == (200, b"success")  # the new one was kept
        assert raw.connections == 2


async def test_no_retry_after_part_of_an_answer(client: HTTPClient) -> None:
    async def half_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuc")
        writer.write_eof()  # hang up, our end only
        await read_request(reader)  # returns b"" once the client has closed its end too

    async with RawServer(half_on_second) as raw:
        await client.get(raw.url)
        with pytest.raises(HTTPClientError):
            await client.get(raw.url)
        assert raw.connections == 1
        await eventually(lambda: raw.finished == 1)  # the client closed it
        assert await client.get(raw.url) == (200, b"success")  # on a new connection
        assert raw.connections == 2


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
    await eventually(lambda: server.open_connections == 0)  # the client closed it
    await client.get(server.url("/-/healthz"))
    assert server.connections == 2


async def test_http_1_0_answer_delimited_by_close(client: HTTPClient) -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int):
        await read_request(reader)
        writer.write(b"HTTP/1.0 503 Service Unavailable\r\n\r\nThis node is being drained.")
        writer.write_eof()  # the end of the answer, and of our end of the connection
        await read_request(reader)  # returns b"" once the client has closed its end too

    async with RawServer(http10) as raw:
        assert await client.get(raw.url) == (503, b"This node is being drained.")
        await eventually(lambda: raw.finished == 1)  # the client closed it


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
        await asyncio.wait_for(eof.wait(), 5)  # the client closed it


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
        await eventually(lambda: raw.finished == 1)  # the client closed it


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
