"""The kubelet emulation (testsupport/kube/kubelet.py) against the Kubernetes documentation of
readiness probes and readiness gates, with real servers on loopback and a fake clock:

- https://kubernetes.io/docs/tasks/configure-pod-container/configure-liveness-readiness-startup-probes/
  (periodSeconds 10, timeoutSeconds 1, successThreshold 1, failureThreshold 3 by default;
  "a probe is considered failed" after timeoutSeconds; failureThreshold consecutive failures
  mark the container not ready, successThreshold consecutive successes ready again; no probe
  before initialDelaySeconds; an HTTP code >= 200 and < 400 is a success; named ports; gRPC
  health checking);
- https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-readiness-gate (a pod
  is Ready only when all its containers are ready *and* every readiness gate's condition is
  True; an absent condition counts False; ContainersReady does not look at the gates);
- KubeRay's injected readiness probes (releases 1.1 .. 1.7, ``kuberay_readiness_probe``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from testsupport.fakes import DRAINING, HEALTHY, FakeServeProxy, refused_port, silent_server
from testsupport.kube.emulator import PODS, KubeEmulator
from testsupport.kube.kubelet import (
    KUBERAY_RELEASES,
    FakeClock,
    Kubelet,
    ProbeSpec,
    ProbeUnsupported,
    kuberay_readiness_probe,
    parse_exec,
    probed_pod,
)
from testsupport.kube.probe_targets import RAYLET_DEAD, FakeGrpcHealth, FakeRayletAgent

pytestmark = pytest.mark.timeout(20)

GATE = "ray.io/serve-proxy-healthy"


def http_probe(port: int | str = 8000, path: str = "/-/healthz", **fields: Any) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, **fields}


def add(kube: KubeEmulator, name: str, probe: Mapping[str, Any] | None, **settings: Any) -> None:
    kube.put_object(PODS, probed_pod("default", name, readiness_probe=probe, **settings))


def status(kube: KubeEmulator, name: str, kind: str = "Ready") -> str | None:
    condition = kube.pod_conditions("default", name).get(kind)
    return None if condition is None else condition["status"]


def condition(kube: KubeEmulator, name: str, kind: str = "Ready") -> dict[str, Any]:
    return kube.pod_conditions("default", name)[kind]


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    server = await FakeServeProxy().start()
    yield server
    await server.stop()


@pytest.fixture
async def agent() -> AsyncIterator[FakeRayletAgent]:
    server = await FakeRayletAgent().start()
    yield server
    await server.stop()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def kubelet(kube_emulator: KubeEmulator, clock: FakeClock) -> AsyncIterator[Kubelet]:
    """A kubelet of node-1 on a fake clock; probe timeouts at half (1 s is 500 ms)."""
    async with Kubelet(kube_emulator, node="node-1", clock=clock, timeout_scale=0.5) as kubelet:
        yield kubelet


def test_probe_defaults_are_the_documented_ones() -> None:
    spec = ProbeSpec.parse({"httpGet": {"port": 8000}})
    assert (spec.period, spec.timeout, spec.success_threshold, spec.failure_threshold) == (
        10,
        1,
        1,
        3,
    )
    assert spec.initial_delay == 0
    with pytest.raises(ProbeUnsupported):
        ProbeSpec.parse({"httpGet": {"port": 1}, "tcpSocket": {"port": 1}})


async def test_failure_threshold_consecutive_failures_make_it_unready(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    add(kube, "a", http_probe())  # defaults: period 10, failureThreshold 3
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()  # the first probe runs at once
    assert status(kube, "a") == "True"
    assert status(kube, "a", "ContainersReady") == "True"
    proxy.set(DRAINING)
    for _ in range(2):
        await kubelet.advance(10)
        assert status(kube, "a") == "True"  # 1, then 2 failures: below the threshold
    await kubelet.advance(10)
    assert status(kube, "a") == "False"
    assert condition(kube, "a") | {"lastTransitionTime": None} == {
        "type": "Ready",
        "status": "False",
        "reason": "ContainersNotReady",
        "message": "containers with unready status: [ray-worker]",
        "lastTransitionTime": None,
    }
    assert status(kube, "a", "ContainersReady") == "False"
    assert [r.success for r in kubelet.probes("default", "a")] == [True, False, False, False]
    assert [r.at for r in kubelet.probes("default", "a")] == [0, 10, 20, 30]
    # A success between failures starts the count again.
    proxy.set(HEALTHY)
    await kubelet.advance(10)
    assert status(kube, "a") == "True"
    proxy.set(DRAINING)
    await kubelet.advance(20)
    proxy.set(HEALTHY)
    await kubelet.advance(10)
    proxy.set(DRAINING)
    await kubelet.advance(20)
    assert status(kube, "a") == "True"  # 2 failures, 1 success, 2 failures: never 3 in a row
    await kubelet.advance(10)
    assert status(kube, "a") == "False"


async def test_success_threshold_consecutive_successes_make_it_ready_again(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    proxy.set(DRAINING)
    add(kube, "a", http_probe(periodSeconds=5, successThreshold=3, failureThreshold=1))
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()
    assert status(kube, "a") == "False"  # a probed container starts unready
    proxy.set(HEALTHY)
    await kubelet.advance(5)
    await kubelet.advance(5)
    assert status(kube, "a") == "False"  # 2 successes of 3
    await kubelet.advance(5)
    assert status(kube, "a") == "True"
    proxy.set(DRAINING)
    await kubelet.advance(5)
    assert status(kube, "a") == "False"  # failureThreshold 1
    proxy.set(HEALTHY)
    await kubelet.advance(10)
    proxy.set(DRAINING)
    await kubelet.advance(5)
    proxy.set(HEALTHY)
    await kubelet.advance(10)
    assert status(kube, "a") == "False"  # 2 successes, a failure, 2 successes
    await kubelet.advance(5)
    assert status(kube, "a") == "True"


async def test_a_probe_exceeding_timeout_seconds_fails(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    listener = await silent_server()  # accepts, never answers
    port = listener.sockets[0].getsockname()[1]
    add(kube, "a", http_probe(timeoutSeconds=1, failureThreshold=1))
    add(kube, "b", http_probe(timeoutSeconds=2, failureThreshold=1))
    kubelet.map_ports("default", "a", {8000: port})
    kubelet.map_ports("default", "b", {8000: proxy.port})
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await kubelet.settle()
        elapsed = loop.time() - started
    finally:
        listener.close()
    assert status(kube, "a") == "False"
    assert status(kube, "b") == "True"
    (record,) = kubelet.probes("default", "a")
    assert record.success is False
    assert "timeout" in record.detail
    assert elapsed >= 0.5 - 0.01  # timeoutSeconds 1 at half: it waited that long
    # A proxy that hangs after having answered: the next probe times out.
    proxy.hang = True
    await kubelet.advance(10)
    assert status(kube, "b") == "False"
    assert "timeout" in kubelet.probes("default", "b")[-1].detail


async def test_no_probe_before_initial_delay_seconds(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    add(kube, "a", http_probe(initialDelaySeconds=15, periodSeconds=10))
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()
    await kubelet.advance(14)
    assert proxy.requests == 0
    assert kubelet.probes() == []
    assert status(kube, "a") == "False"  # unready until a probe succeeds
    await kubelet.advance(6)  # the first tick after 15 s (the prober ticks every period)
    assert proxy.requests == 1
    assert [r.at for r in kubelet.probes()] == [20]
    assert status(kube, "a") == "True"


async def test_ready_needs_every_readiness_gate_true_and_containers_ready_does_not(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    add(kube, "a", http_probe(failureThreshold=1), readiness_gates=[GATE])
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()
    assert status(kube, "a", "ContainersReady") == "True"
    assert condition(kube, "a")["status"] == "False"
    assert condition(kube, "a")["reason"] == "ReadinessGatesNotReady"
    assert condition(kube, "a")["message"] == (
        f'corresponding condition of pod readiness gate "{GATE}" does not exist.'
    )

    async def set_gate(value: str) -> None:
        # As the aggregator writes it: a strategic merge patch of pods/status, over HTTP.
        url = f"{str(kube.url).rstrip('/')}/api/v1/namespaces/default/pods/a/status"
        body = {"status": {"conditions": [{"type": GATE, "status": value}]}}
        headers = {"Content-Type": "application/strategic-merge-patch+json"}
        async with (
            aiohttp.ClientSession() as session,
            session.patch(url, json=body, headers=headers) as response,
        ):
            assert response.status == 200

    # Re-evaluated on the gate's change, not at the next probe: the clock does not move.
    await set_gate("True")
    await kube.wait_until(lambda: status(kube, "a") == "True", within=5)
    await set_gate("False")
    await kube.wait_until(lambda: status(kube, "a") == "False", within=5)
    assert condition(kube, "a")["message"] == (
        f'the status of pod readiness gate "{GATE}" is not "True", but False'
    )
    assert status(kube, "a", "ContainersReady") == "True"
    # The gate True does not make Ready while the container is not ready.
    await set_gate("True")
    await kube.wait_until(lambda: status(kube, "a") == "True", within=5)
    proxy.set(DRAINING)
    await kubelet.advance(10)
    assert status(kube, "a") == "False"
    assert condition(kube, "a")["reason"] == "ContainersNotReady"
    assert kube.pod_conditions("default", "a")[GATE]["status"] == "True"  # the gate untouched


async def test_http_codes_200_to_399_succeed_4xx_5xx_fail(
    kube_emulator: KubeEmulator, kubelet: Kubelet
) -> None:
    kube = kube_emulator
    codes = {200: True, 204: True, 301: True, 302: True, 399: True, 404: False, 500: False}
    proxies = {}
    try:
        for code in codes:
            proxies[code] = await FakeServeProxy(healthz=(code, "x")).start()
            add(kube, f"p{code}", http_probe(failureThreshold=1))
            kubelet.map_ports("default", f"p{code}", {8000: proxies[code].port})
        await kubelet.settle()
        assert {code: status(kube, f"p{code}") == "True" for code in codes} == codes
    finally:
        for server in proxies.values():
            await server.stop()


async def test_redirects_to_the_same_host_are_followed(
    kube_emulator: KubeEmulator, kubelet: Kubelet
) -> None:
    kube = kube_emulator
    app = aiohttp.web.Application()

    async def moved(request: aiohttp.web.Request) -> aiohttp.web.Response:
        raise aiohttp.web.HTTPFound(request.query.get("to", "/missing"))

    app.router.add_get("/moved", moved)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        add(kube, "same", http_probe(path="/moved", failureThreshold=1))  # -> /missing: 404
        add(
            kube, "away", http_probe(path="/moved?to=http://elsewhere.invalid/", failureThreshold=1)
        )
        for name in ("same", "away"):
            kubelet.map_ports("default", name, {8000: port})
        await kubelet.settle()
        assert status(kube, "same") == "False"  # followed to the 404
        assert status(kube, "away") == "True"  # another host: the redirect counts as success
    finally:
        await runner.cleanup()


async def test_named_port_and_tcp_socket(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    # make_pod's container declares port 8000 named "serve".
    add(kube, "http", http_probe(port="serve", failureThreshold=1))
    add(kube, "tcp", {"tcpSocket": {"port": "serve"}, "failureThreshold": 1})
    add(kube, "refused", {"tcpSocket": {"port": 8000}, "failureThreshold": 1})
    add(kube, "unknown", http_probe(port="nope", failureThreshold=1))
    for name in ("http", "tcp", "unknown"):
        kubelet.map_ports("default", name, {8000: proxy.port})
    kubelet.map_ports("default", "refused", {8000: refused_port()})
    await kubelet.settle()
    assert status(kube, "http") == "True"
    assert proxy.requests >= 1
    assert status(kube, "tcp") == "True"
    assert status(kube, "refused") == "False"
    # A named port the container lacks: the probe errors, its result is thrown away.
    assert status(kube, "unknown") == "False"
    assert [r.success for r in kubelet.probes("default", "unknown")] == [None]


async def test_grpc_health_check(kube_emulator: KubeEmulator, kubelet: Kubelet) -> None:
    kube = kube_emulator
    server = await FakeGrpcHealth(statuses={"": "SERVING", "serve": "SERVING"}).start()
    try:
        add(kube, "all", {"grpc": {"port": 9000}, "failureThreshold": 1})
        add(kube, "named", {"grpc": {"port": 9000, "service": "serve"}, "failureThreshold": 1})
        add(kube, "unknown", {"grpc": {"port": 9000, "service": "x"}, "failureThreshold": 1})
        for name in ("all", "named", "unknown"):
            kubelet.map_ports("default", name, {9000: server.port})
        await kubelet.settle()
        assert [status(kube, n) for n in ("all", "named", "unknown")] == ["True", "True", "False"]
        server.set("serve", "NOT_SERVING")
        await kubelet.advance(10)
        assert [status(kube, n) for n in ("all", "named")] == ["True", "False"]
        assert "NOT_SERVING" in kubelet.probes("default", "named")[-1].detail
    finally:
        await server.stop()


@pytest.mark.parametrize("release", KUBERAY_RELEASES)
async def test_kuberay_exec_chain_needs_both_checks(
    kube_emulator: KubeEmulator,
    kubelet: Kubelet,
    proxy: FakeServeProxy,
    agent: FakeRayletAgent,
    release: str,
) -> None:
    kube = kube_emulator
    probe = kuberay_readiness_probe(release)
    assert probe["exec"]["command"][:2] == ["bash", "-c"]
    add(kube, "a", probe)
    kubelet.map_ports("default", "a", {52365: agent.port, 8000: proxy.port})
    await kubelet.settle()
    await kubelet.advance(9)
    assert agent.requests == 0
    assert status(kube, "a") == "False"
    await kubelet.advance(1)
    assert status(kube, "a") == "True"
    assert agent.paths == {"/api/local_raylet_healthz": 1}
    assert proxy.requests == 1
    proxy.set(DRAINING)  # 503: wget prints nothing, grep fails
    await kubelet.advance(5)
    assert status(kube, "a") == "False"  # failureThreshold 1
    proxy.set(HEALTHY)
    agent.set(RAYLET_DEAD)
    requests = proxy.requests
    await kubelet.advance(5)
    assert status(kube, "a") == "False"
    assert proxy.requests == requests  # `&&`: the proxy check does not run
    agent.set()
    await kubelet.advance(5)
    assert status(kube, "a") == "True"
    proxy.set((200, "not the word"))  # 200 without "success": grep fails
    await kubelet.advance(5)
    assert status(kube, "a") == "False"


async def test_kuberay_proxy_hang_fails_at_the_probe_timeout(
    kube_emulator: KubeEmulator,
    kubelet: Kubelet,
    proxy: FakeServeProxy,
    agent: FakeRayletAgent,
) -> None:
    kube = kube_emulator
    add(kube, "a", kuberay_readiness_probe("1.4"))  # timeoutSeconds 2; the proxy's wget -T 10
    kubelet.map_ports("default", "a", {52365: agent.port, 8000: proxy.port})
    await kubelet.advance(10)
    assert status(kube, "a") == "True"
    proxy.hang = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    await kubelet.advance(5)
    assert status(kube, "a") == "False"
    assert "timeout: no answer within 2s" in kubelet.probes()[-1].detail
    assert loop.time() - started < 3  # the probe's 2 s (at half: 1 s), not wget's 10 (5 s)


def test_the_exec_forms_kuberay_injects_parse() -> None:
    for release in KUBERAY_RELEASES:
        probe = kuberay_readiness_probe(release)
        steps = parse_exec(probe["exec"]["command"])
        assert [s.url for s in steps] == [
            "http://localhost:52365/api/local_raylet_healthz",
            "http://localhost:8000/-/healthz",
        ]
        assert steps[0].timeout == 2
        assert steps[1].timeout == (2 if release == "1.1" else 10)
        assert {s.tries for s in steps} == ({1} if release >= "1.4" else {20})
        assert {s.word for s in steps} == {"success"}
    # What KubeRay 1.1 wrote, verbatim, and the same through sh.
    chain = (
        "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success && "
        "wget -T 2 -q -O- http://localhost:8000/-/healthz | grep success"
    )
    assert kuberay_readiness_probe("1.1")["exec"]["command"] == ["bash", "-c", chain]
    assert len(parse_exec(["sh", "-c", chain])) == 2
    assert (
        len(parse_exec(["/bin/bash", "-c", "wget --timeout=3 -O - http://localhost:1/ | grep ok"]))
        == 1
    )
    for command in (
        ["curl", "-f", "http://localhost:8000/-/healthz"],
        ["bash", "-c", "curl -f http://localhost:8000/-/healthz"],
        ["bash", "-c", "wget -q -O- http://localhost:8000/ | grep ok || true"],
        ["bash", "-c", "wget -q -O- http://localhost:8000/; echo"],
        ["bash", "-c", "wget -q http://localhost:8000/ | grep ok"],  # no -O-: grep sees nothing
        ["bash", "-c", "wget --spider -O- http://localhost:8000/ | grep ok"],
        ["bash", "-c", "wget -O- http://localhost:8000/ | grep -v ok"],
    ):
        with pytest.raises(ProbeUnsupported):
            parse_exec(command)


async def test_another_exec_command_fails_the_probe_and_says_why(
    kube_emulator: KubeEmulator,
    kubelet: Kubelet,
    proxy: FakeServeProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = kube_emulator
    caplog.set_level(logging.WARNING, logger="testsupport.kube.kubelet")
    command = ["bash", "-c", "curl -sf http://localhost:8000/-/healthz"]
    add(kube, "a", {"exec": {"command": command}, "failureThreshold": 1})
    add(kube, "b", {"exec": {"command": ["bash", "-c", "wget -O- http://example.com/ | grep x"]}})
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()
    assert status(kube, "a") == "False"
    assert status(kube, "b") == "False"
    assert proxy.requests == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("default/a" in w and "cannot run here" in w and "curl" in w for w in warnings)
    assert any("default/b" in w and "only http://localhost" in w for w in warnings)


async def test_status_is_written_only_when_it_changes(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    queue = kube.subscribe()
    try:
        add(kube, "a", http_probe())
        kubelet.map_ports("default", "a", {8000: proxy.port})
        await kubelet.settle()
        version = kube.pod("default", "a")["metadata"]["resourceVersion"]
        writes = kubelet.writes
        await kubelet.advance(100)  # ten passing probes
        assert len(kubelet.probes()) == 11
        assert kube.pod("default", "a")["metadata"]["resourceVersion"] == version
        assert kubelet.writes == writes
        changes = [queue.get_nowait() for _ in range(queue.qsize())]
        # Created; unready (a probed container starts so); ready after the first probe.
        assert [c.type for c in changes] == ["ADDED", "MODIFIED", "MODIFIED"]
    finally:
        kube.unsubscribe(queue)
    statuses = kube.pod("default", "a")["status"]["containerStatuses"]
    assert [(s["name"], s["ready"], s["started"]) for s in statuses] == [("ray-worker", True, True)]


async def test_a_container_without_a_probe_is_ready_once_running(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    sidecar = {"name": "sidecar", "image": "busybox"}
    proxy.set(DRAINING)
    add(kube, "a", http_probe(failureThreshold=1), sidecars=[sidecar])
    add(kube, "pending", None, phase="Pending", sidecars=[sidecar])
    kubelet.map_ports("default", "a", {8000: proxy.port})
    await kubelet.settle()
    assert condition(kube, "a")["message"] == "containers with unready status: [ray-worker]"
    assert kubelet.container_ready("default", "a") == {"ray-worker": False, "sidecar": True}
    assert status(kube, "pending") == "False"  # not running: no container is ready
    kube.modify_pod("default", "pending", phase="Running")
    await kubelet.settle()
    assert status(kube, "pending") == "True"
    assert status(kube, "pending", "ContainersReady") == "True"


async def test_pods_of_the_node_as_they_come_and_go(
    kube_emulator: KubeEmulator, kubelet: Kubelet, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    add(kube, "elsewhere", http_probe(failureThreshold=1), node_name="node-2")
    await kubelet.settle()
    assert kubelet.probes() == []
    assert status(kube, "elsewhere") == "True"
    add(kube, "later", http_probe(failureThreshold=1))
    kubelet.map_ports("default", "later", {8000: proxy.port})
    await kubelet.settle()
    assert [r.pod for r in kubelet.probes()] == ["later"]
    assert status(kube, "later") == "True"
    kube.delete_pod("default", "later")
    await kubelet.advance(30)
    assert len(kubelet.probes()) == 1  # its worker stopped


async def test_adopt_takes_running_pods_as_they_are(
    kube_emulator: KubeEmulator, clock: FakeClock, proxy: FakeServeProxy
) -> None:
    kube = kube_emulator
    add(kube, "a", kuberay_readiness_probe("1.4"))  # Ready, as make_pod writes it
    version = kube.pod("default", "a")["metadata"]["resourceVersion"]
    agent = await FakeRayletAgent().start()
    try:
        async with Kubelet(kube, pods=[("default", "a")], clock=clock, adopt=True) as kubelet:
            kubelet.map_ports("default", "a", {52365: agent.port, 8000: proxy.port})
            await kubelet.settle()  # probed at once: no initial delay left, no write
            assert kubelet.probes()[0].success is True
            assert kube.pod("default", "a")["metadata"]["resourceVersion"] == version
            proxy.set(DRAINING)
            await kubelet.advance(5)
            assert status(kube, "a") == "False"
    finally:
        await agent.stop()


async def test_on_real_time_with_a_time_scale(
    kube_emulator: KubeEmulator, proxy: FakeServeProxy, agent: FakeRayletAgent
) -> None:
    kube = kube_emulator
    add(kube, "a", kuberay_readiness_probe("1.4"))  # delay 10 s, period 5 s, timeout 2 s
    kubelet = Kubelet(kube, pods=[("default", "a")], time_scale=0.03, timeout_scale=0.2)
    async with kubelet:
        kubelet.map_ports("default", "a", {52365: agent.port, 8000: proxy.port})
        loop = asyncio.get_running_loop()
        started = loop.time()
        await kube.wait_until(lambda: status(kube, "a") == "True", within=3)
        assert loop.time() - started >= 10 * 0.03 - 0.01  # not before the initial delay
        proxy.hang = True  # a hang: out at the next probe's timeout (2 s -> 400 ms)
        await kube.wait_until(lambda: status(kube, "a") == "False", within=3)
