"""``KubeEmulator.subscribe``: the in-process informer of the test-side controllers (the kubelet
and the EndpointSlice controller, testsupport/kube/kubelet.py and testsupport/kube/endpoints.py)."""

from __future__ import annotations

from testsupport.kube.emulator import PODS, KubeEmulator


async def test_every_committed_change_in_order_and_no_watch(kube_emulator: KubeEmulator) -> None:
    kube = kube_emulator
    queue = kube.subscribe()
    kube.add_pod("default", "a")
    kube.modify_pod("default", "a", labels={"x": "1"})
    kube.modify_pod("default", "a", labels={"x": "1"})  # changes nothing: no change
    kube.delete_pod("default", "a")
    changes = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [c.type for c in changes] == ["ADDED", "MODIFIED", "DELETED"]
    assert all(c.resource == PODS for c in changes)
    versions = [c.rv for c in changes]
    assert versions == sorted(versions)
    assert versions[-1] == int(kube.resource_version)
    assert changes[1].prev is not None
    assert "x" not in changes[1].prev["metadata"]["labels"]
    assert kube.watch_count == 0  # not a watch
    kube.drop_watches()
    kube.unsubscribe(queue)
    kube.add_pod("default", "b")
    assert queue.empty()
    kube.unsubscribe(queue)  # twice is harmless


async def test_peek_objects_reads_the_store_without_copies(kube_emulator: KubeEmulator) -> None:
    kube = kube_emulator
    kube.add_pod("default", "a")
    kube.add_pod("other", "b")
    kube.add_pod("default", "gone")
    kube.delete_pod("default", "gone")
    assert sorted(p["metadata"]["name"] for p in kube.peek_objects(PODS)) == ["a", "b"]
    (pod,) = kube.peek_objects("v1/pods", "default")
    assert pod == kube.pod("default", "a")
