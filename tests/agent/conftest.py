"""Fixtures for the agent's tests: the Kubernetes API emulator of ``tests/kube`` (kmock over real
HTTP, and a kubeconfig file pointing at it), for the DaemonSet agent."""

from tests.kube.conftest import kube_emulator, kubeconfig_path

__all__ = ["kube_emulator", "kubeconfig_path"]
