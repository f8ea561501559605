"""The pods of the aggregator's own namespace, for the leader label
(:class:`aggregator.leader.label.OwnPods`): a JSON merge patch of one label, and a list by
label. Through the leader election's client (its deadline, its two threads): these calls are
rare (when leadership begins or ends), and a Role in the aggregator's namespace is all they need.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from aggregator.kube.api import KubeApi
from aggregator.leader.label import LeaderLabel, LeaderLabelSettings
from servehealth_common.pod_identity import PodKey

log = logging.getLogger(__name__)


def leader_label(
    key: str, api: KubeApi, namespace: str, environ: Mapping[str, str]
) -> LeaderLabel | None:
    """The leader's label ``key`` (--leader-label) on its own pod ``$POD_NAME`` in
    ``namespace`` (the Lease's: the pod's own in a Deployment); None without a key or a pod."""
    if not key:
        return None
    pod = environ.get("POD_NAME", "")
    if not pod:
        log.warning(
            "--leader-label %s: POD_NAME is not set, so the leader labels no pod (a Service "
            "selecting the label would route to no replica); set POD_NAME from the downward "
            "API, or --leader-label '' outside Kubernetes",
            key,
        )
        return None
    return LeaderLabel(KubeOwnPods(api, namespace), LeaderLabelSettings(key, pod))


class KubeOwnPods:
    def __init__(self, api: KubeApi, namespace: str) -> None:
        self._api = api
        self._namespace = namespace

    def describe(self, name: str) -> str:
        return f"{self._namespace}/{name}"

    async def set_label(self, name: str, key: str, value: str | None) -> None:
        # Merge patch: a null value removes the key (and removing an absent one is a no-op).
        await self._api.patch_pod(
            PodKey(self._namespace, name), {"metadata": {"labels": {key: value}}}
        )

    async def labelled(self, key: str, value: str) -> list[str]:
        pods, _ = await self._api.list_pods(self._namespace, f"{key}={value}")
        return [str(pod.get("metadata", {}).get("name", "")) for pod in pods]
