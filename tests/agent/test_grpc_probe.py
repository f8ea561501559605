"""gRPC ingress: ``GrpcHealthz`` and the ``Prober`` asking both proxies, over real gRPC.

Every call goes over real HTTP/2 on 127.0.0.1 to a ``FakeGrpcServeProxy`` (a ``grpc.aio``
server answering Ray Serve's ``Healthz`` as the proxy does in each state), to a gRPC server
without that service, or to a port with nothing listening; the combined probes also talk to a
``FakeServeProxy`` over HTTP. HAProxy's own answer (HTTP 200, ``grpc-status`` and no message:
"trailers-only", which a grpc.aio server cannot send) is tested against a real HAProxy process
where one is installed (``scripts/bootstrap.sh`` installs Debian's as root).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from servehealth_common import classify
from servehealth_common.grpc_healthz import GrpcHealthz
from servehealth_common.http import HTTPClient
from servehealth_common.probe import Prober, make_session
from servehealth_common.states import ServeState
from tests.conftest import require_haproxy
from testsupport import fakes
from testsupport.fakes import FakeGrpcServeProxy, FakeServeProxy, refused_port

DEADLINE = 0.5
HANG_DEADLINE = 0.2
#: How late a hung call may return: far more than a loaded machine needs, far less than the
#: hung proxy's forever (how late it does return is a figure).
SLACK = 10.0


@pytest.fixture
async def healthz() -> AsyncIterator[GrpcHealthz]:
    client = GrpcHealthz(DEADLINE)
    yield client
    await client.close()


@pytest.fixture
async def grpc_proxy() -> AsyncIterator[FakeGrpcServeProxy]:
    proxy = await FakeGrpcServeProxy().start()
    yield proxy
    await proxy.stop()


@pytest.mark.parametrize(
    ("answer", "state", "reason"),
    [
        pytest.param(fakes.GRPC_HEALTHY, ServeState.SERVING, "success", id="ok-success"),
        pytest.param(("OK", ""), ServeState.SERVING, "success", id="ok-empty-message"),
        pytest.param(
            ("OK", "hello"), ServeState.UNHEALTHY, "OK with message: hello", id="ok-other"
        ),
        pytest.param(
            fakes.GRPC_NOT_POPULATED,
            ServeState.NOT_READY,
            "Route table is not populated yet.",
            id="not-populated",
        ),
        pytest.param(
            ("UNAVAILABLE", "No replicas are available yet."),
            ServeState.NOT_READY,
            "No replicas are available yet.",
            id="no-replicas",
        ),
        pytest.param(
            fakes.GRPC_DRAINING,
            ServeState.DRAINING,
            "This node is being drained.",
            id="draining",
        ),
        pytest.param(
            fakes.GRPC_HAPROXY_NO_BACKEND,
            ServeState.NOT_READY,
            "Service Unavailable (HAProxy: no backend is up).",
            id="haproxy-no-backend",
        ),
        pytest.param(
            ("UNAVAILABLE", "upstream reset"),
            ServeState.UNHEALTHY,
            "UNAVAILABLE: upstream reset",
            id="unavailable-other",
        ),
        pytest.param(("INTERNAL", "boom"), ServeState.UNHEALTHY, "INTERNAL: boom", id="internal"),
    ],
)
async def test_each_answer_of_the_proxy(
    healthz: GrpcHealthz,
    grpc_proxy: FakeGrpcServeProxy,
    answer: fakes.GrpcAnswer,
    state: ServeState,
    reason: str,
) -> None:
    grpc_proxy.set(answer)
    result = await healthz.check(grpc_proxy.address)
    assert (result.verdict.state, result.verdict.reason) == (state, reason)
    assert not result.timed_out


async def test_an_answer_that_is_not_a_healthz_response_is_unhealthy(
    healthz: GrpcHealthz, grpc_proxy: FakeGrpcServeProxy
) -> None:
    grpc_proxy.raw = b"\xff\xff\xff"
    result = await healthz.check(grpc_proxy.address)
    assert result.verdict.state is ServeState.UNHEALTHY
    assert "not a HealthzResponse" in result.verdict.reason


async def test_an_answer_over_the_size_limit_is_unhealthy(
    healthz: GrpcHealthz, grpc_proxy: FakeGrpcServeProxy
) -> None:
    grpc_proxy.set(("OK", "x" * 10_000))
    result = await healthz.check(grpc_proxy.address)
    assert result.verdict.state is ServeState.UNHEALTHY
    assert result.verdict.reason.startswith("RESOURCE_EXHAUSTED")


async def test_a_grpc_server_without_serve_is_unhealthy(healthz: GrpcHealthz) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        result = await healthz.check(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)
    assert result.verdict.state is ServeState.UNHEALTHY
    assert result.verdict.reason.startswith("UNIMPLEMENTED")


async def test_refused_is_no_proxy(healthz: GrpcHealthz) -> None:
    result = await healthz.check(f"127.0.0.1:{refused_port()}")
    assert result.verdict == classify.connection_refused()
    assert not result.answered


async def test_a_hung_proxy_times_out_within_the_deadline(
    grpc_proxy: FakeGrpcServeProxy,
) -> None:
    client = GrpcHealthz(HANG_DEADLINE)
    grpc_proxy.set(fakes.GRPC_HEALTHY, hang=True)
    started = time.monotonic()
    try:
        result = await client.check(grpc_proxy.address)
    finally:
        await client.close()
    assert time.monotonic() - started < HANG_DEADLINE + SLACK
    assert result.verdict == classify.timed_out(HANG_DEADLINE)
    assert result.timed_out


async def test_a_proxy_back_on_its_port_is_seen_at_the_next_call(healthz: GrpcHealthz) -> None:
    """A refused call drops its channel: the next call connects afresh rather than waiting
    out gRPC's reconnection backoff."""
    proxy = await FakeGrpcServeProxy().start()
    port = proxy.port
    assert (await healthz.check(proxy.address)).verdict.state is ServeState.SERVING
    await proxy.stop()
    # A call on the old connection may still meet the server's GOAWAY ("Stream removed": a
    # transport error, UNHEALTHY); that drops the channel too, and the next call is refused.
    states = [(await healthz.check(f"127.0.0.1:{port}")).verdict.state for _ in range(2)]
    assert states[-1] is ServeState.NO_PROXY
    assert states[0] in (ServeState.NO_PROXY, ServeState.UNHEALTHY)
    back = await FakeGrpcServeProxy(port=port).start()
    try:
        result = await healthz.check(back.address)
    finally:
        await back.stop()
    assert result.verdict.state is ServeState.SERVING


async def test_a_cancelled_call_lets_its_channel_go(
    healthz: GrpcHealthz, grpc_proxy: FakeGrpcServeProxy
) -> None:
    grpc_proxy.set(fakes.GRPC_HEALTHY, hang=True)
    task = asyncio.ensure_future(healthz.check(grpc_proxy.address))
    await asyncio.wait_for(grpc_proxy.called(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    grpc_proxy.set(fakes.GRPC_HEALTHY)
    assert (await healthz.check(grpc_proxy.address)).verdict.state is ServeState.SERVING


# -- both proxies, one probe -------------------------------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@pytest.fixture
async def http_proxy() -> AsyncIterator[FakeServeProxy]:
    proxy = await FakeServeProxy().start()
    yield proxy
    await proxy.stop()


@pytest.fixture
def prober(session: HTTPClient, healthz: GrpcHealthz) -> Prober:
    return Prober(session, DEADLINE, grpc=healthz)


@pytest.mark.parametrize(
    ("http", "grpc_answer", "state", "reason"),
    [
        pytest.param(fakes.HEALTHY, fakes.GRPC_HEALTHY, ServeState.SERVING, "success", id="both"),
        pytest.param(
            fakes.HEALTHY,
            fakes.GRPC_DRAINING,
            ServeState.DRAINING,
            "gRPC proxy {grpc}: This node is being drained.",
            id="grpc-draining",
        ),
        pytest.param(
            fakes.NOT_POPULATED,
            fakes.GRPC_HEALTHY,
            ServeState.NOT_READY,
            "HTTP proxy: Route table is not populated yet.",
            id="http-not-ready",
        ),
        pytest.param(
            fakes.DRAINING,
            fakes.GRPC_NOT_POPULATED,
            ServeState.DRAINING,
            "HTTP proxy: This node is being drained. | "
            "gRPC proxy {grpc}: Route table is not populated yet.",
            id="both-failing-worse-wins",
        ),
        pytest.param(
            fakes.NOT_POPULATED,
            ("INTERNAL", "boom"),
            ServeState.UNHEALTHY,
            "HTTP proxy: Route table is not populated yet. | gRPC proxy {grpc}: INTERNAL: boom",
            id="grpc-unhealthy-is-worse",
        ),
    ],
)
async def test_the_pod_is_serving_only_when_both_proxies_are(
    prober: Prober,
    http_proxy: FakeServeProxy,
    grpc_proxy: FakeGrpcServeProxy,
    http: tuple[int, str],
    grpc_answer: fakes.GrpcAnswer,
    state: ServeState,
    reason: str,
) -> None:
    http_proxy.set(http)
    grpc_proxy.set(grpc_answer)
    result = await prober.probe(http_proxy.url, grpc_proxy.address)
    assert (result.state, result.reason) == (state, reason.format(grpc=grpc_proxy.address))
    assert result.http_status == http[0]


async def test_no_grpc_proxy_listening_is_never_serving(
    prober: Prober, http_proxy: FakeServeProxy
) -> None:
    address = f"127.0.0.1:{refused_port()}"
    result = await prober.probe_confirmed(http_proxy.url, None, 0.01, address)
    assert result.state is ServeState.NO_PROXY
    assert (
        result.reason == f"gRPC proxy {address}: Connection refused: no Serve proxy is listening."
    )


async def test_a_hung_grpc_proxy_is_a_confirmed_hang_within_one_timeout(
    session: HTTPClient, http_proxy: FakeServeProxy, grpc_proxy: FakeGrpcServeProxy
) -> None:
    """The hedged confirmation works on the gRPC half too: two unanswered calls confirm the
    hang when the first one's deadline passes."""
    client = GrpcHealthz(HANG_DEADLINE)
    prober = Prober(session, HANG_DEADLINE, grpc=client)
    grpc_proxy.set(fakes.GRPC_HEALTHY, hang=True)
    started = time.monotonic()
    try:
        result = await prober.probe_confirmed(
            http_proxy.url, ServeState.SERVING, 0.05, grpc_proxy.address
        )
    finally:
        await client.close()
    assert result.state is ServeState.UNHEALTHY
    assert "No answer within 200 ms" in result.reason
    # Within one timeout is what the hedge is for, but a loaded machine may see the first
    # timeout late, and then the hedge's own answer is awaited (tests/agent/test_probe.py
    # tells the two apart with a recording clock): here, only a hang fails.
    assert time.monotonic() - started < 2 * HANG_DEADLINE + SLACK


async def test_a_prober_without_grpc_refuses_a_grpc_address(
    session: HTTPClient, http_proxy: FakeServeProxy
) -> None:
    with pytest.raises(RuntimeError, match="without a GrpcHealthz"):
        await Prober(session, DEADLINE).probe(http_proxy.url, "127.0.0.1:9000")


# -- HAProxy's trailers-only answers -------------------------------------------------------

HAPROXY_CONFIG = """\
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend healthy
    bind 127.0.0.1:{healthy} proto h2
    http-request return status 200 content-type application/grpc hdr grpc-status 0 \
if {{ path /ray.serve.RayServeAPIService/Healthz }}
frontend no_backend
    bind 127.0.0.1:{no_backend} proto h2
    http-request return status 200 content-type application/grpc hdr grpc-status 14 \
hdr grpc-message "Service Unavailable" if {{ path /ray.serve.RayServeAPIService/Healthz }}
frontend draining
    bind 127.0.0.1:{draining} proto h2
    http-request return status 200 content-type application/grpc hdr grpc-status 14 \
hdr grpc-message "This node is being drained." if {{ path /ray.serve.RayServeAPIService/Healthz }}
"""


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A real HAProxy answering ``Healthz`` as the rules of Ray's HAProxy mode do
    (``HAPROXY_GRPC_HEALTHZ_RULES_TEMPLATE``): healthy, no backend up, draining."""
    binary = require_haproxy()
    ports = {name: fakes.free_port() for name in ("healthy", "no_backend", "draining")}
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(**ports))
    process = subprocess.Popen(
        [binary, "-f", str(config), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield ports
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize(
    ("frontend", "state", "reason"),
    [
        ("healthy", ServeState.SERVING, "success"),
        ("no_backend", ServeState.NOT_READY, "Service Unavailable (HAProxy: no backend is up)."),
        ("draining", ServeState.DRAINING, "This node is being drained."),
    ],
)
async def test_haproxy_trailers_only_answers(
    healthz: GrpcHealthz, haproxy: dict[str, int], frontend: str, state: ServeState, reason: str
) -> None:
    address = f"127.0.0.1:{haproxy[frontend]}"
    deadline = time.monotonic() + 10
    while True:  # until HAProxy listens
        result = await healthz.check(address)
        if result.verdict.state is not ServeState.NO_PROXY or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert (result.verdict.state, result.verdict.reason) == (state, reason)
