"""End to end with real Ray Serve (``proxy_location: HeadOnly``): a worker pod with no proxy by
design (issue 15).

The session's Ray has its node on 127.0.0.1 and its dashboard on ``ray_dashboard_port``, with
Ray's token authentication on (Ray 2.60's default for a local cluster): the aggregator reads
the token where Ray wrote it (``~/.ray/auth_token``, :func:`ray_token_file`). The pods are
emulated (the API emulator of tests/kube): a head at 127.0.0.1 whose container port
``dashboard`` is Ray's, and a worker at 127.0.0.2 (nothing listens there). The worker's agent
is a fake stream that reports what a real one would: connection refused, NO_PROXY.

What Ray decides is real: the aggregator asks Ray's own dashboard where Serve runs proxies,
and the worker becomes NO_PROXY_BY_DESIGN: label ``false``, one Event, none later, no PANIC.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from tests.kube import conftest as kube_fixtures
from testsupport import harness
from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator
from testsupport.messages import open_stream, report

# The API emulator's fixtures (tests/kube/conftest.py), for this module.
kube_emulator = kube_fixtures.kube_emulator
kubeconfig_path = kube_fixtures.kubeconfig_path
start_kube = kube_fixtures.start_kube

WORKER = PodKey("default", "raycluster-worker")
CLUSTER = ("default", DEFAULT_POD_LABELS["ray.io/cluster"])


def ray_token_file() -> Path:
    """Where Ray keeps the token its local cluster was started with (Ray >= 2.5x)."""
    from ray._private.authentication.authentication_token_setup import (
        _get_default_token_path,
    )

    return _get_default_token_path()


def ok_polls(aggregator: Aggregator) -> float:
    value = aggregator.metrics.registry.get_sample_value(
        "serve_health_serve_view_polls_total", {"result": "ok"}
    )
    return value or 0.0


def worker_state(aggregator: Aggregator) -> ServeState | None:
    record = aggregator.core.pod(WORKER)
    return record.state if record else None


async def test_a_worker_of_a_headonly_serve_is_no_proxy_by_design(
    ray_serve: int,
    serve_grpc_port: int,
    ray_dashboard_port: int,
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
) -> None:
    # Serve as the session started it (an earlier test may have shut it down).
    await asyncio.to_thread(
        harness.start_serve, ray_serve, grpc_port=serve_grpc_port, proxy_location="HeadOnly"
    )
    token = ray_token_file()
    assert token.exists(), f"Ray wrote no token at {token}"
    # The worker served before (say, under EveryNode): it carries true, and leaving service is
    # one label write and one Event.
    worker = kube_emulator.add_ray_cluster(
        ray_dashboard_port, WORKER.name, labels={**DEFAULT_POD_LABELS, "ray.io/serve": "true"}
    )
    aggregator = await start_kube(
        ray_dashboard_token_file=str(token),
        serve_view_interval=0.2,
        startup_grace=60,  # no pulls: the worker's reports are its agent's
    )
    views = aggregator.registry.serve_views  # type: ignore[attr-defined]
    view = await eventually(lambda: views.view(CLUSTER), timeout=30)
    assert view.proxy_location == "HeadOnly"
    assert ok_polls(aggregator) >= 1

    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, WORKER.name, uid=str(worker["metadata"]["uid"]))  # type: ignore[index]
        await call.write(report(pb.SERVE_STATE_NO_PROXY, 1, "Connection refused"))
        await call.read()
        assert worker_state(aggregator) is ServeState.NO_PROXY_BY_DESIGN
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels(*WORKER).get("ray.io/serve") == "false"
        )
        await kube_emulator.wait_until(lambda: len(kube_emulator.events("default")) == 1)
        (event,) = kube_emulator.events("default")
        assert event["reason"] == "ServeNoProxyByDesign"
        assert "proxy_location HeadOnly" in event["message"]

        # Later: more refusals (resyncs) and several more polls of the real dashboard.
        polled = ok_polls(aggregator)
        for sequence in range(2, 5):
            await call.write(report(pb.SERVE_STATE_NO_PROXY, sequence, "Connection refused"))
            await call.read()
        await eventually(lambda: ok_polls(aggregator) >= polled + 3, timeout=10)
        assert worker_state(aggregator) is ServeState.NO_PROXY_BY_DESIGN
        assert len(kube_emulator.events("default")) == 1

        stub = pb_grpc.InspectionServiceStub(channel)
        pod = await stub.GetPod(pb.GetPodRequest(namespace=WORKER.namespace, name=WORKER.name))
        assert pod.state == pb.SERVE_STATE_NO_PROXY_BY_DESIGN
        assert pod.desired_label == "false"
        summary = await stub.GetSummary(pb.GetSummaryRequest())
        assert (summary.panic, summary.panic_held_writes) == (False, 0)
        assert summary.pods_by_state["SERVE_STATE_NO_PROXY_BY_DESIGN"] == 1
        head = aggregator.core.pod(PodKey("default", "raycluster-head"))
        assert head is not None
        assert head.state is ServeState.UNKNOWN  # nothing reported for it; never judged
        call.cancel()
