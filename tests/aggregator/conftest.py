from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from aggregator.server import Aggregator
from tests.kube.conftest import kube_emulator, kubeconfig_path

__all__ = ["kube_emulator", "kubeconfig_path"]  # the Kubernetes API emulator of tests/kube


@pytest.fixture
async def channel(aggregator: Aggregator) -> AsyncIterator[grpc.aio.Channel]:
    """A client channel to the ``aggregator`` fixture."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        yield channel
