"""The aggregator's gRPC server options (``aggregator.channel_options``) follow its settings:
every connection deadline in milliseconds, the connection cap only when there is one, and
invalid values refused by the settings. What the options do to real connections is tested in
tests/aggregator/test_connection_flood.py."""

from __future__ import annotations

from typing import Any

import pytest

from aggregator.channel_options import server_options
from aggregator.flags import AggregatorFlags
from aggregator.wiring import port_settings


def test_deadlines_are_passed_in_milliseconds() -> None:
    options = dict(
        server_options(
            port_settings(
                AggregatorFlags(
                    handshake_timeout=2.5,
                    keepalive_time=30,
                    keepalive_timeout=0.25,
                    max_connection_idle=300,
                    max_connections=7,
                    max_message_bytes=4096,
                )
            ).grpc
        )
    )
    assert options["grpc.server_handshake_timeout_ms"] == 2_500
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.keepalive_timeout_ms"] == 250
    assert options["grpc.http2.ping_timeout_ms"] == 250  # what enforces it in grpc 1.85
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_receive_message_length"] == 4096


def test_no_connection_cap_when_zero() -> None:
    options = dict(server_options(port_settings(AggregatorFlags(max_connections=0)).grpc))
    assert "grpc.max_allowed_incoming_connections" not in options


def test_every_option_is_set_once() -> None:
    names = [name for name, _ in server_options(port_settings(AggregatorFlags()).grpc)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        pytest.param("handshake_timeout", 0.0, "--handshake-timeout", id="handshake-zero"),
        pytest.param("keepalive_time", 0.0, "--keepalive-time", id="keepalive-zero"),
        pytest.param("keepalive_timeout", -1.0, "--keepalive-timeout", id="timeout-negative"),
        pytest.param("max_connection_idle", 0.0, "--max-connection-idle", id="idle-zero"),
        pytest.param("max_connections", -1, "--max-connections", id="cap-negative"),
    ],
)
def test_invalid_connection_settings_are_refused(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AggregatorFlags(**{field: value})


def test_the_port_is_not_shared_with_another_process() -> None:
    # gRPC sets SO_REUSEPORT by default: a second aggregator on the same port would bind it
    # too and take half the connections (tests/aggregator/test_startup_errors.py).
    options = dict(server_options(port_settings(AggregatorFlags()).grpc))
    assert options["grpc.so_reuseport"] == 0
