"""The client-side token bucket on label writes, with 2,000 pods turning bad at once.

2,000 Ray pods carry ``ray.io/serve=true`` (the aggregator seeds them SERVING and writes
nothing), one DaemonSet-mode stream confirms them SERVING, then reports all of them NOT_READY
in one go. Every PATCH that reaches the emulator after that point must fit the bucket
(``--kube-qps 200``, ``--kube-burst 50``): in no one-second window more than ``burst + qps``
requests (give or take the few a request's trip can move, see TOLERANCE), the whole run no
shorter than ``(2000 - burst) / qps`` seconds, one PATCH per pod, and every label ends ``false``.
"""

from __future__ import annotations

import asyncio
import pathlib

import grpc

from aggregator.kube.registry import KubeRegistry
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import PODS, KubeEmulator, peak_count
from testsupport.messages import batch, open_node_stream

PODS_COUNT = 2000
QPS = 200
BURST = 50
#: Writer tasks (and client threads). Fewer than the default 16 to keep TOLERANCE small; 4
#: still carry well over 200 requests/s to the emulator on loopback.
CONCURRENCY = 4
#: Requests allowed above ``burst + qps`` in a one-second window of arrivals at the emulator.
#: The bucket grants a token on the aggregator's loop; the request then leaves through a client
#: thread and is stamped by the emulator when its handler runs on the loop it shares with the
#: aggregator. That trip takes ~1 ms, but up to ~200 ms when the loop or the GIL is busy (just
#: after 2,000 reports arrive, or during a full garbage collection), so a request granted before
#: a window can be stamped inside it. Each writer task waits for its answer before it takes the
#: next token, so at most CONCURRENCY requests are granted and not yet stamped at any moment:
#: that is the exact slack (measured with the default 16 tasks: up to 264, i.e. 250 + 14). Plus 1
#: for the bucket's own timer and float rounding at a window's edge.
TOLERANCE = CONCURRENCY + 1
#: Reports per ReportBatch message: 500 fit well under --max-message-bytes (64 KiB).
BATCH = 500
LABEL = "ray.io/serve"
NS = "ray"


async def test_mass_turn_to_not_ready_never_exceeds_the_bucket(
    kube_emulator: KubeEmulator, kubeconfig_path: pathlib.Path, start_aggregator: StartAggregator
) -> None:
    names = [f"ray-worker-{i:04d}" for i in range(PODS_COUNT)]
    labels = {"ray.io/node-type": "worker", "ray.io/cluster": "big", LABEL: "true"}
    for number, name in enumerate(names):
        kube_emulator.add_pod(NS, name, labels=labels, node_name=f"node-{number % 50}")
    aggregator = await start_aggregator(
        kube_backend="kubernetes",
        kubeconfig=str(kubeconfig_path),
        kube_qps=QPS,
        kube_burst=BURST,
        kube_concurrency=CONCURRENCY,
        heartbeat_ttl=120.0,  # the test reports once per phase, not at 1 Hz: nobody goes SILENT
        max_pods_per_stream=len(names),  # one stream speaks for every pod
    )
    registry = aggregator.registry
    assert isinstance(registry, KubeRegistry)
    assert aggregator.core.tracked() == PODS_COUNT
    assert aggregator.core.counts()[ServeState.SERVING] == PODS_COUNT  # seeded from labels

    async def report_all(call: grpc.aio.StreamStreamCall, state: ServeState, first: int) -> None:
        for number, start in enumerate(range(0, PODS_COUNT, BATCH), start=first):
            chunk = [(NS, name, int(state)) for name in names[start : start + BATCH]]
            await call.write(batch(chunk, number))
            assert (await call.read()).ack.sequence == number

    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_node_stream(channel, "node-bench")
        await report_all(call, ServeState.SERVING, 1)
        assert kube_emulator.requests("PATCH") == []  # seeded: nothing to write

        mark = kube_emulator.checkpoint()
        started = asyncio.get_running_loop().time()  # the clock of the emulator's stamps
        await report_all(call, ServeState.NOT_READY, 100)
        # ~10 s at 200/s; the timeout leaves room for a machine busy with other work.
        await eventually(lambda: registry.writer.pending == 0, timeout=60, interval=0.1)
        call.cancel()

    pods = kube_emulator.list_objects(PODS, NS)
    assert [pod["metadata"]["labels"][LABEL] for pod in pods] == ["false"] * PODS_COUNT
    calls = kube_emulator.requests("PATCH", resource="pods", since=mark)
    assert sorted(call.name for call in calls) == names  # one write per pod, no more
    peak = peak_count(calls, window=1.0)
    assert peak <= BURST + QPS * 1.0 + TOLERANCE, peak
    span = calls[-1].at - started
    assert span >= (PODS_COUNT - BURST - TOLERANCE) / QPS, span
    sample = aggregator.metrics.registry.get_sample_value
    assert sample("serve_health_label_writes_total", {"kind": "label", "result": "success"}) == (
        PODS_COUNT
    )
    assert sample("serve_health_api_retries_total", {"status": "429"}) is None
