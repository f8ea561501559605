"""Fixtures for the Kubernetes side: the API emulator over real HTTP and official clients of it.

- ``kube_emulator``: a running :class:`~testsupport.kube.emulator.KubeEmulator` (kmock) on
  127.0.0.1.
- ``kube_api_client``: a ``kubernetes.client.ApiClient`` pointing at it (no auth).
- ``core_v1``: ``kubernetes.client.CoreV1Api`` on that client.
- ``kubeconfig_path``: a kubeconfig file pointing at it, for ``--kubeconfig PATH``.

The official client is synchronous: call it from async tests with ``asyncio.to_thread``, since
the emulator serves on the test's own event loop.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kmock
import kubernetes
import pytest

from aggregator.server import Aggregator
from tests.conftest import StartAggregator
from testsupport.kube.emulator import KubeEmulator


@pytest.fixture
async def kube_emulator() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as emulator, kmock.Server(emulator):
        try:
            yield emulator
        finally:
            await emulator.close()


@pytest.fixture
def kube_api_client(kube_emulator: KubeEmulator) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.client.ApiClient(kube_emulator.client_configuration())
    try:
        yield client
    finally:
        client.close()
        client.rest_client.pool_manager.clear()


@pytest.fixture
def core_v1(kube_api_client: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(kube_api_client)


@pytest.fixture
def kubeconfig_path(kube_emulator: KubeEmulator, tmp_path: pathlib.Path) -> pathlib.Path:
    return kube_emulator.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def start_kube(kubeconfig_path: pathlib.Path, start_aggregator: StartAggregator) -> StartAggregator:
    """Start an aggregator on the emulator: ``await start_kube(clock=..., **settings)``.

    The emulator is set up first (``kubeconfig_path`` before ``start_aggregator``), so that it
    is torn down last: an emulator closed under a running aggregator sees its watch come back,
    and waits for it (aiohttp's 60 s shutdown timeout).
    """

    async def start(**overrides: Any) -> Aggregator:
        settings = {"kube_backend": "kubernetes", "kubeconfig": str(kubeconfig_path), **overrides}
        return await start_aggregator(**settings)

    return start
