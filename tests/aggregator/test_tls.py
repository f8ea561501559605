"""TLS and mutual TLS on the aggregator's gRPC port, with certificates made here by trustme: a
real agent reports over TLS, plaintext and certificate-less clients are refused, a client
certificate from the client CA is accepted, rotated server files are served without a restart,
and missing files are start-up errors that name their flag."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.flags import AggregatorFlags
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, make_session
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.fakes import FakeServeProxy
from testsupport.messages import open_stream, report


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def client_ca() -> trustme.CA:
    return trustme.CA()


def write_cert(directory: Path, name: str, cert: trustme.LeafCert) -> tuple[str, str]:
    """Write ``cert``'s chain and key as ``name.pem`` and ``name.key``; return their paths."""
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_path.write_bytes(cert.private_key_pem.bytes())
    return str(cert_path), str(key_path)


@pytest.fixture
def server_files(tmp_path: Path, ca: trustme.CA) -> tuple[str, str, str]:
    """(cert, key, CA) files of a server certificate for 127.0.0.1 and localhost."""
    cert, key = write_cert(tmp_path, "server", ca.issue_cert("127.0.0.1", "localhost"))
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    return cert, key, str(ca_path)


def credentials(ca: trustme.CA, client: trustme.LeafCert | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert_pem.bytes(),
        private_key=client.private_key_pem.bytes() if client else None,
        certificate_chain=b"".join(b.bytes() for b in client.cert_chain_pems) if client else None,
    )


async def health_check(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def test_real_agent_reports_over_tls(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    server_files: tuple[str, str, str],
) -> None:
    cert, key, ca_path = server_files
    aggregator = await start_aggregator(tls_cert=cert, tls_key=key)
    settings = AgentFlags(
        aggregator=f"127.0.0.1:{aggregator.port}",
        proxy_url=fake_proxy.url,
        tls_ca=ca_path,
        reconnect_max=0.5,
    )
    key_ = PodKey("default", "pod-a")
    async with make_session() as session:
        agent = Agent(
            settings,
            SidecarPod("default", "pod-a", "uid-a", "node-1"),
            Prober(session, settings.probe_timeout),
        )
        task = asyncio.create_task(agent.run())
        try:
            record = await eventually(
                lambda: (r := aggregator.core.pod(key_)) and r.state is ServeState.SERVING and r
            )
            assert record.agent is not None
            assert aggregator.core.agents_connected == 1
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_plaintext_client_is_refused(
    start_aggregator: StartAggregator, server_files: tuple[str, str, str], ca: trustme.CA
) -> None:
    cert, key, _ = server_files
    aggregator = await start_aggregator(tls_cert=cert, tls_key=key)
    target = f"127.0.0.1:{aggregator.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await health_check(channel)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    # The same server answers a TLS client.
    async with grpc.aio.secure_channel(target, credentials(ca)) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
    # A client that trusts another CA refuses the server.
    async with grpc.aio.secure_channel(target, credentials(trustme.CA())) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await health_check(channel)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(
    start_aggregator: StartAggregator,
    server_files: tuple[str, str, str],
    ca: trustme.CA,
    client_ca: trustme.CA,
    tmp_path: Path,
) -> None:
    cert, key, _ = server_files
    client_ca_path = tmp_path / "client-ca.pem"
    client_ca.cert_pem.write_to_path(str(client_ca_path))
    aggregator = await start_aggregator(
        tls_cert=cert, tls_key=key, tls_client_ca=str(client_ca_path)
    )
    target = f"127.0.0.1:{aggregator.port}"

    async with grpc.aio.secure_channel(target, credentials(ca)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await health_check(channel)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE

    stranger = trustme.CA().issue_cert("agent.example")
    async with grpc.aio.secure_channel(target, credentials(ca, stranger)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await health_check(channel)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE

    agent_cert = client_ca.issue_cert("agent.example")
    async with grpc.aio.secure_channel(target, credentials(ca, agent_cert)) as channel:
        call = await open_stream(channel)
        await call.write(report(pb.SERVE_STATE_SERVING, 1, "success", http_status=200))
        assert (await call.read()).ack.sequence == 1
        call.cancel()
    record = aggregator.core.pod(PodKey("default", "pod-a"))
    assert record is not None
    assert record.state is ServeState.SERVING


async def test_real_agent_with_a_client_certificate(
    start_aggregator: StartAggregator,
    fake_proxy: FakeServeProxy,
    server_files: tuple[str, str, str],
    client_ca: trustme.CA,
    tmp_path: Path,
) -> None:
    cert, key, ca_path = server_files
    client_ca_path = tmp_path / "client-ca.pem"
    client_ca.cert_pem.write_to_path(str(client_ca_path))
    client_cert, client_key = write_cert(tmp_path, "agent", client_ca.issue_cert("agent.example"))
    aggregator = await start_aggregator(
        tls_cert=cert, tls_key=key, tls_client_ca=str(client_ca_path)
    )
    settings = AgentFlags(
        aggregator=f"127.0.0.1:{aggregator.port}",
        proxy_url=fake_proxy.url,
        tls_ca=ca_path,
        tls_cert=client_cert,
        tls_key=client_key,
        reconnect_max=0.5,
    )
    pod = PodKey("default", "pod-a")
    async with make_session() as session:
        agent = Agent(
            settings,
            SidecarPod("default", "pod-a", "uid-a", "node-1"),
            Prober(session, settings.probe_timeout),
        )
        task = asyncio.create_task(agent.run())
        try:
            await eventually(
                lambda: (r := aggregator.core.pod(pod)) and r.state is ServeState.SERVING
            )
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def served_certificate(port: int, ca_path: str) -> bytes:
    """The DER certificate a new TLS connection to 127.0.0.1:``port`` is shown."""
    context = ssl.create_default_context(cafile=ca_path)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(cert: trustme.LeafCert) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.cert_chain_pems[0].bytes().decode())


def first_der(path: str) -> bytes:
    """The DER of the first (leaf) certificate in a PEM chain file."""
    end = "-----END CERTIFICATE-----"
    return ssl.PEM_cert_to_DER_cert(Path(path).read_text().split(end)[0] + end + "\n")


async def test_rotated_server_certificate_is_served_without_restart(
    start_aggregator: StartAggregator,
    server_files: tuple[str, str, str],
    ca: trustme.CA,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cert, key, ca_path = server_files
    aggregator = await start_aggregator(tls_cert=cert, tls_key=key)
    port = aggregator.port
    first = await asyncio.to_thread(served_certificate, port, ca_path)
    assert first == first_der(cert)

    # Rotate as a Secret volume or cert-manager would: new files replace the old ones.
    rotated = ca.issue_cert("127.0.0.1", "localhost")
    staging = tmp_path / "staging"
    staging.mkdir()
    new_cert, new_key = write_cert(staging, "server", rotated)
    later = time.time() + 5  # a different mtime even on coarse-grained filesystems
    for source, target in ((new_cert, cert), (new_key, key)):
        os.utime(source, (later, later))
        os.replace(source, target)

    with caplog.at_level(logging.INFO, logger="servehealth_common.tls"):
        second = await asyncio.to_thread(served_certificate, port, ca_path)
    assert second == der_of(rotated) != first
    reloads = [r for r in caplog.records if "TLS certificate files changed" in r.getMessage()]
    assert len(reloads) == 1
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials(ca)) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING


def spoil(path: str) -> None:
    Path(path).write_bytes(b"not a key")
    later = time.time() + 5
    os.utime(path, (later, later))


async def test_unreadable_rotation_keeps_the_old_certificate(
    start_aggregator: StartAggregator, server_files: tuple[str, str, str], ca: trustme.CA
) -> None:
    cert, key, ca_path = server_files
    aggregator = await start_aggregator(tls_cert=cert, tls_key=key)
    before = await asyncio.to_thread(served_certificate, aggregator.port, ca_path)
    await asyncio.to_thread(spoil, key)  # a half-written rotation
    async with grpc.aio.secure_channel(f"127.0.0.1:{aggregator.port}", credentials(ca)) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await asyncio.to_thread(served_certificate, aggregator.port, ca_path) == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_cert": "CERT"}, "--tls-cert and --tls-key go together"),
        ({"tls_cert": "CERT", "tls_key": "/nonexistent.key"}, "--tls-key: no such file"),
        ({"tls_cert": "/nonexistent.pem", "tls_key": "KEY"}, "--tls-cert: no such file"),
        ({"tls_client_ca": "CERT"}, "--tls-client-ca needs --tls-cert"),
        (
            {"tls_cert": "CERT", "tls_key": "KEY", "tls_client_ca": "/nonexistent-ca.pem"},
            "--tls-client-ca: no such file",
        ),
    ],
)
def test_aggregator_tls_flags_are_checked_at_start(
    server_files: tuple[str, str, str], overrides: dict[str, str], message: str
) -> None:
    cert, key, _ = server_files
    values = {
        name: {"CERT": cert, "KEY": key}.get(value, value) for name, value in overrides.items()
    }
    with pytest.raises(ValueError, match=message):
        AggregatorFlags(**values)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_ca": "/nonexistent-ca.pem"}, "--tls-ca: no such file"),
        ({"tls_ca": "CA", "tls_cert": "CERT"}, "--tls-cert and --tls-key go together"),
        ({"tls_cert": "CERT", "tls_key": "KEY"}, "need --tls-ca"),
    ],
)
def test_agent_tls_flags_are_checked_at_start(
    server_files: tuple[str, str, str], overrides: dict[str, str], message: str
) -> None:
    cert, key, ca_path = server_files
    values = {
        name: {"CERT": cert, "KEY": key, "CA": ca_path}.get(value, value)
        for name, value in overrides.items()
    }
    with pytest.raises(ValueError, match=message):
        AgentFlags(aggregator="127.0.0.1:1", **values)


def test_unreadable_file_names_its_flag(server_files: tuple[str, str, str]) -> None:
    cert, _, _ = server_files
    # A file that exists but cannot be read, even by root (the suite runs as root in CI, where
    # a chmod 0 file is still readable): reading /proc/self/mem at offset 0 fails with EIO.
    with pytest.raises(ValueError, match="--tls-key: cannot read"):
        AggregatorFlags(tls_cert=cert, tls_key="/proc/self/mem")
