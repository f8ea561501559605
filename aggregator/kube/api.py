"""A thin async adapter over the official (synchronous) ``kubernetes`` client.

Every call runs in a bounded thread pool, never on the event loop, carries a deadline, asks
for raw JSON (no model deserialisation on the hot path) and raises only
:mod:`aggregator.kube.errors`.
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

from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from aggregator.kube.errors import APIError, wrap
from aggregator.tracker import PodKey

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class NoKubeConfig(Exception):
    """Neither a kubeconfig nor an in-cluster ServiceAccount was found."""


def find_config(kubeconfig: str) -> str | None:
    """Which configuration the aggregator would use: a path, ``"in-cluster"``, or None."""
    if kubeconfig:
        return kubeconfig
    env = os.environ.get("KUBECONFIG", "")
    for path in filter(None, env.split(os.pathsep)):
        if Path(path).expanduser().is_file():
            return path
    default = Path("~/.kube/config").expanduser()
    if default.is_file():
        return str(default)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and IN_CLUSTER_TOKEN.is_file():
        return "in-cluster"
    return None


def load_configuration(kubeconfig: str) -> client.Configuration:
    where = find_config(kubeconfig)
    if where is None:
        raise NoKubeConfig(
            "no Kubernetes configuration: pass --kubeconfig, set KUBECONFIG, or run in a pod "
            "with a ServiceAccount"
        )
    configuration = client.Configuration()
    if where == "in-cluster":
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=where, client_configuration=configuration)
    return configuration


class KubeApi:
    """Async calls to the API server; ``concurrency`` threads at most, each call ``timeout``."""

    def __init__(
        self, configuration: client.Configuration, *, timeout: float, concurrency: int
    ) -> None:
        # One connection per request thread, plus the long-lived watches.
        configuration.connection_pool_maxsize = concurrency + 8
        self._client = client.ApiClient(configuration)
        self._client.user_agent = "ray-serve-health"
        self.core = client.CoreV1Api(self._client)
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube-api")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- plumbing -----------------------------------------------------------------------

    def _raw(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=self.timeout, **kwargs
            )
            data = response.data
        except Exception as error:
            raise wrap(error, what) from error
        return json.loads(data) if data else {}

    async def _call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        call = functools.partial(self._raw, what, method, *args, **kwargs)
        return await loop.run_in_executor(self._executor, call)

    # -- pods ---------------------------------------------------------------------------

    async def list_pods(
        self, namespace: str | None, label_selector: str, field_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """All matching pods and the list's resourceVersion (to watch from)."""
        kwargs: dict[str, Any] = {"label_selector": label_selector}
        if field_selector:
            kwargs["field_selector"] = field_selector
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
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": resource_version,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
            "_request_timeout": (self.timeout, timeout_seconds + 10),
        }
        if field_selector:
            kwargs["field_selector"] = field_selector
        try:
            if namespace:
                response = self.core.list_namespaced_pod(namespace, **kwargs)
            else:
                response = self.core.list_pod_for_all_namespaces(**kwargs)
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

    async def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(
            f"create event in {namespace}", self.core.create_namespaced_event, namespace, body
        )
