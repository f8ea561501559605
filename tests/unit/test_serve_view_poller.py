"""The serve view poller (aggregator/pull/serve_view_poller.py) with a scripted HTTP client: a
failing dashboard keeps the last view and is logged once per failure streak; the token file is
read at each poll; and the HTTP client's request headers and larger body cap, on a real server."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from aggregator.decision.serve_view import ServeView
from aggregator.metrics import Metrics
from aggregator.pull.serve_view_poller import ServeViewPoller, ServeViewSettings, dashboard_url
from servehealth_common.http import MAX_BODY_BYTES, HTTPClient, Response
from testsupport.captures import SERVE_APPLICATIONS_HEADONLY

CAPTURED = SERVE_APPLICATIONS_HEADONLY.read_bytes()
CLUSTER = ("ray", "raycluster")
URL = dashboard_url("10.0.0.1", 8265)


class ScriptedClient:
    """Answers each GET with the next of ``answers`` (an exception is raised)."""

    def __init__(self) -> None:
        self.answers: list[Response | BaseException] = []
        self.calls: list[tuple[str, tuple[tuple[str, str], ...], int]] = []

    async def get(
        self, url: str, *, headers: tuple[tuple[str, str], ...] = (), max_body: int = 0
    ) -> Response:
        self.calls.append((url, headers, max_body))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def close(self) -> None:
        pass


def make(
    settings: ServeViewSettings, heads: dict[Any, str | None]
) -> tuple[ServeViewPoller, ScriptedClient, list[Any], Metrics]:
    client, changes, metrics = ScriptedClient(), [], Metrics("test")
    poller = ServeViewPoller(settings, lambda: heads, changes.append, metrics, client)  # type: ignore[arg-type]
    return poller, client, changes, metrics


def polls(metrics: Metrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "serve_health_serve_view_polls_total", {"result": result}
    )
    return value or 0.0


async def test_a_failing_dashboard_keeps_the_last_view(caplog: pytest.LogCaptureFixture) -> None:
    poller, client, changes, metrics = make(ServeViewSettings(dashboard_port=8265), {CLUSTER: URL})
    client.answers = [
        Response(200, CAPTURED),
        Response(200, CAPTURED),  # the same view: no change announced
        ConnectionRefusedError("refused"),
        Response(500, b"Internal Server Error\nmore"),
        Response(200, b"{not json"),
        Response(200, CAPTURED),
    ]
    await poller.poll_all()
    expected = ServeView("HeadOnly", (("192.0.2.2", "HEALTHY"),))
    assert poller.view(CLUSTER) == expected
    assert changes == [CLUSTER]
    await poller.poll_all()
    assert changes == [CLUSTER]
    with caplog.at_level(logging.INFO, logger="aggregator.pull.serve_view_poller"):
        for _ in range(3):
            await poller.poll_all()
            assert poller.view(CLUSTER) == expected
        await poller.poll_all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per failure streak
    assert "refused" in warnings[0]
    assert "keeping its last view" in warnings[0]
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert (polls(metrics, "ok"), polls(metrics, "error")) == (3, 3)
    assert changes == [CLUSTER]
    assert client.calls[0] == (URL, (), 8 * 1024 * 1024)


async def test_the_token_is_read_at_each_poll(tmp_path: Path) -> None:
    token = tmp_path / "token"
    settings = ServeViewSettings(dashboard_port=8265, token_file=str(token))
    poller, client, _, metrics = make(settings, {CLUSTER: URL})
    await poller.poll_all()  # no file yet: nothing sent, counted as a failure
    assert client.calls == []
    assert polls(metrics, "error") == 1
    token.write_text("first\n")
    client.answers = [Response(200, CAPTURED), Response(401, b"Unauthorized")]
    await poller.poll_all()
    token.write_text("second")
    await poller.poll_all()
    assert [headers for _, headers, _ in client.calls] == [
        (("Authorization", "Bearer first"),),
        (("Authorization", "Bearer second"),),
    ]
    assert poller.view(CLUSTER) is not None  # the 401 kept it
    assert polls(metrics, "error") == 2


async def test_clusters_without_a_head_are_not_polled_and_lose_their_view() -> None:
    heads: dict[Any, str | None] = {CLUSTER: URL}
    poller, client, _, _ = make(ServeViewSettings(dashboard_port=8265), heads)
    client.answers = [Response(200, CAPTURED)]
    await poller.poll_all()
    heads[CLUSTER] = None  # the head is being replaced: the view stays
    await poller.poll_all()
    assert poller.view(CLUSTER) is not None
    del heads[CLUSTER]  # no pod of the cluster left
    await poller.poll_all()
    assert poller.view(CLUSTER) is None
    assert len(client.calls) == 1


def test_a_dashboard_url() -> None:
    assert dashboard_url("fd00::1", 8265) == "http://[fd00::1]:8265/api/serve/applications/"


# -- the HTTP client's extras, on a real server --------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(body=json.dumps({"pad": "x" * 10_000}).encode())

    app = web.Application()
    app.router.add_get("/big", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/big", seen
    finally:
        await runner.cleanup()


async def test_the_client_sends_headers_and_reads_a_larger_body(
    server: tuple[str, list[str | None]],
) -> None:
    url, seen = server
    async with HTTPClient() as client:
        small = await client.get(url)
        assert len(small.body) == MAX_BODY_BYTES  # the probes' cap is unchanged
        big = await client.get(url, headers=(("Authorization", "Bearer t"),), max_body=1 << 20)
        assert json.loads(big.body)["pad"] == "x" * 10_000
        again = await client.get(url, max_body=1 << 20)  # a kept-alive connection, no header
        assert json.loads(again.body)["pad"] == "x" * 10_000
    assert seen == [None, "Bearer t", None]
