"""Agent authentication end to end: a real aggregator (``--auth tokenreview``, gRPC on
127.0.0.1) checks the tokens of real Report streams with the emulator's TokenReview API, over
real HTTP through the official client.

- Who may report: a sidecar's token only for its own pod, a DaemonSet agent's (an allowed
  ServiceAccount) only for the pods on its node; everything else UNAUTHENTICATED (no, expired,
  foreign-audience token) or PERMISSION_DENIED (another pod, another node, not allowed).
- The TokenReview cache (one API call per token), an API failure (UNAVAILABLE, then retried),
  metrics, one log line per client, a stream ended when its token expires.
- The real agent: its token file is read at every connection, so a rotated token is sent on
  the next one.
- Inspection behind the same check (``--inspection-auth tokenreview``); grpc.health.v1 stays open.
- ``--auth none`` warns at start; ``--auth tokenreview`` without a Kubernetes configuration
  does not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.server import Aggregator
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, make_session
from servehealth_common.states import ServeState
from servehealth_common.tokens import TOKEN_EXPIRED
from tests.conftest import StartAggregator, eventually, running
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import TOKENREVIEWS, KubeEmulator
from testsupport.messages import SidecarCall, batch, hello, node_hello, read_until_error, report

SERVING = pb.SERVE_STATE_SERVING
NODE_AGENT_SA = ("ops", "ray-serve-health-agent")
AGENT_LABELS = {"app.kubernetes.io/name": "ray-serve-health"}  # not a Ray pod: not discovered
#: How long a hung TokenReview takes to answer: longer than any Report call here may last.
HUNG_REVIEW = 30.0


@pytest.fixture
def kube(kube_emulator: KubeEmulator) -> KubeEmulator:
    """Ray pods p1 (node n1) and p2 (node n2) in namespace ray, and a DaemonSet agent's pod on
    each node in namespace ops."""
    kube_emulator.add_pod("ray", "p1", node_name="n1")
    kube_emulator.add_pod("ray", "p2", node_name="n2")
    kube_emulator.add_pod("ops", "agent-n1", node_name="n1", labels=AGENT_LABELS)
    kube_emulator.add_pod("ops", "agent-n2", node_name="n2", labels=AGENT_LABELS)
    return kube_emulator


@pytest.fixture
def start_auth(kube: KubeEmulator, start_kube: StartAggregator) -> StartAggregator:
    """An aggregator on the emulator that checks tokens (the DaemonSet ServiceAccount is
    ops/ray-serve-health-agent)."""

    async def start(**overrides: Any) -> Aggregator:
        settings = {
            "auth": "tokenreview",
            "auth_node_agent_service_account": ("/".join(NODE_AGENT_SA),),
            **overrides,
        }
        return await start_kube(**settings)

    return start


@pytest.fixture
async def channel(start_auth: StartAggregator) -> AsyncIterator[grpc.aio.Channel]:
    aggregator = await start_auth()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        channel.aggregator = aggregator  # type: ignore[attr-defined]
        channel.aggregator = aggregator  # type: ignore[attr-defined]
        yield channel


def uid(kube: KubeEmulator, namespace: str, name: str) -> str:
    pod = kube.pod(namespace, name)
    assert pod is not None
    return pod["metadata"]["uid"]


def sidecar_token(kube: KubeEmulator, name: str = "p1", **options: Any) -> str:
    return kube.issue_token("ray", "default", pod=name, **options)


def node_token(kube: KubeEmulator, node: str = "n1") -> str:
    return kube.issue_token(*NODE_AGENT_SA, pod=f"agent-{node}")


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


async def connect(
    channel: grpc.aio.Channel, message: pb.AgentMessage, token: str | None
) -> SidecarCall:
    """A Report stream that said ``message`` with ``token``; raises the refusal, if any. Its
    ``read`` passes over the PodViews a sidecar is sent
    (:class:`~testsupport.messages.SidecarCall`)."""
    call = pb_grpc.ReportServiceStub(channel).Report(metadata=bearer(token))
    await call.write(message)
    first = await asyncio.wait_for(call.read(), 10)
    assert first.WhichOneof("kind") == "settings"
    return SidecarCall(call)


async def refusal(
    channel: grpc.aio.Channel, message: pb.AgentMessage, token: str | None
) -> grpc.RpcError:
    """The status a Report stream that says ``message`` with ``token`` is refused with.

    Asked with grpc's synchronous client, in a thread: the asyncio client may replace a status
    that arrives while its write of the hello is in flight (the aggregator checks the token
    before it reads the hello) with INTERNAL "Internal error from Core" (grpc/grpc#36066, seen
    here under load).
    """
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]

    answered = threading.Event()

    def hello_then_wait() -> Iterator[pb.AgentMessage]:
        yield message
        answered.wait(30)  # no half-close before the aggregator answered

    def ask() -> grpc.RpcError:
        with grpc.insecure_channel(f"127.0.0.1:{aggregator.port}") as sync_channel:
            stub = pb_grpc.ReportServiceStub(sync_channel)
            responses = stub.Report(hello_then_wait(), metadata=bearer(token), timeout=20)
            try:
                first = next(responses)
            except grpc.RpcError as error:
                return error
            finally:
                answered.set()
            raise AssertionError(f"not refused: {first}")

    return await asyncio.to_thread(ask)


def sidecar_hello(kube: KubeEmulator, name: str = "p1") -> pb.AgentMessage:
    return hello("ray", name, uid(kube, "ray", name), node_name="n1")


def metric(aggregator: Aggregator, name: str, **labels: str) -> float:
    return aggregator.metrics.registry.get_sample_value(f"serve_health_{name}_total", labels) or 0


def reviews(kube: KubeEmulator) -> list[str]:
    """The tokens of the TokenReviews the emulator answered, in order."""
    return [call.body["spec"]["token"] for call in kube.requests(resource=TOKENREVIEWS)]


# -- who may report -----------------------------------------------------------------------


async def test_a_sidecar_with_its_own_pods_token_reports(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    call = await connect(channel, sidecar_hello(kube), sidecar_token(kube))
    await call.write(report(SERVING, 1, "success"))
    assert (await call.read()).ack.sequence == 1
    await eventually(lambda: kube.pod_labels("ray", "p1").get("ray.io/serve") == "true")
    assert metric(aggregator, "auth", service="report", result="ok") == 1
    call.cancel()


@pytest.mark.parametrize(
    ("token", "message"),
    [
        pytest.param(None, "no token", id="no-token"),
        pytest.param("not-a-jwt", "not a Kubernetes ServiceAccount token", id="garbled"),
        pytest.param("expired", "the token has expired", id="expired"),
        pytest.param("vault", "not meant for the audience", id="wrong-audience"),
        pytest.param("unknown", "token lookup failed", id="forged"),
    ],
)
async def test_bad_tokens_are_unauthenticated(
    channel: grpc.aio.Channel, kube: KubeEmulator, token: str | None, message: str
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    tokens = {
        "expired": sidecar_token(kube, expires_in=-10),
        "vault": sidecar_token(kube, audiences=["vault"]),
        # A well-formed token with a future exp that the emulator never issued.
        "unknown": sidecar_token(kube).rsplit(".", 1)[0] + ".Zm9yZ2Vk",
    }
    error = await refusal(channel, sidecar_hello(kube), tokens.get(token or "", token))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    assert message in (error.details() or "")
    assert metric(aggregator, "auth", service="report", result="unauthenticated") == 1
    assert aggregator.core.pod(PodKey("ray", "p1")).agent is None  # type: ignore[union-attr]


async def test_a_sidecar_may_not_report_for_another_pod(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    error = await refusal(channel, sidecar_hello(kube, "p2"), sidecar_token(kube, "p1"))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == (
        "the token of pod ray/p1 may not report for ray/p2: a sidecar reports only for its own pod"
    )
    assert metric(aggregator, "auth", service="report", result="permission_denied") == 1


async def test_a_daemonset_agent_reports_only_for_pods_on_its_node(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    call = await connect(channel, node_hello("n1"), node_token(kube, "n1"))
    await call.write(batch([("ray", "p1", SERVING)], 1, "success"))
    assert (await call.read()).ack.sequence == 1
    await eventually(lambda: kube.pod_labels("ray", "p1").get("ray.io/serve") == "true")
    await call.write(batch([("ray", "p2", SERVING)], 2, "success"))
    error = await read_until_error(call)
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == (
        "a DaemonSet agent on node n1 may not report for pod ray/p2, which runs on node n2"
    )
    assert aggregator.core.pod(PodKey("ray", "p2")).state is ServeState.UNKNOWN  # type: ignore[union-attr]
    assert kube.pod_labels("ray", "p2").get("ray.io/serve") is None


@pytest.mark.parametrize(
    ("node", "token_of", "message"),
    [
        pytest.param("n1", "sidecar", "may not report as a DaemonSet agent", id="not-allowed"),
        pytest.param("n2", "node-agent-n1", "is not the node of the token's pod", id="other-node"),
    ],
)
async def test_daemonset_hellos_that_the_token_does_not_back(
    channel: grpc.aio.Channel, kube: KubeEmulator, node: str, token_of: str, message: str
) -> None:
    token = sidecar_token(kube) if token_of == "sidecar" else node_token(kube, "n1")
    error = await refusal(channel, node_hello(node), token)
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert message in (error.details() or "")


async def test_daemonset_agents_need_the_kubernetes_backend(
    start_aggregator: StartAggregator, kube: KubeEmulator, kubeconfig_path: pathlib.Path
) -> None:
    """The memory backend takes a sidecar's pod from its (checked) hello, but knows no pod's
    node: a DaemonSet agent's reports could not be checked, so none is taken."""
    aggregator = await start_aggregator(
        auth="tokenreview",
        kubeconfig=str(kubeconfig_path),
        auth_node_agent_service_account=("/".join(NODE_AGENT_SA),),
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        channel.aggregator = aggregator  # type: ignore[attr-defined]
        call = await connect(channel, sidecar_hello(kube), sidecar_token(kube))
        call.cancel()
        error = await refusal(channel, node_hello("n1"), node_token(kube))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "--kube-backend kubernetes" in (error.details() or "")


# -- the TokenReview API --------------------------------------------------------------------


async def test_one_token_review_serves_every_stream_of_that_token(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    token = sidecar_token(kube)
    first = await connect(channel, sidecar_hello(kube), token)
    first.cancel()
    second = await connect(channel, sidecar_hello(kube), token)
    second.cancel()
    assert reviews(kube) == [token]
    assert metric(aggregator, "token_cache", result="hit") == 1
    assert metric(aggregator, "token_reviews", result="authenticated") == 1
    # A refusal is remembered too (for a few seconds): a flood of one bad token, one review.
    bad = sidecar_token(kube).rsplit(".", 1)[0] + ".Zm9yZ2Vk"  # a forged signature
    for _ in range(3):
        await refusal(channel, sidecar_hello(kube), bad)
    assert reviews(kube) == [token, bad]
    # A token for another audience is refused without asking the API at all.
    for _ in range(3):
        await refusal(channel, sidecar_hello(kube), sidecar_token(kube, audiences=["vault"]))
    assert reviews(kube) == [token, bad]


async def test_api_trouble_is_unavailable_and_the_agent_may_retry(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    token = sidecar_token(kube)
    kube.fail_next(1, status=500, resource=TOKENREVIEWS)
    error = await refusal(channel, sidecar_hello(kube), token)
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "HTTP 500" in (error.details() or "")
    assert token not in (error.details() or "")
    assert metric(aggregator, "auth", service="report", result="unavailable") == 1
    assert metric(aggregator, "token_reviews", result="error") == 1
    call = await connect(channel, sidecar_hello(kube), token)  # not cached: asked again
    call.cancel()
    assert reviews(kube) == [token, token]


async def test_a_stream_ends_when_its_token_expires(
    channel: grpc.aio.Channel, kube: KubeEmulator
) -> None:
    aggregator: Aggregator = channel.aggregator  # type: ignore[attr-defined]
    call = await connect(channel, sidecar_hello(kube), sidecar_token(kube, expires_in=2))
    error = await asyncio.wait_for(read_until_error(call), 5)
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == TOKEN_EXPIRED
    assert metric(aggregator, "auth", service="report", result="expired") == 1
    assert metric(aggregator, "auth", service="report", result="unauthenticated") == 0
    await eventually(lambda: aggregator.core.agents_connected == 0)


async def test_refusals_are_logged_once_per_client_address(
    channel: grpc.aio.Channel, kube: KubeEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aggregator.guard")
    for _ in range(3):
        await refusal(channel, sidecar_hello(kube), None)
    await refusal(channel, sidecar_hello(kube, "p2"), sidecar_token(kube))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "UNAUTHENTICATED: no token" in warnings[0]
    assert "PERMISSION_DENIED" in warnings[1]
    assert all("127.0.0.1" in warning for warning in warnings)
    assert sum(1 for r in caplog.records if r.levelno == logging.DEBUG and "refusing" in r.msg) == 2


# -- the real agent -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_agent(
    aggregator: Aggregator, kube: KubeEmulator, proxy: FakeServeProxy, token_file: pathlib.Path
) -> AsyncIterator[Agent]:
    settings = AgentFlags(
        aggregator=f"127.0.0.1:{aggregator.port}",
        proxy_url=proxy.url,
        token_file=str(token_file),
        reconnect_max=0.5,
    )
    identity = SidecarPod("ray", "p1", uid(kube, "ray", "p1"), "n1")
    async with make_session() as session:
        agent = Agent(settings, identity, Prober(session, settings.probe_timeout))
        async with running(agent):
            yield agent


async def test_the_agent_sends_its_rotated_token_on_the_next_stream(
    start_auth: StartAggregator,
    kube: KubeEmulator,
    fake_proxy: FakeServeProxy,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The kubelet rewrites the token file before the token expires; the aggregator ends the
    stream when the old token expires, and the agent reconnects at once with the new one."""
    caplog.set_level(logging.INFO, logger="node_agent")
    aggregator = await start_auth()
    token_file = tmp_path / "token"
    old = sidecar_token(kube, expires_in=2)
    token_file.write_text(old)
    async with running_agent(aggregator, kube, fake_proxy, token_file) as agent:
        await asyncio.wait_for(agent.stream.connected.wait(), 5)
        assert reviews(kube) == [old]
        new = sidecar_token(kube)
        token_file.write_text(new + "\n")  # as the kubelet does: a whole new file
        await kube.wait_until(lambda: reviews(kube) == [old, new], within=6)
        await asyncio.wait_for(agent.stream.connected.wait(), 5)
        await eventually(lambda: kube.pod_labels("ray", "p1").get("ray.io/serve") == "true")
    messages = [record.getMessage() for record in caplog.records]
    assert "the stream's token expired; reconnecting with the current one" in messages
    assert any("sending the ServiceAccount token over a plaintext" in m for m in messages)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_refused_agent_says_so_once_and_keeps_trying(
    start_auth: StartAggregator,
    kube: KubeEmulator,
    fake_proxy: FakeServeProxy,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="node_agent")
    aggregator = await start_auth()
    token_file = tmp_path / "token"
    token_file.write_text(sidecar_token(kube, "p2"))  # the token of another pod
    async with running_agent(aggregator, kube, fake_proxy, token_file) as agent:
        await kube.wait_until(lambda: len(reviews(kube)) >= 1)
        await eventually(
            lambda: metric(aggregator, "auth", result="permission_denied", service="report") >= 3
        )
        assert not agent.stream.connected.is_set()
        token_file.write_text(sidecar_token(kube, "p1"))  # fixed: the next attempt gets in
        await asyncio.wait_for(agent.stream.connected.wait(), 5)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "refused this agent: PERMISSION_DENIED" in errors[0]


async def test_explicit_token_file_must_exist(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="--token-file: no such file"):
        AgentFlags(aggregator="127.0.0.1:1", token_file=str(tmp_path / "missing"))
    # The default path may be missing (local use): no token is sent then.
    assert AgentFlags(aggregator="127.0.0.1:1").token_file.endswith("ray-serve-health/token")


# -- inspection ----------------------------------------------------------------------------


async def test_inspection_behind_tokens_and_health_open(
    start_auth: StartAggregator, kube: KubeEmulator
) -> None:
    aggregator = await start_auth(auth="none", inspection_auth="tokenreview")
    viewer = kube.issue_token("ops", "viewer")  # kubectl create token viewer --audience ...
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        channel.aggregator = aggregator  # type: ignore[attr-defined]
        inspection = pb_grpc.InspectionServiceStub(channel)
        for token in (None, kube.issue_token("ops", "viewer", audiences=["vault"])):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await inspection.GetSummary(pb.GetSummaryRequest(), metadata=bearer(token))
            assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
        watch = inspection.WatchTransitions(pb.WatchTransitionsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await watch.read()
        assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
        summary = await inspection.GetSummary(pb.GetSummaryRequest(), metadata=bearer(viewer))
        assert summary.pods == 2
        pods = await inspection.ListPods(pb.ListPodsRequest(), metadata=bearer(viewer))
        assert [pod.name for pod in pods.pods] == ["p1", "p2"]
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # --auth none: reports need no token.
        call = pb_grpc.ReportServiceStub(channel).Report()
        await call.write(sidecar_hello(kube))
        assert (await call.read()).WhichOneof("kind") == "settings"
        call.cancel()
    assert metric(aggregator, "auth", service="inspection", result="unauthenticated") == 3
    assert metric(aggregator, "auth", service="inspection", result="ok") == 2


# -- start ---------------------------------------------------------------------------------


async def test_auth_none_warns_at_start(
    start_aggregator: StartAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aggregator")
    await start_aggregator(auth="none")
    assert any(
        record.levelno == logging.WARNING and "--auth none: any client" in record.getMessage()
        for record in caplog.records
    )


def test_tokenreview_without_a_kubernetes_configuration_does_not_start(
    tmp_path: pathlib.Path,
) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST") and not key.startswith("SERVE_")
    }
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    result = subprocess.run(
        [sys.executable, "-m", "aggregator", "--kube-backend", "memory", "--metrics-listen="],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "--auth tokenreview" in result.stderr
    assert "no Kubernetes configuration" in result.stderr
    assert "pass --auth none" in result.stderr


async def test_a_hanging_token_review_is_bounded_and_unavailable(
    start_auth: StartAggregator, kube: KubeEmulator
) -> None:
    """Issue 12, point 5: a TokenReview that never answers costs a stream one
    ``--kube-timeout`` (not the client library's retries of it), then UNAVAILABLE (the agent
    retries), and the review was asked once. The review hangs for HUNG_REVIEW: an aggregator
    that waited for its answer would be past the call's own deadline (20 s, DEADLINE_EXCEEDED)."""
    aggregator = await start_auth(kube_timeout=1.0)
    kube.slow(HUNG_REVIEW, where=kube.select(resource=TOKENREVIEWS))
    token = sidecar_token(kube)
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        channel.aggregator = aggregator  # type: ignore[attr-defined]
        started = loop.time()
        error = await refusal(channel, sidecar_hello(kube), token)
        took = loop.time() - started
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert token not in (error.details() or "")
    print(f"refused {took:.2f}s after the hello (--kube-timeout 1s)")
    assert took < HUNG_REVIEW, f"a hung review held the stream {took:.1f}s (--kube-timeout 1s)"
    assert metric(aggregator, "auth", service="report", result="unavailable") == 1
    assert len(reviews(kube)) == 1
    kube.clear_faults()
