"""Listening on a port, with one clear error when it cannot be bound: both programs' ``--metrics-
listen`` (and the aggregator's ``--listen``, :mod:`aggregator.binding`).

:class:`CannotListen` (an OSError) says ``cannot listen on ADDRESS (FLAG): why``: the address,
the flag that asked for it and the reason (address already in use, cannot resolve 'x', ...),
rather than asyncio's ``[Errno 98] error while attempting to bind on address (...)``.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # prometheus_client: the agent loads it only with --metrics-listen
    from servehealth_common.metrics_http import MetricsServer


class CannotListen(OSError):
    """A port a flag asked for cannot be bound; the message names the address and the flag."""


def host_port(host: str, port: int) -> str:
    """``127.0.0.1:50051``, ``[::1]:50051``: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cannot_listen(address: str, flag: str, reason: str) -> CannotListen:
    return CannotListen(f"cannot listen on {address} ({flag}): {reason}")


def describe_error(error: OSError, host: str) -> str:
    """Why ``error`` happened, readable: address already in use, cannot resolve 'x' (...)."""
    if isinstance(error, socket.gaierror):
        return f"cannot resolve {host!r} ({error.strerror})"
    if error.errno:
        return os.strerror(error.errno).lower()
    return str(error)


async def start_metrics(metrics_server: MetricsServer, flag: str = "--metrics-listen") -> None:
    """Start the /metrics server that ``flag`` asked for; :class:`CannotListen` naming the
    address, the flag and why it cannot be bound."""
    try:
        await metrics_server.start()
    except OSError as error:
        host, port = metrics_server.settings.host, metrics_server.settings.port
        raise cannot_listen(host_port(host, port), flag, describe_error(error, host)) from None
