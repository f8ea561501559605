"""The aggregator's Kubernetes API: the shared reads (list and watch pods), plus its writes.

Like the reads in :mod:`servehealth_common.kube.client`, every write runs in the bounded thread
pool, carries a deadline, asks for raw JSON and raises only
:mod:`servehealth_common.kube.errors`.
"""

from __future__ import annotations

from typing import Any

from aggregator.tracker import PodKey
from servehealth_common.kube.client import KubeClient

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeApi(KubeClient):
    """Reads and writes of the aggregator; ``concurrency`` threads at most, each call
    ``timeout``."""

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
