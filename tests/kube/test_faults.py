"""Label writes through Kubernetes API trouble, against the emulator over real HTTP.

Covers the writer's promises (README "On Kubernetes"): a 429 with ``Retry-After`` is retried no
sooner than the server asked; a burst of 500s is retried with growing backoff and never dropped;
a pod deleted while its write is slow, failing or answered 404 is dropped by the writer (no
endless retries) and forgotten by the tracker once the watch says DELETED; with a slow API
(2 s per request) pods that flip SERVING -> not serving -> SERVING while writes are in flight
end with the labels the tracker wants (the last wanted value always lands). Each test also reads
the write and retry counters from the aggregator's Prometheus registry.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import re
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from aggregator.server import Aggregator
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.kube.emulator import KubeEmulator
from testsupport.messages import batch, open_node_stream, open_stream, report

SERVING = int(ServeState.SERVING)
NOT_READY = int(ServeState.NOT_READY)
DRAINING = int(ServeState.DRAINING)
UNHEALTHY = int(ServeState.UNHEALTHY)
LABEL = "ray.io/serve"
NS = "default"
#: Long enough that no pod goes SILENT while a test runs (tests report once, not at 1 Hz).
TTL = 60.0
#: How long a test waits for the aggregator's writes: only a hang takes this long.
WAIT = 30.0
#: The writer's log line for a failed write: the delay it chose before the next attempt.
RETRYING = re.compile(r"\(attempt (\d+), retrying in (\d+\.\d+)s\)")


def _sample(aggregator: Aggregator, name: str, **labels: str) -> float:
    value = aggregator.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def writes(aggregator: Aggregator, result: str) -> float:
    return _sample(aggregator, "serve_health_label_writes_total", kind="label", result=result)


def retries(aggregator: Aggregator, status: str) -> float:
    return _sample(aggregator, "serve_health_api_retries_total", status=status)


def label(kube: KubeEmulator, name: str) -> str | None:
    return kube.pod_labels(NS, name).get(LABEL)


def add_pods(kube: KubeEmulator, names: Sequence[str], serve: str | None = None) -> None:
    labels = {"ray.io/node-type": "worker", "ray.io/cluster": "raycluster"}
    if serve is not None:
        labels[LABEL] = serve
    for name in names:
        kube.add_pod(NS, name, labels=labels)


async def send(call: grpc.aio.StreamStreamCall, reports: dict[str, int], sequence: int) -> None:
    """One batch of reports on a DaemonSet stream; returns once the aggregator acked it."""
    await call.write(batch([(NS, name, state) for name, state in reports.items()], sequence))
    reply = await call.read()
    assert reply.ack.sequence == sequence


@pytest.fixture
async def start(
    kube_emulator: KubeEmulator, kubeconfig_path: pathlib.Path, start_aggregator: StartAggregator
) -> StartAggregator:
    async def started(**overrides: object) -> Aggregator:
        aggregator = await start_aggregator(
            kube_backend="kubernetes",
            kubeconfig=str(kubeconfig_path),
            heartbeat_ttl=TTL,
            **overrides,
        )
        await kube_emulator.wait_for_watches(1)  # discovery listens: deletions will be seen
        return aggregator

    return started


@pytest.fixture
async def channel(start: StartAggregator) -> AsyncIterator[tuple[Aggregator, grpc.aio.Channel]]:
    aggregator = await start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        yield aggregator, channel


async def test_429_with_retry_after_waits_then_succeeds(
    kube_emulator: KubeEmulator, start: StartAggregator
) -> None:
    pod = kube_emulator.add_pod(NS, "pod-a")
    aggregator = await start()
    throttle = kube_emulator.throttle_patches(1, retry_after=1)
    mark = kube_emulator.checkpoint()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "pod-a", NS, uid=pod["metadata"]["uid"])
        await call.write(report(SERVING, 1, "success"))
        await call.read()
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "true", within=WAIT)
        call.cancel()

    patches = kube_emulator.requests("PATCH", resource="pods", subresource=None, since=mark)
    assert len(throttle) == 1
    assert [p.body["metadata"]["labels"][LABEL] for p in patches] == ["true", "true"]
    # Retry-After: 1 is used as is (no jitter, no shorter backoff step); 50 ms of slack only for
    # the clock reads on either side of asyncio's timer.
    assert patches[1].at - patches[0].at >= 0.95
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)
    assert writes(aggregator, "error") == 1
    assert writes(aggregator, "success") == 1
    assert retries(aggregator, "429") == 1


async def test_burst_of_500s_is_retried_never_dropped(
    kube_emulator: KubeEmulator, channel: tuple[Aggregator, grpc.aio.Channel]
) -> None:
    aggregator, grpc_channel = channel
    names = [f"pod-{i}" for i in range(5)]
    add_pods(kube_emulator, names, serve="true")  # seeded SERVING: no writes until they turn
    await eventually(
        lambda: all(aggregator.core.pod(PodKey(NS, n)) is not None for n in names), WAIT
    )
    call = await open_node_stream(grpc_channel, "node-x")
    await send(call, dict.fromkeys(names, SERVING), 1)
    burst = kube_emulator.fail_next(5, status=500, method="PATCH")
    mark = kube_emulator.checkpoint()
    await send(call, dict.fromkeys(names, NOT_READY), 2)

    await kube_emulator.wait_until(
        lambda: all(label(kube_emulator, n) == "false" for n in names), within=WAIT
    )
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)
    call.cancel()
    patches = kube_emulator.requests("PATCH", resource="pods", since=mark)
    assert len(burst) == 5
    assert len(patches) == 10  # each pod: one 500, one success
    assert writes(aggregator, "error") == 5
    assert writes(aggregator, "success") == 5
    assert retries(aggregator, "500") == 5


async def test_consecutive_500s_back_off_under_a_doubling_ceiling(
    kube_emulator: KubeEmulator,
    channel: tuple[Aggregator, grpc.aio.Channel],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aggregator.kube.writer")
    aggregator, grpc_channel = channel
    add_pods(kube_emulator, ["pod-a"], serve="true")
    await eventually(lambda: aggregator.core.pod(PodKey(NS, "pod-a")) is not None, WAIT)
    call = await open_node_stream(grpc_channel, "node-x")
    await send(call, {"pod-a": SERVING}, 1)
    kube_emulator.fail_next(3, status=500, method="PATCH")
    mark = kube_emulator.checkpoint()
    await send(call, {"pod-a": NOT_READY}, 2)

    await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "false", within=WAIT)
    call.cancel()
    times = [p.at for p in kube_emulator.requests("PATCH", resource="pods", since=mark)]
    assert len(times) == 4
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # The delays the writer chose (its log lines): the one backoff of both programs' writes
    # (servehealth_common.backoff.backoff_delay), full jitter under a ceiling of 0.2 s that
    # doubles with each failure of the same target.
    chosen = [
        (int(match[1]), float(match[2]))
        for record in caplog.records
        if record.name == "aggregator.kube.writer"
        and (match := RETRYING.search(record.getMessage()))
    ]
    assert [attempt for attempt, _ in chosen] == [1, 2, 3]
    for (_, delay), ceiling in zip(chosen, (0.2, 0.4, 0.8), strict=True):
        assert 0 <= delay <= ceiling + 0.005, chosen  # logged as %.2f
    # And it waited each out before the next attempt (how much longer, on a loaded machine, is
    # a figure: the next attempt arrives no sooner).
    print(f"gaps between attempts: {[round(gap, 3) for gap in gaps]}, chosen: {chosen}")
    for gap, (_, delay) in zip(gaps, chosen, strict=True):
        assert gap >= delay - 0.01, (gaps, chosen)
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)
    assert writes(aggregator, "error") == 3
    assert writes(aggregator, "success") == 1
    assert retries(aggregator, "500") == 3


async def test_pod_deleted_while_its_write_is_slow_answers_404_and_is_dropped(
    kube_emulator: KubeEmulator, channel: tuple[Aggregator, grpc.aio.Channel]
) -> None:
    aggregator, grpc_channel = channel
    add_pods(kube_emulator, ["pod-a", "pod-b"], serve="true")
    await eventually(lambda: aggregator.core.tracked() == 2, WAIT)
    call = await open_node_stream(grpc_channel, "node-x")
    await send(call, {"pod-a": SERVING, "pod-b": SERVING}, 1)
    kube_emulator.slow(1.0, where=kube_emulator.select(method="PATCH", name="pod-a"))
    mark = kube_emulator.checkpoint()
    await send(call, {"pod-a": NOT_READY, "pod-b": NOT_READY}, 2)

    # The PATCH of pod-a has reached the server and waits there; delete the pod under it.
    await kube_emulator.wait_until(
        lambda: kube_emulator.requests("PATCH", name="pod-a", since=mark), within=WAIT
    )
    kube_emulator.delete_pod(NS, "pod-a")
    await eventually(lambda: aggregator.core.pod(PodKey(NS, "pod-a")) is None, WAIT)
    # The delayed PATCH is then answered 404 (the store no longer has the pod): dropped.
    await eventually(lambda: writes(aggregator, "not_found") == 1, timeout=WAIT)
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)
    assert label(kube_emulator, "pod-b") == "false"  # the other pod was not held up
    call.cancel()
    assert len(kube_emulator.requests("PATCH", name="pod-a", since=mark)) == 1
    assert writes(aggregator, "error") == 0
    assert retries(aggregator, "404") == 0


async def test_404_drops_the_write_and_the_watch_then_forgets_the_pod(
    kube_emulator: KubeEmulator, channel: tuple[Aggregator, grpc.aio.Channel]
) -> None:
    aggregator, grpc_channel = channel
    key = PodKey(NS, "pod-a")
    add_pods(kube_emulator, ["pod-a"], serve="true")
    await eventually(lambda: aggregator.core.pod(key) is not None, WAIT)
    call = await open_node_stream(grpc_channel, "node-x")
    await send(call, {"pod-a": SERVING}, 1)
    # Gone for the API server, but the watch has not said so yet.
    kube_emulator.pod_not_found(NS, "pod-a")
    mark = kube_emulator.checkpoint()
    await send(call, {"pod-a": NOT_READY}, 2)

    await eventually(lambda: writes(aggregator, "not_found") == 1, WAIT)
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)  # nothing left to retry
    assert len(kube_emulator.requests("PATCH", name="pod-a", since=mark)) == 1
    assert aggregator.core.pod(key) is not None  # only the watch removes pods

    kube_emulator.delete_pod(NS, "pod-a")
    await eventually(lambda: aggregator.core.pod(key) is None, WAIT)
    call.cancel()
    assert len(kube_emulator.requests("PATCH", name="pod-a", since=mark)) == 1
    assert writes(aggregator, "error") == 0
    assert writes(aggregator, "success") == 0


async def test_pod_deleted_while_its_write_retries_stops_the_retries(
    kube_emulator: KubeEmulator, channel: tuple[Aggregator, grpc.aio.Channel]
) -> None:
    aggregator, grpc_channel = channel
    key = PodKey(NS, "pod-a")
    add_pods(kube_emulator, ["pod-a"], serve="true")
    await eventually(lambda: aggregator.core.pod(key) is not None, WAIT)
    call = await open_node_stream(grpc_channel, "node-x")
    await send(call, {"pod-a": SERVING}, 1)
    kube_emulator.fail_next(100, status=503, method="PATCH", name="pod-a")
    mark = kube_emulator.checkpoint()
    await send(call, {"pod-a": NOT_READY}, 2)

    await kube_emulator.wait_until(
        lambda: len(kube_emulator.requests("PATCH", name="pod-a", since=mark)) >= 2, within=WAIT
    )
    assert aggregator.registry.writer.pending == 1  # backing off, not given up
    kube_emulator.delete_pod(NS, "pod-a")
    await eventually(lambda: aggregator.core.pod(key) is None, WAIT)
    await eventually(lambda: aggregator.registry.writer.pending == 0, WAIT)
    call.cancel()
    assert retries(aggregator, "503") >= 2
    assert writes(aggregator, "error") == retries(aggregator, "503")
    assert writes(aggregator, "success") == 0


async def test_slow_api_loses_no_transition(
    kube_emulator: KubeEmulator, channel: tuple[Aggregator, grpc.aio.Channel]
) -> None:
    """2 s per request; pods flip while their writes are in flight; the last value lands."""
    aggregator, grpc_channel = channel
    names = ["pod-0", "pod-1", "pod-2", "pod-3"]
    add_pods(kube_emulator, names)  # no serve label yet
    await eventually(lambda: aggregator.core.tracked() == 4, WAIT)
    call = await open_node_stream(grpc_channel, "node-x")
    kube_emulator.slow(2.0)
    mark = kube_emulator.checkpoint()

    def patches_of(name: str) -> list[str]:
        return [
            p.body["metadata"]["labels"][LABEL]
            for p in kube_emulator.requests("PATCH", resource="pods", name=name, since=mark)
        ]

    sequence = iter(range(1, 100))
    await send(call, dict.fromkeys(names, SERVING), next(sequence))
    await kube_emulator.wait_until(lambda: all(patches_of(n) == ["true"] for n in names))
    # Every "true" is in flight (held 2 s by the server). Turn three pods away meanwhile.
    await send(call, {"pod-0": NOT_READY, "pod-1": NOT_READY, "pod-2": NOT_READY}, next(sequence))
    # pod-1 comes back before its "false" could be sent (success threshold 2): nothing to write.
    await send(call, {"pod-1": SERVING, "pod-2": DRAINING}, next(sequence))
    await send(call, {"pod-1": SERVING}, next(sequence))
    await kube_emulator.wait_until(
        lambda: patches_of("pod-0")[1:] == ["false"] and patches_of("pod-2")[1:] == ["false"],
        within=WAIT,
    )
    # The "false" writes are in flight now: pod-0 returns, pod-3 leaves.
    await send(call, {"pod-0": SERVING, "pod-3": UNHEALTHY}, next(sequence))
    await send(call, {"pod-0": SERVING}, next(sequence))

    truth = {"pod-0": "true", "pod-1": "true", "pod-2": "false", "pod-3": "false"}
    for name, wanted in truth.items():
        record = aggregator.core.pod(PodKey(NS, name))
        assert record is not None
        assert record.desired_label == wanted, (name, record)
    # (pod-3's "false" may also wait for self-protection's look before it is asked for: wait
    # for both.)
    await eventually(
        lambda: (
            aggregator.registry.writer.pending == 0
            and {name: label(kube_emulator, name) for name in names} == truth
        ),
        timeout=WAIT,
    )
    call.cancel()
    assert {name: patches_of(name) for name in names} == {
        "pod-0": ["true", "false", "true"],
        "pod-1": ["true"],  # its "false" was replaced by "true" before it was sent
        "pod-2": ["true", "false"],
        "pod-3": ["true", "false"],
    }
    assert writes(aggregator, "success") == 8
    assert writes(aggregator, "error") == 0


async def test_403_names_the_verb_and_resource_counts_it_and_the_write_still_lands(
    kube_emulator: KubeEmulator, start: StartAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, point 5: 401/403 (RBAC) give one log line naming the verb and the resource,
    ``serve_health_api_denied_total{verb,resource}``, and the write is retried, not dropped."""
    pod = kube_emulator.add_pod(NS, "pod-a")
    aggregator = await start()
    denied = kube_emulator.fail_next(3, status=403, method="PATCH", message="RBAC: no patch")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "pod-a", NS, uid=pod["metadata"]["uid"])
        await call.write(report(SERVING, 1, "success"))
        await call.read()
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "true", within=WAIT)
        call.cancel()
    assert len(denied) == 3
    assert _sample(aggregator, "serve_health_api_denied_total", verb="patch", resource="pods") == 3
    lines = [r.getMessage() for r in caplog.records if "refused to patch pods" in r.getMessage()]
    assert len(lines) == 1, lines  # once per verb and resource
    assert "HTTP 403" in lines[0]
