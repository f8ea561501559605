"""A thin async adapter over the official (synchronous) ``kubernetes`` client: the reads.

Every call runs in a bounded thread pool, never on the event loop, carries a deadline, asks
for raw JSON (no model deserialisation on the hot path) and raises only
:mod:`servehealth_common.kube.errors`. :class:`KubeClient` lists, watches and reads pods, and
writes the two things both programs write: a pod's label (JSON merge patch), its condition
(strategic merge patch of ``pods/status``) and Events. The aggregator's ``KubeApi`` adds its
token reviews and Leases on top; the agent writes only in fallback (no aggregator answers).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from servehealth_common.kube.errors import APIError, APIForbiddenError, APIRetryableError, wrap
from servehealth_common.pod_identity import PodKey

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
IN_CLUSTER = "in-cluster"


class NoKubeConfig(Exception):
    """Neither a kubeconfig nor an in-cluster ServiceAccount was found (or it did not load)."""


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and IN_CLUSTER_TOKEN.is_file()


def find_config(kubeconfig: str, *, search: bool = True) -> str | None:
    """Which configuration to use: a path, ``"in-cluster"``, or None.

    ``kubeconfig`` wins; otherwise, with ``search``, ``$KUBECONFIG`` and ``~/.kube/config``;
    then the in-cluster ServiceAccount.
    """
    if kubeconfig:
        return kubeconfig
    if search:
        env = os.environ.get("KUBECONFIG", "")
        for path in filter(None, env.split(os.pathsep)):
            if Path(path).expanduser().is_file():
                return path
        default = Path("~/.kube/config").expanduser()
        if default.is_file():
            return str(default)
    return IN_CLUSTER if in_cluster() else None


def load_configuration(kubeconfig: str, *, search: bool = True) -> client.Configuration:
    """The client configuration :func:`find_config` points at; NoKubeConfig if there is none
    or it does not load."""
    where = find_config(kubeconfig, search=search)
    if where is None:
        hint = "pass --kubeconfig, set KUBECONFIG, or" if search else "pass --kubeconfig, or"
        raise NoKubeConfig(
            f"no Kubernetes configuration: {hint} run in a pod with a ServiceAccount"
        )
    configuration = client.Configuration()
    if where != IN_CLUSTER and not Path(where).expanduser().is_file():
        raise NoKubeConfig(f"the kubeconfig file {where} does not exist (or is not a file)")
    try:
        if where == IN_CLUSTER:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=where, client_configuration=configuration)
    except (config.ConfigException, OSError, ValueError, yaml.YAMLError) as error:
        why = " ".join(str(error).split())[:300] or repr(error)  # one line, whatever it was
        raise NoKubeConfig(f"cannot load the Kubernetes configuration {where}: {why}") from None
    return configuration


#: The plural resource of each noun our calls' descriptions use ("patch pod ns/name status").
_RESOURCES = {"pod": "pods", "pods": "pods", "event": "events", "lease": "leases"}


def verb_and_resource(what: str) -> tuple[str, str]:
    """``"patch pod ns/a status"`` -> ``("patch", "pods/status")``; ``"create a token review"``
    -> ``("create", "tokenreviews")``: the RBAC terms of a call's description."""
    words = what.split()
    verb = {"replace": "update"}.get(words[0], words[0]) if words else "?"
    if "token review" in what:
        return verb, "tokenreviews"
    resource = next((_RESOURCES[word] for word in words[1:3] if word in _RESOURCES), "?")
    if resource == "pods" and words[-1] == "status":
        resource = "pods/status"
    return verb, resource


class KubeClient:
    """Async reads and writes of pods; ``concurrency`` threads at most, each call ``timeout``.

    Watches do not take a pool thread: :meth:`watch_pods` is a blocking generator for a thread
    of the caller's own (see :class:`servehealth_common.kube.watch.PodWatch`).
    """

    def __init__(
        self,
        configuration: client.Configuration,
        *,
        timeout: float,
        concurrency: int,
        user_agent: str = "ray-serve-health",
        on_denied: Callable[[str, str], None] | None = None,
    ) -> None:
        # One connection per request thread, plus the long-lived watches.
        configuration.connection_pool_maxsize = concurrency + 8
        self._client = client.ApiClient(configuration)
        self._client.user_agent = user_agent
        self.core = client.CoreV1Api(self._client)
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube-api")
        #: Told (verb, resource) of every call the API refused with 401/403 (a metric).
        self._on_denied = on_denied
        self._denied_logged: set[tuple[str, str]] = set()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    async def drain(self, within: float) -> bool:
        """Start no more requests, and wait up to ``within`` seconds for those already sent
        (a request cannot be taken back once sent: a leader that steps down waits for its
        writes to land before it gives the Lease up). True if none is left."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        waiting = asyncio.to_thread(self._executor.shutdown, wait=True)
        try:
            await asyncio.wait_for(waiting, within)
        except TimeoutError:
            return False
        return True

    # -- plumbing -----------------------------------------------------------------------

    def _raw(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=self.timeout, **kwargs
            )
            data = response.data
        except Exception as error:
            raise wrap(error, what) from error
        try:
            return json.loads(data) if data else {}
        except ValueError as error:  # a proxy's error page, a truncated answer
            raise APIRetryableError(f"{what}: answer is not JSON: {data[:80]!r}") from error

    async def _call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        call = functools.partial(self._raw, what, method, *args, **kwargs)
        try:
            return await loop.run_in_executor(self._executor, call)
        except APIForbiddenError as error:
            self._denied(what, error)
            raise

    def _denied(self, what: str, error: APIForbiddenError) -> None:
        """401/403: say which verb on which resource, once per pair (later ones at debug
        level: the caller retries or logs its own consequence), and count every one."""
        verb, resource = verb_and_resource(what)
        if self._on_denied is not None:
            self._on_denied(verb, resource)
        if (verb, resource) in self._denied_logged:
            log.debug("the Kubernetes API refused again to %s %s: %s", verb, resource, error)
            return
        self._denied_logged.add((verb, resource))
        log.error(
            "the Kubernetes API refused to %s %s (HTTP %d): this ServiceAccount lacks the "
            "RBAC permission, or its token is not accepted (%s); logged once per verb and "
            "resource",
            verb,
            resource,
            error.status,
            error,
        )

    # -- pods ---------------------------------------------------------------------------

    async def list_pods(
        self, namespace: str | None, label_selector: str, field_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """All matching pods and the list's resourceVersion (to watch from)."""
        kwargs = {"label_selector": label_selector, "field_selector": field_selector or None}
        if namespace:
            body = await self._call(
                f"list pods in {namespace}", self.core.list_namespaced_pod, namespace, **kwargs
            )
        else:
            body = await self._call("list pods", self.core.list_pod_for_all_namespaces, **kwargs)
        return body.get("items") or [], str(body.get("metadata", {}).get("resourceVersion", ""))

    def watch_pods(
        self,
        namespace: str | None,
        label_selector: str,
        resource_version: str,
        timeout_seconds: int,
        field_selector: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Watch events (blocking generator; run it in a thread of its own).

        The server ends the watch after ``timeout_seconds``; the client gives up on a silent
        connection 10 s later.
        """
        what = f"watch pods{' in ' + namespace if namespace else ''}"
        kwargs: dict[str, Any] = {
            "label_selector": label_selector,
            "field_selector": field_selector or None,
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": resource_version,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
            "_request_timeout": (self.timeout, timeout_seconds + 10),
        }
        if namespace:
            yield from _watch_events(what, self.core.list_namespaced_pod, namespace, **kwargs)
        else:
            yield from _watch_events(what, self.core.list_pod_for_all_namespaces, **kwargs)

    # -- the leader election's Lease (the aggregator's, read by agents without a stream) ----

    @functools.cached_property
    def coordination(self) -> client.CoordinationV1Api:
        """``coordination.k8s.io/v1``, on the same connection pool and thread pool."""
        return client.CoordinationV1Api(self._client)

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._call(
            f"get lease {namespace}/{name}",
            self.coordination.read_namespaced_lease,
            name,
            namespace,
        )

    def watch_lease(
        self, namespace: str, name: str, resource_version: str, timeout_seconds: int
    ) -> Iterator[dict[str, Any]]:
        """Watch events of one Lease (field selector ``metadata.name``: RBAC ``watch`` with
        ``resourceNames`` allows it, no ``list`` needed); a blocking generator, as
        :meth:`watch_pods`."""
        yield from _watch_events(
            f"watch lease {namespace}/{name}",
            self.coordination.list_namespaced_lease,
            namespace,
            field_selector=f"metadata.name={name}",
            watch=True,
            resource_version=resource_version or None,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
            _request_timeout=(self.timeout, timeout_seconds + 10),
        )

    async def get_pod(self, key: PodKey) -> dict[str, Any]:
        return await self._call(
            f"get pod {key}", self.core.read_namespaced_pod, key.name, key.namespace
        )

    async def patch_pod(self, key: PodKey, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of the pod."""
        return await self._call(
            f"patch pod {key}",
            self.core.patch_namespaced_pod,
            key.name,
            key.namespace,
            body,
            _content_type=MERGE_PATCH,
        )

    async def patch_pod_status(self, key: PodKey, body: dict[str, Any]) -> dict[str, Any]:
        """Strategic merge patch of ``pods/status``: conditions merge by their ``type``."""
        return await self._call(
            f"patch pod {key} status",
            self.core.patch_namespaced_pod_status,
            key.name,
            key.namespace,
            body,
            _content_type=STRATEGIC_MERGE_PATCH,
        )

    # -- events -------------------------------------------------------------------------

    async def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(
            f"create event in {namespace}", self.core.create_namespaced_event, namespace, body
        )


def _watch_events(what: str, call: Any, *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """The events of one watch request (``call(*args, watch=True, _preload_content=False,
    ...)``), one JSON object a line, until the server ends it; the response is closed and its
    connection released however the caller stops. Errors leave as :class:`APIError`."""
    try:
        response = call(*args, **kwargs)
        try:
            for line in iter_resp_lines(response):
                if line and not line.isspace():
                    yield json.loads(line)
        finally:
            response.close()
            response.release_conn()
    except APIError:
        raise
    except Exception as error:
        raise wrap(error, what) from error
