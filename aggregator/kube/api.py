"""The aggregator's Kubernetes API: the shared reads (list and watch pods), plus its writes.

Like the reads in :mod:`servehealth_common.kube.client`, every write runs in the bounded thread
pool, carries a deadline, asks for raw JSON and raises only
:mod:`servehealth_common.kube.errors`.
"""

from __future__ import annotations

import functools
from typing import Any

from kubernetes import client

from servehealth_common.kube.client import KubeClient
from servehealth_common.pod_identity import PodKey

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

    # -- token reviews (agent authentication) -----------------------------------------------

    @functools.cached_property
    def authentication(self) -> client.AuthenticationV1Api:
        """``authentication.k8s.io/v1``, on the same connection pool and thread pool."""
        return client.AuthenticationV1Api(self._client)

    async def review_token(self, token: str, audience: str) -> dict[str, Any]:
        """A TokenReview of ``token`` for ``audience``: the API server's verdict in ``status``
        (an unknown or expired token is a 201 answer with ``authenticated: false``, not an
        error). The token appears in no message of a raised error."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        return await self._call(
            "create a token review", self.authentication.create_token_review, body
        )

    # -- leases (leader election) ----------------------------------------------------------

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

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create a Lease (409 if it exists)."""
        return await self._call(
            f"create lease in {namespace}",
            self.coordination.create_namespaced_lease,
            namespace,
            body,
        )

    async def replace_lease(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """PUT the Lease; conditional on ``body``'s metadata.resourceVersion (409 if stale)."""
        return await self._call(
            f"update lease {namespace}/{name}",
            self.coordination.replace_namespaced_lease,
            name,
            namespace,
            body,
        )
