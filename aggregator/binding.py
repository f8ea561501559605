"""Binding the aggregator's two ports, with one clear error when one cannot be bound.

gRPC's own failure says only "Failed to bind to address" (and writes a log line of its own), so
the socket layer is asked first; an ``OSError("cannot listen on ADDRESS (FLAG): why")`` names
the address, its flag and the reason (address already in use, cannot resolve 'x', ...). The
/metrics port's start and the message are shared with the agent
(:mod:`servehealth_common.listening`).
"""

from __future__ import annotations

import asyncio
import socket

import grpc

from servehealth_common.config import split_host_port
from servehealth_common.listening import cannot_listen, describe_error, host_port, start_metrics
from servehealth_common.tls import ReloadingServerCertificate, server_credentials

__all__ = ["add_grpc_port", "host_port", "start_metrics"]


async def add_grpc_port(
    server: grpc.aio.Server, listen: str, tls_cert: str, tls_key: str, tls_client_ca: str
) -> tuple[int, ReloadingServerCertificate | None]:
    """Bind ``listen`` (``--listen``) on ``server``: the port bound, and with ``tls_cert`` the
    fetcher that reloads rotated certificate files (keep it alive: gRPC's C core calls it at
    each handshake). OSError naming the address and why it cannot be bound."""
    host, port = split_host_port(listen)
    if problem := await _bind_problem(host, port):
        raise cannot_listen(listen, "--listen", problem)
    address = host_port(host, port)
    try:
        if not tls_cert:
            return server.add_insecure_port(address), None
        credentials, fetcher = server_credentials(tls_cert, tls_key, tls_client_ca)
        return server.add_secure_port(address, credentials), fetcher
    except RuntimeError:  # "Failed to bind": taken since, or credentials gRPC refused
        tls = " with the files of --tls-cert and --tls-key" if tls_cert else ""
    raise cannot_listen(listen, "--listen", f"gRPC failed to bind it{tls}")


async def _bind_problem(host: str, port: int) -> str | None:
    """Why no address ``host`` resolves to can be bound at ``port``; None when one can (gRPC
    binds every address it can, and fails only when none)."""
    loop = asyncio.get_running_loop()
    try:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return describe_error(error, host)
    problems: list[str] = []
    for family, kind, protocol, _, address in found:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
            except OSError as error:
                problems.append(describe_error(error, host))
                continue
        return None
    return problems[0] if problems else f"{host!r} resolves to no address"
