"""Half-open connections to a gRPC server, by kind, from raw sockets (no gRPC client stack).

Shared by ``bench/flood.py`` and ``tests/aggregator/test_connection_flood.py``. A half-open
connection is one the server must keep state for while the peer makes no progress. The kinds,
in the order the server meets them:

- ``silent``: TCP connect, then nothing (the server waits for the HTTP/2 preface);
- ``preface``: the first half of the 24-byte HTTP/2 client preface, then nothing;
- ``settings``: the whole preface and 5 of the 9 header bytes of a SETTINGS frame;
- ``idle``: a complete HTTP/2 handshake (preface, SETTINGS, the server's SETTINGS acked), no
  stream, then deaf: never reads again, so never acks a PING;
- ``hello``: the handshake, a ``ReportService/Report`` stream and a complete DaemonSet hello
  (no pod, so no tracked state), then deaf: a slow-loris on the stream level that holds one
  of its address's ``--max-streams-per-peer`` slots;
- ``partial``: the handshake, a Report stream and half of a gRPC message frame (its length
  prefix promises more than comes), then deaf.

A peer that vanished without a FIN (power loss, a partition) cannot be produced on loopback
without packet filtering; to the server it looks like the deaf kinds (nothing arrives, no PING
is acked), except that the kernel still acknowledges TCP segments here, so only the server's
own deadlines can end these, never TCP retransmission timeouts. ``close(reset=True)`` ends the
connections with an RST (SO_LINGER 0) instead of a FIN.

Connections come from several loopback source addresses (127.0.0.0/8) so that per-address
limits can be studied: every address but 127.0.0.1, which is left to well-behaved clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from servehealth.v1 import servehealth_pb2 as pb

KINDS = ("silent", "preface", "settings", "idle", "hello", "partial")
#: Kinds that open a Report stream (and so count against --max-streams-per-peer).
STREAM_KINDS = ("hello", "partial")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REPORT_PATH = "/servehealth.v1.ReportService/Report"
_DATA, _HEADERS, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x4, 0x7
_END_HEADERS, _ACK = 0x4, 0x1


class FloodError(RuntimeError):
    """A half-open connection could not be set up as its kind requires."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK: a literal header field without indexing, new name, no Huffman (short strings)."""
    encoded = []
    for text in (name, value):
        raw = text.encode()
        if len(raw) >= 127:
            raise ValueError(f"header too long for this encoder: {text!r}")
        encoded.append(bytes([len(raw)]) + raw)
    return b"\x00" + b"".join(encoded)


def report_headers(authority: str) -> bytes:
    """The HEADERS frame that opens a Report call on stream 1."""
    block = b"".join(
        _literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", REPORT_PATH),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    return frame(_HEADERS, _END_HEADERS, 1, block)


def grpc_message(payload: bytes) -> bytes:
    """A gRPC length-prefixed message: not compressed, 32-bit length, payload."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def node_hello(name: str) -> bytes:
    return pb.AgentMessage(
        hello=pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name=name, agent_version="flood")
    ).SerializeToString()


def sources(count: int, *, skip: int = 0) -> list[str]:
    """``count`` loopback addresses other than 127.0.0.1: 127.0.0.2, ..., 127.0.0.254,
    127.0.1.1, ... (``skip`` leaves out the first ones, for a caller that set them aside)."""
    hosts = (
        f"127.0.{high}.{low}"
        for high in range(256)
        for low in range(1, 255)
        if (high, low) != (0, 1)
    )
    return list(itertools.islice(hosts, skip, skip + count))


async def _read_server_settings(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, step_timeout: float
) -> None:
    """Read frames until the server's own SETTINGS frame (not an ack) has arrived."""
    buffer = b""
    async with asyncio.timeout(step_timeout):
        while True:
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, flags = buffer[3], buffer[4]
                if kind == _GOAWAY:
                    raise FloodError("server sent GOAWAY during the handshake")
                if kind == _SETTINGS and not flags & _ACK:
                    return
                buffer = buffer[9 + length :]
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                raise FloodError("server closed the connection during the handshake")
            buffer += chunk


async def open_one(
    kind: str,
    host: str,
    port: int,
    source: str,
    *,
    name: str = "flood",
    step_timeout: float = 10.0,
) -> socket.socket:
    """One half-open connection of ``kind`` from ``source``; returns its (deaf) socket."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        # Ports of connections closed with a FIN wait in TIME_WAIT; let bind() reuse them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((source, 0))
        async with asyncio.timeout(step_timeout):
            await loop.sock_connect(sock, (host, port))
        if kind == "preface":
            await loop.sock_sendall(sock, PREFACE[: len(PREFACE) // 2])
        elif kind == "settings":
            await loop.sock_sendall(sock, PREFACE + frame(_SETTINGS, 0, 0)[:5])
        elif kind != "silent":
            await loop.sock_sendall(sock, PREFACE + frame(_SETTINGS, 0, 0))
            await _read_server_settings(loop, sock, step_timeout)
            out = frame(_SETTINGS, _ACK, 0)
            if kind in STREAM_KINDS:
                message = grpc_message(node_hello(name))
                if kind == "partial":
                    message = message[: len(message) // 2]
                out += report_headers(f"{host}:{port}") + frame(_DATA, 0, 1, message)
            await loop.sock_sendall(sock, out)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class Flood:
    """Half-open connections held open; :meth:`close` ends them (FIN, or RST)."""

    host: str
    port: int
    sockets: list[socket.socket] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sockets)

    async def open(
        self,
        kind: str,
        count: int,
        addresses: Sequence[str],
        *,
        concurrency: int = 128,
        step_timeout: float = 10.0,
    ) -> None:
        """Open ``count`` connections of ``kind``, round-robin over ``addresses``.

        A connection that fails is recorded in :attr:`failures` (the caller decides whether
        that is an error: a server that refuses a flood is doing its job).
        """
        gate = asyncio.Semaphore(concurrency)
        source = itertools.cycle(addresses)

        async def one(index: int, address: str) -> None:
            async with gate:
                try:
                    self.sockets.append(
                        await open_one(
                            kind,
                            self.host,
                            self.port,
                            address,
                            name=f"flood-{kind}-{index}",
                            step_timeout=step_timeout,
                        )
                    )
                except (OSError, FloodError, TimeoutError) as error:
                    self.failures.append(f"{kind} from {address}: {error!r}")

        await asyncio.gather(*(one(i, next(source)) for i in range(count)))

    def close(self, *, reset: bool = False) -> None:
        """Close every connection: with a FIN, or (``reset``) an RST via SO_LINGER 0."""
        linger = struct.pack("ii", 1, 0)
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                sock.close()
        self.sockets.clear()


def peer_closed(sock: socket.socket) -> bool:
    """Whether the server ended this connection (FIN or RST), read from the kernel's TCP
    state (``tcpi_state``, linux/tcp.h) so that nothing the server sent is consumed."""
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return True
    return state != _TCP_ESTABLISHED


_TCP_ESTABLISHED = 1


def count_closed(sockets: Sequence[socket.socket]) -> int:
    return sum(1 for sock in sockets if peer_closed(sock))
