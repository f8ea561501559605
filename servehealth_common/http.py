"""A minimal HTTP/1.1 client for probes: ``GET`` on a kept-alive connection, a capped body.

Why not aiohttp: the probes need one thing, ``GET`` of a short answer. Importing aiohttp cost
the sidecar agent 11.5 MiB of RSS (56.5 MiB against a target of 50; 46.0 MiB without it), and
its client was most of the aggregator's CPU in a pull sweep (``bench.pull_sweep``, 2,000 pods:
first sweep 2.3 s, 0.7-0.9 ms of CPU per pull; with this client 1.5 s, about 0.5 ms).

This module is an :class:`asyncio.Protocol` around h11 (python-hyper's sans-IO HTTP/1.1 state
machine): one future per request, the answer parsed in ``data_received``. Per kept-alive GET it
measured about as cheap as aiohttp's client (60-90 us of CPU, noisy), and no dearer than the
same h11 code over ``asyncio`` streams; the gain is in connecting and in all aiohttp does
around a request. The request event is built (and validated by h11) once per URL.

What it does, and no more:

- ``GET`` of ``http(s)://host:port/path``, ``Host`` and ``Connection: keep-alive`` headers
  (and any given per request), redirects not followed (a 3xx is just a status), at most
  :data:`MAX_BODY_BYTES` of body (or ``max_body``): a longer one is cut there and its
  connection closed rather than drained.
- A keep-alive pool per (scheme, host, port): at most ``max_idle_per_host`` idle connections per
  host, ``max_idle`` in all, none idle longer than ``idle_timeout``. A connection the server
  closes while idle leaves the pool at once; one it closed just before it was reused (EOF or
  reset before any byte of the answer) is retried once on a fresh connection (``GET`` is
  idempotent). Never after part of an answer.
- A connection whose request is cancelled (a timeout) or fails is aborted, never pooled.

Errors: :class:`OSError` from the socket (:class:`ConnectionRefusedError` when every address
refused), :class:`HTTPClientError` for a broken or cut-short answer.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import typing
from typing import NamedTuple
from urllib.parse import urlsplit

import h11

#: Proxies answer a few bytes; never read more than this from one.
MAX_BODY_BYTES = 4096
USER_AGENT = "ray-serve-health"


class HTTPClientError(Exception):
    """The server's answer was unusable: not HTTP, or cut short."""


class InvalidURL(HTTPClientError, ValueError):
    """Not an ``http://`` or ``https://`` URL with a host."""


class ServerDisconnected(HTTPClientError):
    """The connection ended before the answer did; ``answered``: after part of it."""

    def __init__(self, answered: bool, cause: BaseException | None = None) -> None:
        what = "in the middle of its answer" if answered else "without answering"
        super().__init__(f"Server closed the connection {what}" + (f" ({cause})" if cause else ""))
        self.answered = answered


class Response(NamedTuple):
    status: int
    body: bytes  # at most MAX_BODY_BYTES (or the request's max_body)


Key = tuple[str, str, int]  # scheme, host, port


class Target(NamedTuple):
    """Where a URL points: the pool key (scheme, host, port), then what to send."""

    scheme: str
    host: str  # without the brackets of an IPv6 address
    port: int
    host_header: str
    path: str  # with the query, if any


@functools.lru_cache(maxsize=4096)
def parse_url(url: str) -> Target:
    """``Target`` of an ``http://`` or ``https://`` URL; InvalidURL for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError if not a number in range
    except ValueError as error:
        raise InvalidURL(f"{error}: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidURL(f"not an http(s) URL: {url!r}")
    default_port = 443 if parts.scheme == "https" else 80
    port = port or default_port
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = netloc if port == default_port else f"{netloc}:{port}"
    target = Target(parts.scheme, host, port, host_header, path)
    try:  # before any connection (or name lookup) is made for it
        host.encode("idna")
        _request(target)
    except (UnicodeError, h11.LocalProtocolError) as error:
        raise InvalidURL(f"{error}: {url!r}") from None
    return target


class HTTPClient:
    """``await client.get(url)`` → :class:`Response`; ``await client.close()`` (or ``async
    with``) closes the idle connections. Bound requests in flight yourself."""

    def __init__(
        self, *, max_idle_per_host: int = 2, max_idle: int = 256, idle_timeout: float = 15.0
    ) -> None:
        self._max_idle_per_host = max_idle_per_host
        self._max_idle = max_idle
        self._idle_timeout = idle_timeout
        self._idle: dict[Key, list[_Connection]] = {}  # per host, the freshest last
        self._lru: dict[_Connection, None] = {}  # every idle connection, the oldest first
        self._closed = False

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def get(
        self,
        url: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
        max_body: int = MAX_BODY_BYTES,
    ) -> Response:
        """``GET url``; ``headers`` are sent besides the client's own, and at most ``max_body``
        bytes of the answer are read."""
        target = parse_url(url)
        request = _request(target) if not headers else _request_with(target, headers)
        pooled = self._take(target[:3])
        if pooled is not None:
            try:
                return await self._exchange(pooled, request, max_body)
            except (ServerDisconnected, ConnectionError):
                if pooled.answered:
                    raise
                # The server closed it while it sat idle: try once more, on a new connection.
        return await self._exchange(await _connect(target), request, max_body)

    async def close(self) -> None:
        self._closed = True
        for connection in list(self._lru):
            self._discard(connection)
            connection.close()

    # -- the pool ------------------------------------------------------------------------

    async def _exchange(
        self, connection: _Connection, request: h11.Request, max_body: int
    ) -> Response:
        try:
            response, reusable = await connection.request(request, max_body)
        except BaseException:
            connection.abort()  # a cancelled or failed request leaves the connection unusable
            raise
        if reusable:
            self._put(connection)
        else:
            connection.close()
        return response

    def _take(self, key: Key) -> _Connection | None:
        connections = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while connections:
            connection = connections[-1]
            self._discard(connection)
            if now - connection.idle_since < self._idle_timeout and connection.usable:
                return connection
            connection.close()
        return None

    def _put(self, connection: _Connection) -> None:
        connections = self._idle.setdefault(connection.key, [])
        if len(connections) >= self._max_idle_per_host or self._closed:
            connection.close()
            return
        now = asyncio.get_running_loop().time()
        connection.idle_since = now
        connection.pool = self
        connections.append(connection)
        self._lru[connection] = None
        while self._lru:  # evict the oldest beyond the cap or past the idle timeout
            oldest = next(iter(self._lru))
            if len(self._lru) <= self._max_idle and now - oldest.idle_since < self._idle_timeout:
                break
            self._discard(oldest)
            oldest.close()

    def _discard(self, connection: _Connection) -> None:
        """Take an idle ``connection`` out of the pool (it closed, or is taken or evicted)."""
        connection.pool = None
        del self._lru[connection]
        connections = self._idle[connection.key]
        connections.remove(connection)
        if not connections:
            del self._idle[connection.key]


async def _connect(target: Target) -> _Connection:
    """A new connection to ``target``, trying each address of a host name in turn.
    ConnectionRefusedError only if every address refused."""
    loop = asyncio.get_running_loop()
    if _is_ip_address(target.host):
        addresses = [target.host]
    else:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    tls = target.scheme == "https"
    errors: list[OSError] = []
    for address in addresses:
        connection = _Connection(target[:3])
        try:
            await loop.create_connection(
                lambda connection=connection: connection,
                address,
                target.port,
                ssl=tls or None,
                server_hostname=target.host if tls else None,
            )
        except OSError as error:
            errors.append(error)
        else:
            return connection
    for failure in errors:  # an address that did not refuse says more
        if not isinstance(failure, ConnectionRefusedError):
            raise failure
    raise errors[0]


_END = h11.EndOfMessage()


@functools.lru_cache(maxsize=4096)
def _request(target: Target) -> h11.Request:
    """The (immutable) request event for ``target``: validated once, not per request."""
    return h11.Request(
        method="GET",
        target=target.path,
        headers=[
            ("Host", target.host_header),
            ("Connection", "keep-alive"),
            ("User-Agent", USER_AGENT),
        ],
    )


def _request_with(target: Target, headers: tuple[tuple[str, str], ...]) -> h11.Request:
    """The request event for ``target`` with extra ``headers`` (not cached: they may hold a
    secret); h11.LocalProtocolError for a header it refuses."""
    base = _request(target)
    return h11.Request(method="GET", target=target.path, headers=[*base.headers, *headers])


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Connection(asyncio.Protocol):
    """One TCP connection, one request at a time; parses the answer as it arrives."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self.pool: HTTPClient | None = None  # while idle in a pool
        self.idle_since = 0.0
        self.answered = False  # a byte of the current answer arrived
        self._transport: asyncio.Transport | None = None  # set by connection_made
        self._http = h11.Connection(h11.CLIENT)
        self._waiter: asyncio.Future[tuple[Response, bool]] | None = None
        self._status = 0
        self._body = bytearray()
        self._max_body = MAX_BODY_BYTES

    @property
    def usable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    async def request(
        self, request: h11.Request, max_body: int = MAX_BODY_BYTES
    ) -> tuple[Response, bool]:
        """The answer to ``request``, and whether the connection may be reused."""
        assert self._transport is not None, "not connected"
        assert self._waiter is None, "one request at a time"
        http = self._http
        data = http.send(request) + http.send(_END)
        self.answered, self._status, self._body = False, 0, bytearray()
        self._max_body = max_body
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(data)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self._idle_lost()  # nobody asked: the server misbehaves
            self.abort()
            return
        self.answered = True
        self._http.receive_data(data)
        self._advance()

    def eof_received(self) -> bool:
        self._idle_lost()
        if self._waiter is not None and not self._waiter.done():
            if self.answered:
                self._http.receive_data(b"")  # the end of an answer delimited by closing?
                self._advance()
            if not self._waiter.done():
                self._waiter.set_exception(ServerDisconnected(self.answered))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._idle_lost()
        if self._waiter is not None and not self._waiter.done():
            if isinstance(exc, OSError) and not self.answered:
                self._waiter.set_exception(exc)  # a reset: retried if the connection was pooled
            else:
                self._waiter.set_exception(ServerDisconnected(self.answered, exc))
        self._transport = None

    def _idle_lost(self) -> None:
        if self.pool is not None:
            self.pool._discard(self)

    def _advance(self) -> None:
        """Consume the events h11 has so far; resolve the waiter at the end of the answer."""
        assert self._waiter is not None
        http = self._http
        try:
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    return
                kind = type(event)
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.Data):
                    self._body += event.data
                    if len(self._body) >= self._max_body:  # enough: no draining the rest
                        self._finish(reusable=False)
                        return
                elif kind is h11.EndOfMessage:
                    reusable = (
                        http.our_state is h11.DONE
                        and http.their_state is h11.DONE
                        and not http.trailing_data[0]
                    )
                    if reusable:
                        http.start_next_cycle()
                    self._finish(reusable)
                    return
                elif kind is h11.ConnectionClosed:
                    self._waiter.set_exception(ServerDisconnected(answered=True))
                    return
                # h11.InformationalResponse (1xx): the real answer follows.
        except h11.RemoteProtocolError as error:
            self._waiter.set_exception(HTTPClientError(f"Invalid HTTP answer: {error}"))

    def _finish(self, reusable: bool) -> None:
        body = bytes(self._body[: self._max_body])
        assert self._waiter is not None
        self._waiter.set_result((Response(self._status, body), reusable))
