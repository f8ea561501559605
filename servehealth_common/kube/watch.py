"""List and watch pods; tell the owner what appears, changes and vanishes.

One list, then a watch from the list's resourceVersion, per namespace (or one for all). A watch
that ends (server timeout, dropped connection) resumes from the last resourceVersion seen; a
410 Gone (history compacted) re-lists and reconciles: pods missing from the new list are
deleted. The official client is synchronous, so each watch runs in a daemon thread of its own
and hands events to the event loop.

Used by the aggregator (every Ray pod, to track and label) and by the DaemonSet agent (the Ray
pods of its node, ``spec.nodeName`` field selector, to probe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, Protocol, TypeVar

from servehealth_common.backoff import Backoff
from servehealth_common.kube.client import KubeClient
from servehealth_common.kube.errors import APIError, APIGoneError

log = logging.getLogger(__name__)

_END = object()


class Keyed(Protocol):
    @property
    def key(self) -> Hashable: ...


P = TypeVar("P", bound=Keyed)


@dataclass(eq=False)
class PodWatch(Generic[P]):
    """Pods parsed by ``parse`` go to ``upsert`` (new or changed) and ``delete`` (gone, with
    the last version seen). ``on_restart(reason)`` counts watch restarts: ``ended``, ``gone``
    (410, re-listed) or ``error``. An error ``fatal`` says is one (e.g. a 403 an agent cannot
    fix by retrying) ends :meth:`run` with it instead of being retried."""

    client: KubeClient
    _: KW_ONLY
    namespaces: tuple[str, ...]
    label_selector: str
    parse: Callable[[dict[str, Any]], P]
    upsert: Callable[[P], None]
    delete: Callable[[P], None]
    field_selector: str | None = None
    on_restart: Callable[[str], None] = lambda reason: None
    watch_timeout: int = 300
    fatal: Callable[[APIError], bool] = lambda error: False

    def __post_init__(self) -> None:
        self._scopes: tuple[str | None, ...] = self.namespaces or (None,)
        self._known: dict[str | None, dict[Hashable, P]] = {scope: {} for scope in self._scopes}
        self._versions: dict[str | None, str] = {}
        self._stopping = threading.Event()

    async def run(self) -> None:
        """:meth:`list_all`, then :meth:`watch_forever`."""
        await self.list_all()
        await self.watch_forever()

    async def list_all(self) -> None:
        """The initial list of every scope, retried until it succeeds (whatever the error: an
        API server that does not answer yet, a 5xx, a 403 until RBAC is fixed), with capped
        exponential backoff and full jitter (up to 0.5 s, 1 s, 2 s ... 10 s). Logged as a
        condition: a WARNING when the failures start and when they change (another HTTP
        status, or no answer), each repeat at debug level with its attempt number, and the
        list that succeeds says after how many failed attempts."""
        loop = asyncio.get_running_loop()
        for scope in self._scopes:
            backoff = Backoff(base=0.5, cap=10)
            failures = _ListFailures(f"initial pod list ({self._describe(scope)})", loop.time)
            while True:
                try:
                    await self._relist(scope, failures.ended())
                    break
                except APIError as error:
                    if self.fatal(error):
                        raise
                    delay = backoff.next()
                    failures.failed(error, delay)
                    await asyncio.sleep(delay)

    async def watch_forever(self) -> None:
        async with asyncio.TaskGroup() as group:
            for scope in self._scopes:
                group.create_task(self._watch_scope(scope), name=f"watch-{scope or 'all'}")

    def stop(self) -> None:
        """Let the watch threads end at their next event."""
        self._stopping.set()

    def _describe(self, scope: str | None) -> str:
        where = f"namespace {scope}" if scope else "all namespaces"
        fields = f", fields {self.field_selector!r}" if self.field_selector else ""
        return f"{where}, selector {self.label_selector!r}{fields}"

    async def _relist(self, scope: str | None, after: str = "") -> None:
        items, version = await self.client.list_pods(
            scope, self.label_selector, self.field_selector
        )
        seen: dict[Hashable, P] = {}
        for item in items:
            pod = self.parse(item)
            seen[pod.key] = pod
            self.upsert(pod)
        for key, pod in self._known[scope].items():
            if key not in seen:
                self.delete(pod)
        self._known[scope] = seen
        self._versions[scope] = version
        log.info(
            "listed %d pods (%s) at resourceVersion %s%s",
            len(items),
            self._describe(scope),
            version,
            after,
        )

    async def _watch_scope(self, scope: str | None) -> None:
        backoff = Backoff(base=0.5, cap=10)
        while not self._stopping.is_set():
            try:
                async for event in self._events(scope):
                    self._handle(scope, event)
                    backoff.reset()
                self.on_restart("ended")
            except APIGoneError:
                self.on_restart("gone")
                log.info("watch history expired (410 Gone); re-listing")
                try:
                    await self._relist(scope)
                except APIError as error:
                    if self.fatal(error):
                        raise
                    log.warning("re-list failed: %s", error)
                    await asyncio.sleep(backoff.next())
            except APIError as error:
                if self.fatal(error):
                    raise
                self.on_restart("error")
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
        pod = self.parse(obj)
        known = self._known[scope]
        if kind == "DELETED":
            known.pop(pod.key, None)
            self.delete(pod)
        elif kind in ("ADDED", "MODIFIED"):
            known[pod.key] = pod
            self.upsert(pod)

    def _events(self, scope: str | None) -> AsyncIterator[dict[str, Any]]:
        """Events of one watch request, read by a daemon thread and handed to this loop."""
        version = self._versions.get(scope, "")
        return events_from_thread(
            lambda: self.client.watch_pods(
                scope, self.label_selector, version, self.watch_timeout, self.field_selector
            ),
            self._stopping,
            f"watch-{scope or 'all'}",
        )


async def events_from_thread(
    events: Callable[[], Iterable[Any]], stopping: threading.Event, name: str
) -> AsyncIterator[Any]:
    """What ``events()`` (one watch request) yields, read by a daemon thread named ``name``
    (it never holds up the program's exit; it stops at its next event once ``stopping`` is
    set) and handed to this loop; what it raised is raised here."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def pump() -> None:
        try:
            for event in events():
                if stopping.is_set():
                    break
                post(event)
        except BaseException as error:  # an APIError already (KubeClient wraps), or a bug
            post(error)
        finally:
            post(_END)

    threading.Thread(target=pump, name=name, daemon=True).start()
    while (item := await queue.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        yield item


def _attempts(number: int) -> str:
    return f"{number} failed attempt{'' if number == 1 else 's'}"


class _ListFailures:
    """The failed attempts of one retried list, logged as a condition (client-go's klog
    style): a WARNING when it starts and when it changes, each repeat at debug level."""

    def __init__(self, what: str, clock: Callable[[], float]) -> None:
        self._what, self._clock = what, clock
        self._condition = ""
        self._since = self._started = 0.0
        self._attempts = self._total = 0

    def failed(self, error: APIError, retry_in: float) -> None:
        # What kind of failure it is: its HTTP status, or no answer at all.
        now, condition = self._clock(), (f"HTTP {error.status}" if error.status else "no answer")
        self._total += 1
        if condition == self._condition:
            self._attempts += 1
            log.debug(
                "%s failed again: %s (attempt %d, %s for %.1fs; retrying in %.1fs)",
                self._what,
                error,
                self._total,
                condition,
                now - self._since,
                retry_in,
            )
            return
        was = ""
        if self._condition:
            was = f"; was {self._condition}: {_attempts(self._attempts)} in "
            was += f"{now - self._since:.1f}s"
        else:
            self._started = now
        self._condition, self._since, self._attempts = condition, now, 1
        log.warning(
            "%s failed: %s (attempt %d%s); retrying with backoff, next in %.1fs (logged again "
            "when this changes or ends; each attempt at debug level)",
            self._what,
            error,
            self._total,
            was,
            retry_in,
        )

    def ended(self) -> str:
        """The end of the phrase of a list that succeeds: after how many failures, if any."""
        if not self._total:
            return ""
        elapsed = self._clock() - self._started
        return f", after {_attempts(self._total)} in {elapsed:.1f}s (last: {self._condition})"
