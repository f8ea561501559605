"""The node agent (``node_agent``): failure confirmation, identity, CLI, and the stream.

- The agent's probe (``Agent.probe``, a ``PodProbe``: ``probe_once``) with a real ``Prober``
  against real HTTP servers: a first failure is confirmed by a second probe ``confirm_delay``
  later, unless it is already the reported state.
- ``SidecarPod.from_environ``: the downward-API variables, and errors naming exactly what is
  missing.
- ``python -m node_agent`` as a real subprocess: usage errors, and that it never exits while
  the aggregator is away (only on SIGTERM).
- The agent against a real in-process aggregator (gRPC on 127.0.0.1): settings from the
  aggregator, changes reported at once, heartbeats, reconnection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from aiohttp import web
from google.protobuf.duration_pb2 import Duration

from aggregator.decision.tracker import PodRecord
from aggregator.flags import AggregatorFlags
from node_agent.agent import Agent
from node_agent.flags import AgentFlags
from node_agent.identity import REQUIRED, MissingIdentity, SidecarPod
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.http import HTTPClient
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, ProbeResult, make_session
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually, running
from testsupport import fakes
from testsupport.fakes import FakeServeProxy, refused_port

IDENTITY_ENV = {
    "POD_NAMESPACE": "ns",
    "POD_NAME": "pod-a",
    "POD_UID": "uid-1",
    "NODE_NAME": "node-1",
}
IDENTITY = SidecarPod("ns", "pod-a", "uid-1", "node-1")
KEY = PodKey("ns", "pod-a")
CONFIRM_DELAY = 0.2
#: uvloop's timers fire on a 1 ms clock: a wait may end up to 1 ms early.
TIMER_RESOLUTION = 0.001
#: How long a test waits for the agent or the aggregator: only a hang takes this long.
WAIT = 30.0

MakeAgent = Callable[..., Agent]


class ScriptedProxy:
    """A real HTTP server whose ``/-/healthz`` answers come from a list, in order.

    The last answer repeats. ``/-/routes`` always lists one application. ``times`` holds the
    loop time of every ``/-/healthz`` request.
    """

    def __init__(self, *answers: tuple[int, str]) -> None:
        assert answers
        self.answers = list(answers)
        self.times: list[float] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/-/healthz"

    @property
    def requests(self) -> int:
        return len(self.times)

    async def _healthz(self, _: web.Request) -> web.Response:
        self.times.append(asyncio.get_running_loop().time())
        status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return web.Response(status=status, text=body)

    async def _routes(self, _: web.Request) -> web.Response:
        status, body = fakes.ROUTES
        return web.Response(status=status, text=body)

    async def start(self) -> ScriptedProxy:
        app = web.Application()
        app.router.add_get("/-/healthz", self._healthz)
        app.router.add_get("/-/routes", self._routes)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@pytest.fixture
def make_agent(session: HTTPClient) -> MakeAgent:
    """``make_agent(proxy_url, aggregator=..., **settings)``: an Agent with a real Prober."""

    def make(proxy_url: str, aggregator: str = "127.0.0.1:1", **overrides: Any) -> Agent:
        settings = AgentFlags(
            aggregator=aggregator,
            proxy_url=proxy_url,
            **{"confirm_delay": CONFIRM_DELAY, **overrides},
        )
        return Agent(settings, IDENTITY, Prober(session, settings.probe_timeout))

    return make


def result(state: ServeState) -> ProbeResult:
    return ProbeResult(state, "earlier", 0, 0.0)


# -- the agent's probe_once: confirmation of failures ---------------------------------------

NOT_READY = ServeState.NOT_READY
SERVING = ServeState.SERVING
DRAINING = ServeState.DRAINING
UNHEALTHY = ServeState.UNHEALTHY
INTERNAL_ERROR = (500, "Internal Server Error")


@pytest.mark.parametrize(
    ("latest", "answers", "expected", "requests"),
    [
        pytest.param(None, [fakes.HEALTHY], SERVING, 1, id="serving-needs-no-confirmation"),
        pytest.param(
            SERVING, [fakes.HEALTHY, fakes.DRAINING], SERVING, 1, id="serving-stays-serving"
        ),
        pytest.param(
            None, [fakes.NOT_POPULATED, fakes.HEALTHY], SERVING, 2, id="first-probe-fails-once"
        ),
        pytest.param(SERVING, [fakes.DRAINING, fakes.HEALTHY], SERVING, 2, id="serving-fails-once"),
        pytest.param(SERVING, [INTERNAL_ERROR, fakes.HEALTHY], SERVING, 2, id="one-500-is-a-blip"),
        pytest.param(SERVING, [fakes.NOT_POPULATED], NOT_READY, 2, id="persistent-failure"),
        pytest.param(None, [INTERNAL_ERROR], UNHEALTHY, 2, id="first-probe-persistent-failure"),
        pytest.param(
            SERVING,
            [fakes.NOT_POPULATED, fakes.DRAINING],
            DRAINING,
            2,
            id="second-probe-state-is-reported",
        ),
        pytest.param(
            NOT_READY, [fakes.NO_REPLICAS, fakes.HEALTHY], NOT_READY, 1, id="already-not-ready"
        ),
        pytest.param(DRAINING, [fakes.DRAINING, fakes.HEALTHY], DRAINING, 1, id="already-draining"),
        pytest.param(
            DRAINING, [fakes.NOT_POPULATED], NOT_READY, 2, id="another-failure-is-confirmed"
        ),
        pytest.param(
            ServeState.NO_PROXY,
            [INTERNAL_ERROR, INTERNAL_ERROR],
            UNHEALTHY,
            2,
            id="no-proxy-to-unhealthy-is-confirmed",
        ),
    ],
)
async def test_probe_once_confirms_a_new_failure(
    make_agent: MakeAgent,
    latest: ServeState | None,
    answers: list[tuple[int, str]],
    expected: ServeState,
    requests: int,
) -> None:
    proxy = await ScriptedProxy(*answers).start()
    try:
        probe = make_agent(proxy.url).probe
        probe.latest = None if latest is None else result(latest)
        started = asyncio.get_running_loop().time()
        confirmed = await probe.probe_once()
    finally:
        await proxy.stop()
    assert confirmed.state is expected
    assert proxy.requests == requests
    if requests == 2:
        first, second = proxy.times
        # The confirmation starts CONFIRM_DELAY after the first probe's answer (or after the
        # first started, if it is still unanswered then): never sooner than CONFIRM_DELAY after
        # probe_once began. (How far apart the two arrive on a loaded machine is a figure.)
        assert first < second
        assert second - started >= CONFIRM_DELAY - TIMER_RESOLUTION
    # probe_once only probes; the probe loop is what updates ``latest``.
    assert probe.latest == (None if latest is None else result(latest))


async def test_probe_once_confirms_a_refused_connection(
    make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = make_agent(f"http://127.0.0.1:{refused_port()}/-/healthz").probe
    # Nothing listens, so nothing on the other end counts the probes: the prober's probes that
    # ran to their end are counted here (a hedge cancelled unused is not).
    prober = probe.prober
    ended: list[ServeState] = []
    real = prober._probe_in_turn

    async def counted(*args: Any) -> ProbeResult:
        result = await real(*args)
        ended.append(result.state)
        return result

    monkeypatch.setattr(prober, "_probe_in_turn", counted)
    loop = asyncio.get_running_loop()
    started = loop.time()
    confirmed = await probe.probe_once()
    assert confirmed.state is ServeState.NO_PROXY
    # Two probes, confirm_delay apart (uvloop's clock has 1 ms steps: 0.2 may read 0.19999).
    assert ended == [ServeState.NO_PROXY] * 2
    assert loop.time() - started >= CONFIRM_DELAY - TIMER_RESOLUTION

    probe.latest = confirmed
    assert (await probe.probe_once()).state is ServeState.NO_PROXY
    assert ended == [ServeState.NO_PROXY] * 3  # already reported: not confirmed again


async def test_probe_loop_sets_latest_and_signals_changes(
    make_agent: MakeAgent, fake_proxy: FakeServeProxy
) -> None:
    agent = make_agent(fake_proxy.url, interval=0.1, probe_timeout=0.09)
    probe = agent.probe
    # The outbox the probe puts its results in is the one the stream sends from.
    changed = agent.stream.outbox.changed
    task = asyncio.create_task(agent.probe_forever())
    try:
        await asyncio.wait_for(changed.wait(), WAIT)
        assert probe.latest is not None
        assert probe.latest.state is ServeState.SERVING
        changed.clear()
        fake_proxy.set(fakes.DRAINING)
        await asyncio.wait_for(changed.wait(), WAIT)
        assert probe.latest.state is ServeState.DRAINING
        assert probe.latest.reason == "This node is being drained."
        changed.clear()
        requests = fake_proxy.requests
        # Unchanged results keep ``latest`` fresh without signalling a change.
        await eventually(lambda: fake_proxy.requests >= requests + 3, WAIT)
        assert not changed.is_set()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- identity -------------------------------------------------------------------------------


def test_identity_from_environ() -> None:
    identity = SidecarPod.from_environ({**IDENTITY_ENV, "OTHER": "x"})
    assert identity == IDENTITY
    assert str(identity) == "ns/pod-a"


def named_variables(message: str) -> list[str]:
    # Word boundaries keep POD_NAME apart from POD_NAMESPACE.
    return re.findall(r"\b(?:POD_NAMESPACE|POD_NAME|POD_UID|NODE_NAME)\b", message)


@pytest.mark.parametrize(
    "missing",
    [pytest.param([name], id=name) for name in REQUIRED]
    + [
        pytest.param(["POD_NAMESPACE", "POD_NAME"], id="namespace-and-name"),
        pytest.param(["POD_UID", "NODE_NAME"], id="uid-and-node"),
        pytest.param(list(REQUIRED), id="all"),
    ],
)
def test_identity_error_names_exactly_the_missing_variables(missing: list[str]) -> None:
    environ = {key: value for key, value in IDENTITY_ENV.items() if key not in missing}
    with pytest.raises(MissingIdentity) as exc_info:
        SidecarPod.from_environ(environ)
    message = str(exc_info.value)
    assert named_variables(message) == missing
    assert "downward API" in message
    if len(missing) == 1:
        assert f"environment variable {missing[0]} not set" in message
    else:
        assert f"environment variables {', '.join(missing)} not set" in message


@pytest.mark.parametrize("empty", REQUIRED)
def test_identity_empty_variable_counts_as_missing(empty: str) -> None:
    with pytest.raises(MissingIdentity) as exc_info:
        SidecarPod.from_environ({**IDENTITY_ENV, empty: ""})
    assert named_variables(str(exc_info.value)) == [empty]


# -- the CLI as a real process ----------------------------------------------------------------


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without identity or SERVE_HEALTH_* variables, plus ``extra``."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in REQUIRED and not key.startswith("SERVE_HEALTH_")
    }
    environ.update(extra)
    return environ


def test_cli_without_pod_name_exits_2() -> None:
    environ = clean_environ(**{k: v for k, v in IDENTITY_ENV.items() if k != "POD_NAME"})
    completed = subprocess.run(
        [sys.executable, "-m", "node_agent", "--aggregator", "127.0.0.1:1"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr
    assert "serve-health-agent: error:" in completed.stderr
    assert named_variables(completed.stderr) == ["POD_NAME"]


def test_cli_without_aggregator_exits_2() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "node_agent"],
        env=clean_environ(**IDENTITY_ENV),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr
    assert "--aggregator (or SERVE_HEALTH_AGGREGATOR) is required" in completed.stderr


async def test_cli_never_exits_while_the_aggregator_is_away(fake_proxy: FakeServeProxy) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_agent",
        "--aggregator",
        f"127.0.0.1:{refused_port()}",
        "--proxy-url",
        fake_proxy.url,
        "--interval",
        "200ms",
        "--probe-timeout",
        "100ms",
        "--connect-timeout",
        "200ms",
        "--reconnect-max",
        "500ms",
        "--log-level",
        "debug",  # each reconnection is a debug line (one warning says the aggregator is away)
        env=clean_environ(**IDENTITY_ENV),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        reconnects = 0
        async with asyncio.timeout(30):
            while reconnects < 2:
                line = (await process.stderr.readline()).decode()
                assert line, f"agent exited ({process.returncode}):\n{''.join(lines)}"
                lines.append(line)
                reconnects += "reconnecting in" in line
        assert process.returncode is None, "".join(lines)
        # While disconnected it keeps probing its proxy.
        await eventually(lambda: fake_proxy.requests > 0, WAIT)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, rest = await process.communicate()
        lines.append(rest.decode())
        assert process.returncode == 0, "".join(lines)
        assert "agent stopped" in rest.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- against a real aggregator ------------------------------------------------------------


def tracked(aggregator: Any) -> Callable[[], PodRecord | None]:
    return lambda: aggregator.core.pod(KEY)


async def test_aggregator_settings_set_the_resync_interval(
    start_aggregator: StartAggregator, make_agent: MakeAgent, fake_proxy: FakeServeProxy
) -> None:
    aggregator = await start_aggregator(
        kube_backend="memory", heartbeat_interval=0.3, resync_interval=7.0, success_threshold=3
    )
    agent = make_agent(fake_proxy.url, aggregator=f"127.0.0.1:{aggregator.port}")
    stream = agent.stream
    assert stream.full_send_interval == 0.75  # --interval (default) until the aggregator speaks
    assert not stream.on_change
    async with running(agent):
        await asyncio.wait_for(stream.connected.wait(), WAIT)
        # An aggregator of this version wants changes, a resync at its interval (a small
        # fleet: no stretching), and as many reports per change as its largest threshold.
        assert stream.on_change
        assert stream.full_send_interval == pytest.approx(7.0)
        assert agent.stream.outbox.reports_per_change == 3
        assert agent.stream.outbox.reports_per_failure == 1
        record = await eventually(tracked(aggregator), WAIT)
        assert record.uid == "uid-1"
        assert record.node_name == "node-1"
        await eventually(lambda: record.state is ServeState.SERVING, WAIT)
        assert record.agent is not None


async def test_state_change_is_reported_at_once_and_nothing_while_steady(
    start_aggregator: StartAggregator, make_agent: MakeAgent, fake_proxy: FakeServeProxy
) -> None:
    ttl = 1.0
    aggregator = await start_aggregator(
        kube_backend="memory", heartbeat_ttl=ttl, heartbeat_interval=ttl / 2
    )
    assert AggregatorFlags().resync_interval == 30.0  # the default it runs with
    agent = make_agent(
        fake_proxy.url,
        aggregator=f"127.0.0.1:{aggregator.port}",
        interval=0.1,
        probe_timeout=0.09,
        confirm_delay=0.1,
    )
    loop = asyncio.get_running_loop()
    async with running(agent):
        record = await eventually(tracked(aggregator), timeout=WAIT)
        await eventually(lambda: record.state is ServeState.SERVING, timeout=WAIT)
        # The change, then its confirmation (--success-threshold 2), then nothing: the open
        # stream keeps the pod alive past the heartbeat TTL, with no report at all. (Five
        # probes later, the confirmation is in, whether it was owed or not.)
        probed = fake_proxy.requests
        await eventually(lambda: fake_proxy.requests >= probed + 10, timeout=WAIT)
        last_report = record.observed_at
        await eventually(lambda: loop.time() - (last_report or 0) > 2 * ttl, timeout=WAIT)
        assert record.observed_at == last_report
        assert record.state is ServeState.SERVING
        assert aggregator.core.agent_speaks(record, aggregator.core.now())
        fake_proxy.set(fakes.DRAINING)
        flipped = loop.time()
        # At once: with the change, not with the next resync (30 s away). How soon is a figure.
        resync = AggregatorFlags().resync_interval
        await eventually(lambda: record.state is ServeState.DRAINING, timeout=resync / 2)
        assert record.reason == "This node is being drained."
        assert record.http_status == 503
        # The tracker's clock is time.monotonic, as is the loop's.
        print(f"DRAINING {record.state_since - flipped:.3f}s after the proxy said so")
        assert record.state_since - flipped < resync / 2


async def test_resyncs_keep_observed_at_fresh(
    start_aggregator: StartAggregator, make_agent: MakeAgent, fake_proxy: FakeServeProxy
) -> None:
    resync = 0.25
    aggregator = await start_aggregator(kube_backend="memory", resync_interval=resync)
    agent = make_agent(fake_proxy.url, aggregator=f"127.0.0.1:{aggregator.port}")
    async with running(agent):
        record = await eventually(tracked(aggregator), timeout=WAIT)
        await eventually(lambda: record.state is ServeState.SERVING, timeout=WAIT)
        serving_since = record.state_since
        seen: list[float] = []

        def fresh_reports() -> bool:
            if record.observed_at is not None and (not seen or record.observed_at != seen[-1]):
                seen.append(record.observed_at)
            return len(seen) >= 8

        await eventually(fresh_reports, timeout=WAIT)
        assert agent.stream.full_send_interval == resync  # the interval asked for
    gaps = [later - earlier for earlier, later in itertools.pairwise(seen)]
    # Resyncs at the asked interval, not the default 30 s (how regular they are on a loaded
    # machine is a figure).
    print(f"resync gaps: {min(gaps):.3f}s to {max(gaps):.3f}s (asked {resync}s)")
    assert max(gaps) < AggregatorFlags().resync_interval / 2
    assert record.state is ServeState.SERVING
    assert record.state_since == serving_since


async def test_agent_reconnects_and_resends_its_state(
    start_aggregator: StartAggregator, make_agent: MakeAgent, fake_proxy: FakeServeProxy
) -> None:
    first = await start_aggregator(kube_backend="memory")
    port = first.port
    agent = make_agent(
        fake_proxy.url,
        aggregator=f"127.0.0.1:{port}",
        connect_timeout=0.5,
        reconnect_max=0.5,
    )
    async with running(agent):
        await eventually(lambda: (r := first.core.pod(KEY)) and r.state is ServeState.SERVING, WAIT)
        await first.stop()
        await eventually(lambda: not agent.stream.connected.is_set(), WAIT)
        # A new aggregator on the same address, with resyncs far apart: the agent's first
        # report on the new stream must come at once, not with a resync.
        second = await start_aggregator(
            kube_backend="memory",
            listen=f"127.0.0.1:{port}",
            resync_interval=40.0,
        )
        await asyncio.wait_for(agent.stream.connected.wait(), WAIT)
        # At once, not with a resync (40 s away: longer than these waits).
        record = await eventually(lambda: second.core.pod(KEY), timeout=WAIT)
        await eventually(lambda: record.state is ServeState.SERVING, timeout=WAIT)
        assert agent.stream.full_send_interval == 40.0


# -- against a misbehaving aggregator -------------------------------------------------------


class StopsReading(pb_grpc.ReportServiceServicer):
    """Takes the hello, asks for a heartbeat every microsecond, then never reads again.

    With BDP probing off the stream's flow-control window stays small, so the agent's writes
    block within a few hundred reports and its write deadline (connect_timeout) expires: what a
    hung aggregator does to a long-lived stream, sped up.
    """

    def __init__(self) -> None:
        self.streams = 0
        self.release = asyncio.Event()

    async def Report(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> None:
        await context.read()
        self.streams += 1
        interval = Duration()
        interval.FromNanoseconds(1_000)
        await context.write(
            pb.AggregatorMessage(settings=pb.AgentSettings(heartbeat_interval=interval))
        )
        await self.release.wait()


async def test_agent_survives_an_aggregator_that_stops_reading(make_agent: MakeAgent) -> None:
    servicer = StopsReading()
    server = grpc.aio.server(options=[("grpc.http2.bdp_probe", 0)])
    pb_grpc.add_ReportServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # Long reasons make the reports big, so the window fills sooner.
    proxy = await FakeServeProxy(healthz=(503, "not ready " * 25)).start()
    agent = make_agent(
        proxy.url,
        aggregator=f"127.0.0.1:{port}",
        interval=0.1,
        probe_timeout=0.09,
        connect_timeout=0.5,
        reconnect_max=0.2,
    )
    try:
        async with running(agent) as task:

            def reconnected() -> bool:
                if task.done():
                    task.result()  # the agent died: raise what killed it
                    raise AssertionError("Agent.run returned")
                return servicer.streams >= 2

            await eventually(reconnected, timeout=WAIT)
    finally:
        servicer.release.set()
        await proxy.stop()
        await server.stop(0)
