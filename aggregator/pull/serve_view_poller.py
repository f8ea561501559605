"""Asks each Ray cluster's dashboard where its Serve controller runs proxies.

Every ``interval`` (and at once when a cluster's head appears or moves), one ``GET
http://<head pod IP>:<dashboard port>/api/serve/applications/`` per cluster, all concurrently,
each with a deadline, over the project's small HTTP client. The answer becomes a
:class:`~aggregator.decision.serve_view.ServeView` (the pure half); a view that differs from the
last one is kept and announced (``on_change``), so that the pods of that cluster are judged again.

A dashboard that fails (unreachable, 401 without the right token, a broken answer) keeps the
last view it gave: a hiccup never makes a pod flap between NO_PROXY and NO_PROXY_BY_DESIGN. It
is logged once per cluster when it starts failing (and when it answers again), and every poll
is counted (``serve_health_serve_view_polls_total{result}``). A cluster whose head is not known
has no view: its pods' NO_PROXY stays NO_PROXY.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aggregator.decision.serve_view import BadView, ServeView, parse_view
from aggregator.metrics import Metrics
from servehealth_common.http import HTTPClient, HTTPClientError

log = logging.getLogger(__name__)

PATH = "/api/serve/applications/"
#: A Ray cluster: its namespace and its name (KubeRay's ``ray.io/cluster`` label).
ClusterKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class ServeViewSettings:
    #: The dashboard's port on heads with no container port named "dashboard"; 0: no polling.
    dashboard_port: int = 0
    interval: float = 10.0
    #: Deadline of one GET (connect, send, the whole answer).
    timeout: float = 2.0
    #: A file holding the dashboard's token (Ray's token authentication), read at each poll
    #: and sent as ``authorization: Bearer``; empty: none.
    token_file: str = ""
    #: The largest answer read; a longer one is a failure (it lists every application).
    max_body: int = 8 * 1024 * 1024

    @property
    def enabled(self) -> bool:
        return self.dashboard_port > 0


def dashboard_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{PATH}"


class ServeViewPoller:
    """``heads()`` gives the dashboard URL of each cluster with pods (None: its head is not
    known); ``on_change(cluster)`` is called when that cluster's view changed."""

    def __init__(
        self,
        settings: ServeViewSettings,
        heads: Callable[[], Mapping[ClusterKey, str | None]],
        on_change: Callable[[ClusterKey], None],
        metrics: Metrics,
        client: HTTPClient | None = None,
    ) -> None:
        self.settings = settings
        self._heads = heads
        self._on_change = on_change
        self._polls = metrics.serve_view_polls
        self._client = client or HTTPClient(max_idle_per_host=1)
        self._views: dict[ClusterKey, ServeView] = {}
        self._urls: dict[ClusterKey, str] = {}  # polled in the last round
        self._failing: dict[ClusterKey, str] = {}  # cluster -> why, while it fails
        self._token_failing = False
        self._wake = asyncio.Event()

    def view(self, cluster: ClusterKey) -> ServeView | None:
        """The last view ``cluster``'s dashboard gave (None: never, or no such cluster)."""
        return self._views.get(cluster)

    def head_seen(self, cluster: ClusterKey, url: str | None) -> None:
        """A head pod was seen: poll now if its dashboard's URL is new."""
        if url is not None and self._urls.get(cluster) != url:
            self._wake.set()

    async def run(self) -> None:
        """Poll every interval (sooner when a new head appears) until cancelled."""
        try:
            while True:
                self._wake.clear()
                await self.poll_all()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.interval):
                        await self._wake.wait()
        finally:
            await self._client.close()

    async def poll_all(self) -> None:
        """One round: every cluster's dashboard, concurrently; views of clusters with no pods
        left are dropped."""
        heads = dict(self._heads())
        for gone in [cluster for cluster in self._views if cluster not in heads]:
            del self._views[gone]
            self._failing.pop(gone, None)
        self._urls = {cluster: url for cluster, url in heads.items() if url is not None}
        if not self._urls:
            return
        token = self._token()
        if token is False:
            self._polls.labels("error").inc(len(self._urls))
            return
        await asyncio.gather(
            *(self._poll(cluster, url, token) for cluster, url in self._urls.items())
        )

    def _token(self) -> str | Literal[False] | None:
        """The token to send (None: none), or False when its file cannot be read."""
        path = self.settings.token_file
        if not path:
            return None
        try:
            token = Path(path).read_text().strip()
        except OSError as error:
            if not self._token_failing:
                log.warning("serve view: cannot read --ray-dashboard-token-file: %s", error)
            self._token_failing = True
            return False
        if self._token_failing:
            log.info("serve view: --ray-dashboard-token-file is readable again")
            self._token_failing = False
        return token

    async def _poll(self, cluster: ClusterKey, url: str, token: str | None) -> None:
        try:
            view = await self._fetch(url, token)
        except (OSError, HTTPClientError, TimeoutError, BadView, ValueError) as error:
            self._polls.labels("error").inc()
            if cluster not in self._failing:  # logged when it starts failing
                why = self._failing[cluster] = str(error) or type(error).__name__
                kept = "keeping its last view" if cluster in self._views else "no view yet"
                log.warning(
                    "serve view of cluster %s/%s: GET %s failed (%s); %s", *cluster, url, why, kept
                )
            return
        self._polls.labels("ok").inc()
        if self._failing.pop(cluster, None) is not None:
            log.info("serve view of cluster %s/%s: %s answers again", *cluster, url)
        if self._views.get(cluster) != view:
            self._views[cluster] = view
            log.info(
                "serve view of cluster %s/%s: proxy_location %s, proxies %s",
                *cluster,
                view.proxy_location,
                ", ".join(f"{ip} {status}" for ip, status in view.proxies) or "none",
            )
            self._on_change(cluster)

    async def _fetch(self, url: str, token: str | None) -> ServeView:
        headers = (("Authorization", f"Bearer {token}"),) if token else ()
        max_body = self.settings.max_body
        async with asyncio.timeout(self.settings.timeout):
            response = await self._client.get(url, headers=headers, max_body=max_body)
        if response.status != 200:
            first_line = response.body[:200].decode("utf-8", "replace").splitlines()[:1]
            raise HTTPClientError(f"HTTP {response.status} {''.join(first_line)}".rstrip())
        if len(response.body) >= max_body:
            raise HTTPClientError(f"answer longer than {max_body} bytes")
        document = await asyncio.to_thread(json.loads, response.body)
        return parse_view(document)
