"""The pull fallback at fleet scale, against the Kubernetes API emulator and real HTTP proxies.

- One full sweep (``Puller.pull_now`` of every pod, awaited) of 500 pods, 10 % of them hung (the
  connection is accepted, nothing is answered) and 10 % refusing connections, gives each pod
  the right state (SERVING, UNHEALTHY, NO_PROXY) with source PULL, asking each proxy only as
  often as the confirmation rule says. How long a sweep takes is a benchmark, not a test:
  ``python -m bench.pull_sweep`` (docs/benchmarks.md, "Pull sweep").
- Pure-pull mode (no agent at all, the aggregator's own pull loop): the serve labels in the
  cluster follow 200 proxies, including 50 that turn NOT_READY and come back.

Every proxy is a real aiohttp server on 127.0.0.1; pods point at it through ``status.podIP``
(always 127.0.0.1) and their container port named ``serve``.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from aggregator.decision.tracker import StateChange
from aggregator.server import Aggregator
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState, Source
from tests.conftest import StartAggregator, eventually
from testsupport.fakes import HEALTHY, NOT_POPULATED, FakeServeProxy, refused_port
from testsupport.kube.emulator import PODS, KubeEmulator

NAMESPACE = "default"
LABEL = "ray.io/serve"
LOOPBACK = "127.0.0.1"  # pulls must never target anything else
#: Generous: the 500 proxies, the emulator and the aggregator share this process's one event
#: loop, and on a busy 2-core CI machine a healthy proxy's answer once took over 0.5 s, twice
#: in a row (a SERVING pod pulled UNHEALTHY). Hung proxies still cost only two timeouts each,
#: all at once.
PULL_TIMEOUT = 2.0
#: The pure-pull test's loop: one pull of every pod per interval (the timeout must be shorter).
#: Its 200 healthy proxies never make a pull wait for the timeout, so a long one costs nothing,
#: and a healthy pod is never pulled UNHEALTHY on four busy workers (seen with 2 s).
PURE_PULL_TIMEOUT = 5.0
PULL_INTERVAL = 6.0


@dataclass
class FakePod:
    name: str
    port: int
    expected: ServeState
    proxy: FakeServeProxy | None = None  # None: nothing listens on the port (refused)

    @property
    def key(self) -> PodKey:
        return PodKey(NAMESPACE, self.name)


@pytest.fixture
def kube(kube_emulator: KubeEmulator) -> KubeEmulator:
    return kube_emulator


@pytest.fixture
def kubeconfig(kubeconfig_path: pathlib.Path) -> str:
    return str(kubeconfig_path)


@pytest.fixture
async def proxies() -> AsyncIterator[list[FakeServeProxy]]:
    """Every proxy a test starts; all stopped (concurrently) at teardown."""
    started: list[FakeServeProxy] = []
    yield started
    await asyncio.gather(*(proxy.stop() for proxy in started))


async def start_fleet(
    kube: KubeEmulator,
    proxies: list[FakeServeProxy],
    count: int,
    *,
    hung_every: int = 0,
    refused_every: int = 0,
) -> list[FakePod]:
    """``count`` pods, each with a proxy on a loopback port; every ``hung_every``-th proxy
    accepts and never answers, every ``refused_every``-th pod has nothing listening (spread
    evenly through the fleet, so no kind waits at the end of the line)."""

    def kind(index: int) -> ServeState:
        if hung_every and index % hung_every == hung_every // 2:
            return ServeState.UNHEALTHY
        if refused_every and index % refused_every == refused_every - 1:
            return ServeState.NO_PROXY
        return ServeState.SERVING

    kinds = [kind(index) for index in range(count)]
    live = [
        FakeServeProxy(hang=expected is ServeState.UNHEALTHY)
        for expected in kinds
        if expected is not ServeState.NO_PROXY
    ]
    proxies.extend(live)
    await asyncio.gather(*(proxy.start() for proxy in live))
    listening = {proxy.port for proxy in live}
    unused = iter(live)
    pods = []
    for index, expected in enumerate(kinds):
        if expected is ServeState.NO_PROXY:
            port = refused_port(LOOPBACK)
            while port in listening:
                port = refused_port(LOOPBACK)
            pod = FakePod(f"ray-worker-{index:04d}", port, expected)
        else:
            proxy = next(unused)
            pod = FakePod(f"ray-worker-{index:04d}", proxy.port, expected, proxy)
        kube.add_pod(NAMESPACE, pod.name, pod_ip=LOOPBACK, serve_port=pod.port)
        pods.append(pod)
    return pods


def labels(kube: KubeEmulator) -> dict[str, str | None]:
    """The serve label of every pod in the emulator, by pod name."""
    return {
        pod["metadata"]["name"]: (pod["metadata"].get("labels") or {}).get(LABEL)
        for pod in kube.list_objects(PODS, NAMESPACE)
    }


def assert_loopback_only(aggregator: Aggregator, pods: list[FakePod]) -> None:
    puller = aggregator.puller
    assert puller is not None
    for pod in pods:
        assert puller.url(pod.key) == f"http://{LOOPBACK}:{pod.port}/-/healthz"


async def test_a_full_sweep_of_500_pods_gives_each_its_state(
    kube: KubeEmulator,
    kubeconfig: str,
    proxies: list[FakeServeProxy],
    start_aggregator: StartAggregator,
) -> None:
    pods = await start_fleet(kube, proxies, 500, hung_every=10, refused_every=10)
    aggregator = await start_aggregator(
        kube_backend="kubernetes",
        kubeconfig=kubeconfig,
        pull_timeout=PULL_TIMEOUT,
        # No agents, and nothing but the sweep below pulls: the periodic loop sits out the
        # startup grace (and would wait an hour after it), so the sweep is alone.
        startup_grace=600,
        pull_interval=3600,
        events=False,
    )
    puller = aggregator.puller
    assert puller is not None
    assert all(aggregator.core.pod(pod.key) is not None for pod in pods)  # listed at start
    assert_loopback_only(aggregator, pods)
    counts = {state: sum(p.expected is state for p in pods) for state in ServeState}
    assert (counts[ServeState.UNHEALTHY], counts[ServeState.NO_PROXY]) == (50, 50)

    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.gather(*puller.pull_now([pod.key for pod in pods]))
    elapsed = loop.time() - started
    print(f"\nfull pull sweep of {len(pods)} pods (10% hung, 10% refused): {elapsed:.3f}s")

    wrong = {}
    for pod in pods:
        record = aggregator.core.pod(pod.key)
        assert record is not None
        if (record.state, record.source) != (pod.expected, Source.PULL):
            wrong[pod.name] = (pod.expected.name, record.state.name, record.source, record.reason)
    assert not wrong, f"{len(wrong)} pods in the wrong state: {dict(list(wrong.items())[:5])}"
    # A hung proxy was asked twice: its first failure was confirmed by a second probe. A serving
    # one answered /-/healthz and /-/routes at least once (more if a probe of it timed out on a
    # busy loop, and once more for each look at the pods in service that a new UNHEALTHY pod
    # started: self-protection's, up to 100 pods each).
    asked = {pod.name: pod.proxy.requests for pod in pods if pod.proxy is not None}
    hung = [asked[pod.name] for pod in pods if pod.expected is ServeState.UNHEALTHY]
    assert hung == [2] * len(hung), hung
    serving = [asked[pod.name] for pod in pods if pod.expected is ServeState.SERVING]
    assert min(serving) >= 2, sorted(set(serving))
    print(f"serving pods probed twice (first probe timed out): {sum(n > 2 for n in serving)}")


async def test_pure_pull_labels_follow_the_proxies(
    kube: KubeEmulator,
    kubeconfig: str,
    proxies: list[FakeServeProxy],
    start_aggregator: StartAggregator,
) -> None:
    pods = await start_fleet(kube, proxies, 200)
    aggregator = await start_aggregator(
        kube_backend="kubernetes",
        kubeconfig=kubeconfig,
        pull_interval=PULL_INTERVAL,
        pull_timeout=PURE_PULL_TIMEOUT,
        startup_grace=0.5,
        kube_qps=500,  # 200 label writes at once: not what this test is about
        kube_burst=500,
        events=False,
    )
    assert_loopback_only(aggregator, pods)
    seen: list[StateChange] = []

    async def watch() -> None:
        async for transition in aggregator.core.watch():
            seen.append(transition)

    watcher = asyncio.create_task(watch())
    try:

        def labelled(expected: dict[str, str]) -> bool:
            return labels(kube) == expected

        everyone_true = {pod.name: "true" for pod in pods}
        await eventually(lambda: labelled(everyone_true), timeout=60, interval=0.1)

        flipped = pods[::4]
        assert len(flipped) == 50
        for pod in flipped:
            assert pod.proxy is not None
            pod.proxy.set(NOT_POPULATED)
        some_false = {**everyone_true, **{pod.name: "false" for pod in flipped}}
        await eventually(lambda: labelled(some_false), timeout=60, interval=0.1)
        for pod in flipped:
            record = aggregator.core.pod(pod.key)
            assert record is not None
            assert (record.state, record.source) == (ServeState.NOT_READY, Source.PULL)

        for pod in flipped:
            assert pod.proxy is not None
            pod.proxy.set(HEALTHY)
        await eventually(lambda: labelled(everyone_true), timeout=60, interval=0.1)
        for pod in pods:
            record = aggregator.core.pod(pod.key)
            assert record is not None
            assert (record.state, record.source) == (ServeState.SERVING, Source.PULL)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    # Nothing but pulls moved a pod, and no pod fell SILENT between two pulls.
    assert {t.source for t in seen} == {Source.PULL}
    assert not [t for t in seen if ServeState.SILENT in (t.old, t.new)]
    moves = {(t.old, t.new) for t in seen}
    assert moves == {
        (ServeState.UNKNOWN, ServeState.SERVING),
        (ServeState.SERVING, ServeState.NOT_READY),
        (ServeState.NOT_READY, ServeState.SERVING),
    }
