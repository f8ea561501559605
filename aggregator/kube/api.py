"""The aggregator's Kubernetes API: the shared calls (list, watch, get and write pods, create
Events: :mod:`servehealth_common.kube.client`, which the agent's fallback writes use too), plus
its own: token reviews and Leases.

Like the shared calls, each runs in the bounded thread pool, carries a deadline, asks for raw
JSON and raises only :mod:`servehealth_common.kube.errors`.
"""

from __future__ import annotations

import functools
from typing import Any

from kubernetes import client

from servehealth_common.kube.client import KubeClient


class KubeApi(KubeClient):
    """The shared calls of :class:`KubeClient`, plus the aggregator's token reviews and Leases;
    ``concurrency`` threads at most, each call ``timeout``."""

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

    # (coordination and get_lease: the agents read the Lease too, :class:`KubeClient`.)

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
