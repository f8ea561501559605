"""List and watch Ray pods; tell the registry what appears, changes and vanishes.

One list, then a watch from the list's resourceVersion, per namespace (or one for all). A watch
that ends (server timeout, dropped connection) resumes from the last resourceVersion seen; a
410 Gone (history compacted) re-lists and reconciles: pods missing from the new list are
deleted. The official client is synchronous, so each watch runs in a daemon thread of its own
and hands events to the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from aggregator.kube.api import KubeApi
from aggregator.kube.errors import APIError, APIGoneError, wrap
from aggregator.kube.pods import KubePod, parse_pod
from aggregator.metrics import Metrics
from aggregator.tracker import PodKey
from servehealth_common.backoff import Backoff

log = logging.getLogger(__name__)

_END = object()


class Discovery:
    def __init__(
        self,
        api: KubeApi,
        *,
        namespaces: tuple[str, ...],
        selector: str,
        default_port: int,
        metrics: Metrics,
        upsert: Callable[[KubePod], None],
        delete: Callable[[PodKey], None],
        watch_timeout: int = 300,
        field_selector: str | None = None,
    ) -> None:
        self._api = api
        self._scopes: tuple[str | None, ...] = namespaces or (None,)
        self._selector = selector
        self._field_selector = field_selector
        self._default_port = default_port
        self._metrics = metrics
        self._upsert = upsert
        self._delete = delete
        self._watch_timeout = watch_timeout
        self._known: dict[str | None, set[PodKey]] = {scope: set() for scope in self._scopes}
        self._versions: dict[str | None, str] = {}
        self._stopping = threading.Event()

    async def list_all(self) -> None:
        """The initial list of every scope, retried until it succeeds."""
        for scope in self._scopes:
            backoff = Backoff(base=0.5, cap=10)
            while True:
                try:
                    await self._relist(scope)
                    break
                except APIError as error:
                    delay = backoff.next()
                    log.error("initial pod list failed: %s (retrying in %.1fs)", error, delay)
                    await asyncio.sleep(delay)

    async def watch_forever(self) -> None:
        async with asyncio.TaskGroup() as group:
            for scope in self._scopes:
                group.create_task(self._watch_scope(scope), name=f"watch-{scope or 'all'}")

    def stop(self) -> None:
        self._stopping.set()

    async def _relist(self, scope: str | None) -> None:
        items, version = await self._api.list_pods(scope, self._selector, self._field_selector)
        seen: set[PodKey] = set()
        for item in items:
            pod = parse_pod(item, self._default_port)
            seen.add(pod.key)
            self._upsert(pod)
        for key in self._known[scope] - seen:
            self._delete(key)
        self._known[scope] = seen
        self._versions[scope] = version
        log.info(
            "listed %d pods (%s, selector %r) at resourceVersion %s",
            len(items),
            f"namespace {scope}" if scope else "all namespaces",
            self._selector,
            version,
        )

    async def _watch_scope(self, scope: str | None) -> None:
        backoff = Backoff(base=0.5, cap=10)
        while not self._stopping.is_set():
            try:
                async for event in self._events(scope):
                    self._handle(scope, event)
                    backoff.reset()
                self._metrics.watch_restarts.labels("ended").inc()
            except APIGoneError:
                self._metrics.watch_restarts.labels("gone").inc()
                log.info("watch history expired (410 Gone); re-listing")
                try:
                    await self._relist(scope)
                except APIError as error:
                    log.warning("re-list failed: %s", error)
                    await asyncio.sleep(backoff.next())
            except APIError as error:
                self._metrics.watch_restarts.labels("error").inc()
                delay = backoff.next()
                log.warning("pod watch failed: %s (resuming in %.1fs)", error, delay)
                await asyncio.sleep(delay)

    def _handle(self, scope: str | None, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = int(obj.get("code") or 0)
            message = f"watch error {code}: {obj.get('reason')}: {obj.get('message')}"
            raise APIGoneError(message, code) if code == 410 else APIError(message, code)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self._versions[scope] = str(version)
        if kind == "BOOKMARK":
            return
        pod = parse_pod(obj, self._default_port)
        if kind == "DELETED":
            self._known[scope].discard(pod.key)
            self._delete(pod.key)
        elif kind in ("ADDED", "MODIFIED"):
            self._known[scope].add(pod.key)
            self._upsert(pod)

    async def _events(self, scope: str | None) -> AsyncIterator[dict[str, Any]]:
        """Events of one watch request, read by a daemon thread and handed to this loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        version = self._versions.get(scope, "")

        def post(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:
            try:
                for event in self._api.watch_pods(
                    scope, self._selector, version, self._watch_timeout, self._field_selector
                ):
                    if self._stopping.is_set():
                        break
                    post(event)
            except BaseException as error:
                post(wrap_for_loop(error))
            finally:
                post(_END)

        threading.Thread(target=pump, name=f"watch-{scope or 'all'}", daemon=True).start()
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def wrap_for_loop(error: BaseException) -> BaseException:
    try:
        return wrap(error, "watch pods")
    except BaseException as unexpected:
        return unexpected
