"""Smoke: the aggregator's Kubernetes backend against the emulator (discover, report, write)."""

from __future__ import annotations

import pathlib

import grpc

from aggregator.tracker import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from tests.kube.emulator import KubeEmulator
from tests.messages import open_stream, report


async def test_report_turns_label_true(
    kube_emulator: KubeEmulator, kubeconfig_path: pathlib.Path, start_aggregator: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a")
    aggregator = await start_aggregator(kube_backend="kubernetes", kubeconfig=str(kubeconfig_path))
    assert PodKey("default", "pod-a") in aggregator.tracker
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, uid=pod["metadata"]["uid"])
        await call.write(report(1, 1, "success"))
        await call.read()
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "true"
        )
        await call.write(report(3, 2, "This node is being drained."))
        await call.read()
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("ray.io/serve") == "false"
        )
        record = aggregator.tracker.get(PodKey("default", "pod-a"))
        assert record is not None and record.state is ServeState.DRAINING
        await eventually(lambda: len(kube_emulator.events("default")) == 2)
        call.cancel()
