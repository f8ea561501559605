"""The ``Prober`` against real HTTP servers: one case per row of the classification table, and
the hedged confirmation of a hang.

Every probe goes over real TCP on 127.0.0.1 to a ``FakeServeProxy`` (aiohttp), to a server that
accepts and never answers, to one that hangs up, or to a port with nothing listening. Checks
the state, the HTTP status and the reason of each result, and that a probe that times out does
so at its timeout, not before (how much later it returns is a figure: the bound is only for a
hang). ``probe_confirmed`` on a proxy that leaves the first probe unanswered: a hedge
unanswered too confirms the hang when the first times out (the hedge is cancelled, never
awaited to its own timeout); a hedge that answered counts; a hedge still waiting for a
concurrency slot confirms nothing, nor does one when the first's timeout was seen late (a
stalled event loop, played by a clock that jumps). Which probe's result came back is read from
the Prober's clock (the readings it took), not from wall-clock durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from servehealth_common.http import HTTPClient
from servehealth_common.probe import MAX_BODY_BYTES, Prober, make_session, routes_url
from servehealth_common.states import ServeState
from testsupport import fakes
from testsupport.fakes import FakeServeProxy, refused_port, silent_server

TIMEOUT = 5.0  # generous for a local server that answers, even on a loaded machine
HANG_TIMEOUT = 0.2  # for servers that never answer: the timeout is what is tested
SLACK = 10.0  # how late a timed-out probe may return: only a hang is later
#: uvloop's timers fire on a 1 ms clock: a timeout may end up to 1 ms early.
TIMER_RESOLUTION = 0.002

EMPTY_ROUTES = "No applications are deployed (empty route table)."


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@pytest.fixture
def prober(session: HTTPClient) -> Prober:
    return Prober(session, TIMEOUT)


@pytest.mark.parametrize(
    ("healthz", "routes", "state", "http_status", "reason"),
    [
        pytest.param(
            fakes.HEALTHY, fakes.ROUTES, ServeState.SERVING, 200, "success", id="200-routes"
        ),
        pytest.param(
            fakes.HEALTHY,
            (200, json.dumps({"/a": "app1", "/b": "app2"})),
            ServeState.SERVING,
            200,
            "success",
            id="200-two-routes",
        ),
        pytest.param(
            fakes.HEALTHY,
            fakes.NO_ROUTES,
            ServeState.NOT_READY,
            200,
            EMPTY_ROUTES,
            id="200-empty-routes",
        ),
        pytest.param(
            fakes.DRAINING,
            fakes.ROUTES,
            ServeState.DRAINING,
            503,
            "This node is being drained.",
            id="503-draining",
        ),
        pytest.param(
            fakes.NOT_POPULATED,
            fakes.ROUTES,
            ServeState.NOT_READY,
            503,
            "Route table is not populated yet.",
            id="503-not-populated",
        ),
        pytest.param(
            fakes.NO_REPLICAS,
            fakes.ROUTES,
            ServeState.NOT_READY,
            503,
            "No replicas are available yet.",
            id="503-no-replicas",
        ),
        pytest.param(
            (503, "Service Unavailable"),
            fakes.ROUTES,
            ServeState.NOT_READY,
            503,
            "Service Unavailable (HAProxy: no backend is up).",
            id="503-haproxy-no-backend",
        ),
        pytest.param(
            (503, "upstream connect error"),
            fakes.ROUTES,
            ServeState.NOT_READY,
            503,
            "upstream connect error",
            id="503-other",
        ),
        pytest.param(
            (503, ""), fakes.ROUTES, ServeState.NOT_READY, 503, "HTTP 503", id="503-empty-body"
        ),
        pytest.param(
            (500, "Internal Server Error"),
            fakes.ROUTES,
            ServeState.UNHEALTHY,
            500,
            "HTTP 500: Internal Server Error",
            id="500",
        ),
        pytest.param(
            (404, "Not Found"),
            fakes.ROUTES,
            ServeState.UNHEALTHY,
            404,
            "HTTP 404: Not Found",
            id="404",
        ),
        pytest.param(
            (200, "ok"),
            fakes.ROUTES,
            ServeState.UNHEALTHY,
            200,
            "HTTP 200: ok",
            id="200-other-body",
        ),
        pytest.param(
            fakes.HEALTHY,
            (200, "<html>routes</html>"),
            ServeState.UNHEALTHY,
            200,
            "/-/routes is not JSON: <html>routes</html>",
            id="routes-not-json",
        ),
        pytest.param(
            fakes.HEALTHY,
            fakes.DRAINING,
            ServeState.DRAINING,
            503,
            "This node is being drained.",
            id="routes-503-draining",
        ),
        pytest.param(
            fakes.HEALTHY,
            (500, "boom"),
            ServeState.UNHEALTHY,
            500,
            "HTTP 500: boom",
            id="routes-500",
        ),
        pytest.param(
            fakes.HEALTHY,
            fakes.NOT_POPULATED,
            ServeState.NOT_READY,
            503,
            "Route table is not populated yet.",
            id="routes-503-not-populated",
        ),
    ],
)
async def test_classification_over_http(
    prober: Prober,
    healthz: tuple[int, str],
    routes: tuple[int, str],
    state: ServeState,
    http_status: int,
    reason: str,
) -> None:
    proxy = await FakeServeProxy(healthz=healthz, routes=routes).start()
    try:
        result = await prober.probe(proxy.url)
    finally:
        await proxy.stop()
    assert (result.state, result.http_status, result.reason) == (state, http_status, reason)
    assert result.serving is (state is ServeState.SERVING)
    assert 0 <= result.latency < TIMEOUT
    # /-/routes is asked only to confirm a healthy /-/healthz.
    assert proxy.requests == (2 if healthz == fakes.HEALTHY else 1)


async def test_connection_refused_is_no_proxy(prober: Prober) -> None:
    result = await prober.probe(f"http://127.0.0.1:{refused_port()}/-/healthz")
    assert result.state is ServeState.NO_PROXY
    assert result.http_status == 0
    assert result.reason == "Connection refused: no Serve proxy is listening."
    assert result.latency < TIMEOUT


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://127.0.0.1:8000/-/health z", id="space-in-path"),
        pytest.param("http://" + "x" * 70 + ".invalid:8000/-/healthz", id="label-too-long"),
    ],
)
async def test_an_unusable_url_is_a_failed_probe_not_a_crash(prober: Prober, url: str) -> None:
    # Refused before any connection or name lookup: neither request can be written.
    result = await prober.probe(url)
    assert result.state is ServeState.UNHEALTHY
    assert result.reason.startswith("Probe failed: ")


async def test_stopped_proxy_is_no_proxy(prober: Prober, fake_proxy: FakeServeProxy) -> None:
    assert (await prober.probe(fake_proxy.url)).state is ServeState.SERVING
    await fake_proxy.stop()
    result = await prober.probe(fake_proxy.url)
    assert result.state is ServeState.NO_PROXY
    assert result.http_status == 0


async def test_server_that_never_answers_times_out(session: HTTPClient) -> None:
    server = await silent_server()
    port = server.sockets[0].getsockname()[1]
    try:
        result = await Prober(session, HANG_TIMEOUT).probe(f"http://127.0.0.1:{port}/-/healthz")
    finally:
        server.close()
        await server.wait_closed()
    assert result.state is ServeState.UNHEALTHY
    assert result.http_status == 0
    assert result.reason == "No answer within 200 ms."
    assert HANG_TIMEOUT - TIMER_RESOLUTION <= result.latency < HANG_TIMEOUT + SLACK


async def test_hanging_proxy_times_out(session: HTTPClient) -> None:
    proxy = await FakeServeProxy(hang=True).start()
    try:
        result = await Prober(session, HANG_TIMEOUT).probe(proxy.url)
        assert proxy.requests == 1  # the request reached the proxy, which never answered
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    assert result.http_status == 0
    assert result.reason == "No answer within 200 ms."
    assert HANG_TIMEOUT - TIMER_RESOLUTION <= result.latency < HANG_TIMEOUT + SLACK


@dataclass
class HungRoutesProxy(FakeServeProxy):
    """Answers /-/healthz at once and never answers /-/routes (until stopped)."""

    async def _answer(self, answer: tuple[int, str]) -> web.Response:
        if answer is self.routes:
            await self._release.wait()
        return await super()._answer(answer)


async def test_timeout_is_shared_by_healthz_and_routes(session: HTTPClient) -> None:
    """One timeout bounds the whole probe: a healthy /-/healthz, then a hung /-/routes."""
    proxy = await HungRoutesProxy().start()
    try:
        result = await Prober(session, HANG_TIMEOUT).probe(proxy.url)
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    assert result.reason == "No answer within 200 ms."
    assert HANG_TIMEOUT - TIMER_RESOLUTION <= result.latency < HANG_TIMEOUT + SLACK


async def test_server_that_hangs_up_is_unhealthy(prober: Prober) -> None:
    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await prober.probe(f"http://127.0.0.1:{port}/-/healthz")
    finally:
        server.close()
        await server.wait_closed()
    assert result.state is ServeState.UNHEALTHY
    assert result.http_status == 0
    assert result.reason.startswith("Probe failed: ")
    assert result.latency < TIMEOUT


async def test_garbage_answer_is_unhealthy(prober: Prober) -> None:
    async def garbage(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await prober.probe(f"http://127.0.0.1:{port}/-/healthz")
    finally:
        server.close()
        await server.wait_closed()
    assert result.state is ServeState.UNHEALTHY
    assert result.reason.startswith("Probe failed: ")


async def test_large_body_is_read_partly_and_reason_truncated(prober: Prober) -> None:
    proxy = await FakeServeProxy(healthz=(500, "x" * (MAX_BODY_BYTES * 4))).start()
    try:
        result = await prober.probe(proxy.url)
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    assert result.http_status == 500
    assert result.reason.startswith("HTTP 500: xxx")
    assert len(result.reason.encode()) <= 256


async def test_redirect_is_not_followed(prober: Prober) -> None:
    proxy = await FakeServeProxy(healthz=(302, "")).start()
    try:
        result = await prober.probe(proxy.url)
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    assert result.http_status == 302
    assert proxy.requests == 1


async def test_proxy_state_changes_are_seen_by_the_next_probe(
    prober: Prober, fake_proxy: FakeServeProxy
) -> None:
    for healthz, routes, state in [
        (fakes.NOT_POPULATED, fakes.NO_ROUTES, ServeState.NOT_READY),
        (fakes.HEALTHY, fakes.NO_ROUTES, ServeState.NOT_READY),
        (fakes.HEALTHY, fakes.ROUTES, ServeState.SERVING),
        (fakes.DRAINING, fakes.ROUTES, ServeState.DRAINING),
    ]:
        fake_proxy.set(healthz, routes)
        assert (await prober.probe(fake_proxy.url)).state is state


def test_routes_url() -> None:
    assert routes_url("http://127.0.0.1:8000/-/healthz") == "http://127.0.0.1:8000/-/routes"
    assert routes_url("https://[::1]:8443/-/healthz") == "https://[::1]:8443/-/routes"
    assert routes_url("http://host:8000/-/healthz?x=1") == "http://host:8000/-/routes"


# -- probe_confirmed: the hedged confirmation of a hang --------------------------------------

#: For the hedge tests: the hedge starts CONFIRM_DELAY into the first probe and would time out
#: CONFIRM_DELAY after it, so the event loop may run that late before a test could misread.
HEDGE_TIMEOUT = 1.0
CONFIRM_DELAY = 0.5
#: The Prober's loop_lag_tolerance in these tests: generous for a loaded test machine (the
#: default is 50 ms); the guard itself is tested with a clock that stalls.
LAG_TOLERANCE = 0.4


@dataclass
class HangsFirst(FakeServeProxy):
    """Leaves its first ``unanswered`` requests hanging (until stopped) and answers the rest."""

    unanswered: int = 1
    arrived: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def _answer(self, answer: tuple[int, str]) -> web.Response:
        self.hang = self.requests < self.unanswered
        self.arrived.set()
        return await super()._answer(answer)


@dataclass
class RecordingClock:
    """``time.monotonic`` that keeps every reading: a probe reads it when it starts and when
    it ends, so the readings say which probes ended on their own. From reading number
    ``stall_from`` on, every reading is ``stall`` seconds later (an event loop that stalled)."""

    stall_from: int | None = None
    stall: float = 0.0
    readings: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        stalled = self.stall_from is not None and len(self.readings) >= self.stall_from
        self.readings.append(time.monotonic() + (self.stall if stalled else 0.0))
        return self.readings[-1]


def hedging_prober(session: HTTPClient, clock: RecordingClock | None = None) -> Prober:
    return Prober(
        session, HEDGE_TIMEOUT, clock or RecordingClock(), loop_lag_tolerance=LAG_TOLERANCE
    )


def running_probes() -> list[asyncio.Task[object]]:
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and "Prober." in getattr(task.get_coro(), "__qualname__", "")
    ]


async def test_a_hang_is_confirmed_by_an_unanswered_hedge_after_one_timeout(
    session: HTTPClient,
) -> None:
    clock = RecordingClock()
    proxy = await FakeServeProxy(hang=True).start()
    try:
        result = await hedging_prober(session, clock).probe_confirmed(
            proxy.url, ServeState.SERVING, CONFIRM_DELAY
        )
        assert running_probes() == []  # the hedge was cancelled before the call returned
        assert proxy.requests == 2  # both probes asked, neither was answered
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    assert result.reason == "No answer within 1000 ms."
    # Three readings: the first probe's start, the hedge's start, the first probe's end. The
    # hedge never ended on its own (its timeout was not waited for): the result is the first's.
    assert len(clock.readings) == 3
    first_started, hedge_started, first_ended = clock.readings
    assert result.latency == first_ended - first_started
    assert hedge_started < first_ended


@pytest.mark.parametrize(
    "previous",
    [
        pytest.param(ServeState.SERVING, id="serving-stays-serving"),
        pytest.param(ServeState.NOT_READY, id="not-ready-becomes-serving"),
    ],
)
async def test_a_hedge_that_answered_healthy_counts(
    session: HTTPClient, previous: ServeState
) -> None:
    clock = RecordingClock()
    proxy = await HangsFirst().start()
    try:
        result = await hedging_prober(session, clock).probe_confirmed(
            proxy.url, previous, CONFIRM_DELAY
        )
    finally:
        await proxy.stop()
    # The first probe timed out; the hedge had answered (healthz and routes) before that.
    assert result.state is ServeState.SERVING
    assert proxy.requests == 3
    assert len(clock.readings) == 4  # both probes ended on their own


async def test_a_hedge_that_answered_a_failure_counts(session: HTTPClient) -> None:
    proxy = await HangsFirst(healthz=fakes.DRAINING).start()
    try:
        result = await hedging_prober(session).probe_confirmed(
            proxy.url, ServeState.SERVING, CONFIRM_DELAY
        )
    finally:
        await proxy.stop()
    assert result.state is ServeState.DRAINING
    assert result.reason == "This node is being drained."


async def test_a_hedge_waiting_for_a_slot_confirms_nothing(session: HTTPClient) -> None:
    """With one slot the hedge starts only when the first probe's timeout frees it: then it
    has been asked nothing yet, so its own answer (here its own timeout) is awaited."""
    clock = RecordingClock()
    proxy = await FakeServeProxy(hang=True).start()
    try:
        prober = Prober(session, HANG_TIMEOUT, clock, concurrency=1)
        result = await prober.probe_confirmed(proxy.url, ServeState.SERVING, HANG_TIMEOUT / 2)
        assert proxy.requests == 2
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    # Four readings: the first probe's start and end, then the hedge's start and end.
    assert len(clock.readings) == 4
    first_ended, hedge_started, hedge_ended = clock.readings[1:]
    assert first_ended <= hedge_started
    assert result.latency == hedge_ended - hedge_started


async def test_a_timeout_seen_late_confirms_nothing(session: HTTPClient) -> None:
    """The first probe's timeout is seen a second late (the clock jumps at its third reading,
    the first probe's end): the loop was busy, answers may have waited unread, so the hedge
    gets its own timeout and its result counts."""
    clock = RecordingClock(stall_from=2, stall=1.0)
    proxy = await FakeServeProxy(hang=True).start()
    try:
        result = await hedging_prober(session, clock).probe_confirmed(
            proxy.url, ServeState.SERVING, CONFIRM_DELAY
        )
    finally:
        await proxy.stop()
    assert result.state is ServeState.UNHEALTHY
    # Four readings: the first's start, the hedge's start, the first's end, the hedge's end.
    assert len(clock.readings) == 4
    _, hedge_started, _, hedge_ended = clock.readings
    assert result.latency == hedge_ended - hedge_started


async def test_a_cancelled_confirmation_leaves_no_probe_running(session: HTTPClient) -> None:
    proxy = await HangsFirst(unanswered=2).start()
    try:
        prober = Prober(session, 30.0)  # no timeout ends a probe during the test
        confirming = asyncio.create_task(
            prober.probe_confirmed(proxy.url, ServeState.SERVING, 30.0)
        )
        await proxy.arrived.wait()
        confirming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await confirming
        assert confirming.cancelled()
        assert running_probes() == []
    finally:
        await proxy.stop()
