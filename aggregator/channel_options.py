"""The gRPC core options of the aggregator's server: a port of its own, message limits, pings,
and the deadlines that end connections which stopped making progress (docs/benchmarks.md,
"Connection flood")."""

from __future__ import annotations

from dataclasses import dataclass

#: Largest message the aggregator sends (a ListPods answer for a big fleet).
MAX_SEND_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class GrpcServerSettings:
    """The connection limits and deadlines of the gRPC port (flags of the same names)."""

    max_message_bytes: int = 64 * 1024
    handshake_timeout: float = 10.0
    keepalive_time: float = 2.0
    keepalive_timeout: float = 1.0
    max_connection_idle: float = 300.0
    max_connections: int = 20_000


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(settings: GrpcServerSettings) -> list[tuple[str, int]]:
    """Channel arguments for ``grpc.aio.server(options=...)``; names from grpc's
    ``include/grpc/impl/channel_arg_names.h``."""
    options = [
        # gRPC sets SO_REUSEPORT by default: a second aggregator started on the same port
        # would bind it as well and take a share of the connections, with no error. Off, the
        # second one fails to start ("address already in use").
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
        # Agents ping every 10 s to notice a dead aggregator; allow it. (Server side, this
        # also lets our own keepalive pings reach connections with no call in flight.)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # A connection must finish TCP, TLS, the HTTP/2 preface and its first SETTINGS within
        # this (default 120 s): silent and half-sent handshakes are closed after it.
        ("grpc.server_handshake_timeout_ms", _ms(settings.handshake_timeout)),
        # Ping a quiet connection, close it when the ping goes unanswered (default: every
        # 2 h): ends connections (and their streams) whose peer is gone or does not read.
        ("grpc.keepalive_time_ms", _ms(settings.keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(settings.keepalive_timeout)),
        # What actually ends a connection whose ping goes unanswered in grpc 1.85 (chttp2's
        # internal GRPC_ARG_PING_TIMEOUT_MS, default 1 min once keepalive is on): the
        # keepalive timeout alone is not applied (measured: tests/aggregator/
        # test_connection_flood.py).
        ("grpc.http2.ping_timeout_ms", _ms(settings.keepalive_timeout)),
        # No bandwidth-delay probing: reports are small, and each probe is one more PING per
        # burst of data on each of thousands of connections (the default window suffices).
        ("grpc.http2.bdp_probe", 0),
        # GOAWAY to a connection without calls (default: never): idle channels left open.
        ("grpc.max_connection_idle_ms", _ms(settings.max_connection_idle)),
    ]
    if settings.max_connections:
        # Connections beyond it are closed as soon as they are accepted.
        options.append(("grpc.max_allowed_incoming_connections", settings.max_connections))
    return options
