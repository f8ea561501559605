"""The agent's Kubernetes client: the DaemonSet agent's pod watch and a fallback's writes (a
sidecar makes it only when its fallback first has something to write)."""

from __future__ import annotations

from node_agent import __version__
from node_agent.flags import AgentFlags
from servehealth_common.kube.client import KubeClient, load_configuration

USER_AGENT = f"ray-serve-health-agent/{__version__}"
#: Threads for the pod lists (watches run in threads of their own).
KUBE_THREADS = 2


def make_kube_client(settings: AgentFlags) -> KubeClient:
    """The agent's Kubernetes client: ``--kubeconfig``, else ``$KUBECONFIG`` or
    ``~/.kube/config``, else the in-cluster ServiceAccount (the same search as the aggregator's).

    Raises :class:`~servehealth_common.kube.client.NoKubeConfig` without either.
    """
    return KubeClient(
        load_configuration(settings.kubeconfig),
        timeout=settings.kube_timeout,
        concurrency=KUBE_THREADS,
        user_agent=USER_AGENT,
    )
