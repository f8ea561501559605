"""The Kubernetes API emulator against the documented API semantics, through the official client.

Covers every extension of kmock's emulator in ``testsupport/kube/emulator.py``: label and field
selectors, resourceVersion ordering, watches (resume from a resourceVersion, 410 Expired after
compaction, selector transitions, timeouts, bookmarks, dropped connections), strategic/JSON merge
and JSON patches of labels, the pod ``status`` subresource with conditions merged by type, 409 on
a stale resourceVersion, 404 Status bodies, events (v1 and events.k8s.io/v1), leases, issued
ServiceAccount tokens and their TokenReviews, the fault helpers built on kmock's DSL, request
accounting, the store helpers and the kubeconfig fixture. All calls go over real HTTP on
127.0.0.1 through ``kubernetes.client``, run in threads because the client is synchronous and
the emulator serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import pathlib
from typing import Any

import kubernetes
import pytest
import urllib3
from kubernetes import watch
from kubernetes.client import ApiException

from servehealth_common.tokens import jwt_claims
from testsupport.kube.emulator import (
    LEASES,
    POD_MERGE_KEYS,
    PODS,
    TOKENREVIEWS,
    ApiCall,
    KubeEmulator,
    SelectorError,
    json_merge_patch,
    labels_match,
    make_pod,
    node_uid,
    parse_label_selector,
    peak_count,
    status_body,
    strategic_merge_patch,
)

CoreV1 = kubernetes.client.CoreV1Api
MERGE_PATCH = "application/merge-patch+json"


def _names(pod_list: Any) -> list[str]:
    return sorted(pod.metadata.name for pod in pod_list.items)


def _collect(func: Any, count: int, **kwargs: Any) -> list[dict[str, Any]]:
    """In a thread: the first ``count`` events of ``Watch().stream(func, ...)``, or fewer if the
    server ends the watch first (only with ``timeout_seconds``: the client re-watches otherwise)."""
    stream = watch.Watch()
    events: list[dict[str, Any]] = []
    for event in stream.stream(func, _request_timeout=10, **kwargs):
        events.append(event)
        if len(events) >= count:
            stream.stop()
            break
    return events


def _summary(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(event["type"], event["raw_object"]["metadata"].get("name", "")) for event in events]


async def _watching(kube: KubeEmulator, func: Any, count: int, **kwargs: Any) -> asyncio.Task[Any]:
    """Start collecting in a thread and return once the watch is established at the server."""
    before = kube.watch_count
    task = asyncio.ensure_future(asyncio.to_thread(_collect, func, count, **kwargs))
    await kube.wait_for_watches(before + 1)
    return task


def _status_of(error: ApiException) -> dict[str, Any]:
    return json.loads(error.body)


@pytest.fixture
def ray_pods(kube_emulator: KubeEmulator) -> None:
    kube_emulator.add_pod(
        "ray", "a", labels={"ray.io/node-type": "head", "ray.io/serve": "true"}, node_name="node-1"
    )
    kube_emulator.add_pod(
        "ray", "b", labels={"ray.io/node-type": "worker", "ray.io/serve": "false"}
    )
    kube_emulator.add_pod("ray", "c", labels={"ray.io/node-type": "worker"}, node_name="node-2")
    kube_emulator.add_pod("other", "d", labels={"app": "other"}, node_name="node-2")


# ---- label and field selectors ---------------------------------------------------------------


@pytest.mark.usefixtures("ray_pods")
@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        pytest.param("ray.io/node-type", ["a", "b", "c"], id="exists"),
        pytest.param("!ray.io/node-type", ["d"], id="not-exists"),
        pytest.param("ray.io/node-type=worker", ["b", "c"], id="equals"),
        pytest.param("ray.io/node-type==worker", ["b", "c"], id="double-equals"),
        pytest.param("ray.io/node-type!=worker", ["a", "d"], id="not-equals-includes-absent"),
        pytest.param("ray.io/serve in (true,false)", ["a", "b"], id="in"),
        pytest.param("ray.io/serve notin (true)", ["b", "c", "d"], id="notin-includes-absent"),
        pytest.param("ray.io/node-type=worker,ray.io/serve", ["b"], id="and"),
        pytest.param(" ray.io/node-type = worker , !ray.io/serve ", ["c"], id="spaces-and-not"),
        pytest.param("", ["a", "b", "c", "d"], id="empty-selects-all"),
    ],
)
async def test_label_selectors_filter_lists(core_v1: CoreV1, selector: str, expected: list[str]):
    pods = await asyncio.to_thread(core_v1.list_pod_for_all_namespaces, label_selector=selector)
    assert _names(pods) == expected


@pytest.mark.parametrize(
    "selector", ["a=(b", "a in ()", "a,,b", "=b", "a in (b", "a b", "a=b=c", "a > x", "-a"]
)
async def test_invalid_label_selector_is_400(core_v1: CoreV1, selector: str) -> None:
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.list_pod_for_all_namespaces, label_selector=selector)
    assert raised.value.status == 400
    assert _status_of(raised.value)["reason"] == "BadRequest"


def test_label_selector_numeric_and_empty_values() -> None:
    assert labels_match(parse_label_selector("n>3,n<10"), {"n": "5"})
    assert not labels_match(parse_label_selector("n>3"), {"n": "abc"})
    assert not labels_match(parse_label_selector("n>3"), {})
    assert labels_match(parse_label_selector("k="), {"k": ""})
    assert not labels_match(parse_label_selector("k="), {})
    with pytest.raises(SelectorError):
        parse_label_selector("a,")


@pytest.mark.usefixtures("ray_pods")
@pytest.mark.parametrize(
    ("fields", "labels", "expected"),
    [
        pytest.param("spec.nodeName=node-1", None, ["a", "b"], id="node"),
        pytest.param("spec.nodeName==node-2", None, ["c", "d"], id="node-double-equals"),
        pytest.param("spec.nodeName!=node-1", None, ["c", "d"], id="node-not"),
        pytest.param("metadata.name=c", None, ["c"], id="name"),
        pytest.param("metadata.namespace=other", None, ["d"], id="namespace"),
        pytest.param("spec.nodeName=node-2", "ray.io/node-type", ["c"], id="with-labels"),
        pytest.param("status.phase=Running,metadata.name!=a", None, ["b", "c", "d"], id="and"),
    ],
)
async def test_field_selectors_filter_lists(
    core_v1: CoreV1, fields: str, labels: str | None, expected: list[str]
) -> None:
    pods = await asyncio.to_thread(
        core_v1.list_pod_for_all_namespaces, field_selector=fields, label_selector=labels
    )
    assert _names(pods) == expected


async def test_unsupported_field_selector_is_400(core_v1: CoreV1) -> None:
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.list_pod_for_all_namespaces, field_selector="spec.foo=x")
    assert raised.value.status == 400
    assert "field label not supported" in _status_of(raised.value)["message"]


@pytest.mark.usefixtures("ray_pods")
async def test_namespaced_list_and_pagination(core_v1: CoreV1) -> None:
    pods = await asyncio.to_thread(core_v1.list_namespaced_pod, "ray", label_selector="ray.io")
    assert _names(pods) == []
    pods = await asyncio.to_thread(core_v1.list_namespaced_pod, "ray")
    assert _names(pods) == ["a", "b", "c"]

    first = await asyncio.to_thread(core_v1.list_pod_for_all_namespaces, limit=3)
    assert len(first.items) == 3
    assert first.metadata.remaining_item_count == 1
    rest = await asyncio.to_thread(
        core_v1.list_pod_for_all_namespaces, limit=3, _continue=first.metadata.var_continue
    )
    assert rest.metadata.var_continue is None
    assert sorted(p.metadata.name for p in first.items + rest.items) == ["a", "b", "c", "d"]
    assert rest.metadata.resource_version == first.metadata.resource_version


# ---- resourceVersion -----------------------------------------------------------------------


async def test_every_write_bumps_the_resource_version(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    first = kube_emulator.add_pod("ray", "a")
    second = kube_emulator.add_pod("ray", "b")
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    listed = await asyncio.to_thread(core_v1.list_namespaced_pod, "ray")
    assert listed.metadata.resource_version == second["metadata"]["resourceVersion"]
    assert [p.metadata.resource_version for p in listed.items] == [
        first["metadata"]["resourceVersion"],
        second["metadata"]["resourceVersion"],
    ]
    assert listed.items[0].metadata.uid == first["metadata"]["uid"]

    patched = await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "a", "ray", {"metadata": {"labels": {"x": "1"}}}
    )
    assert int(patched.metadata.resource_version) > int(listed.metadata.resource_version)
    relisted = await asyncio.to_thread(core_v1.list_namespaced_pod, "ray")
    assert relisted.metadata.resource_version == patched.metadata.resource_version
    assert kube_emulator.resource_version == patched.metadata.resource_version

    with pytest.raises(ApiException) as raised:  # a list from the future: "too large"
        await asyncio.to_thread(core_v1.list_namespaced_pod, "ray", resource_version="999")
    assert raised.value.status == 504


async def test_noop_patch_keeps_resource_version_and_emits_no_event(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    pod = kube_emulator.add_pod("ray", "a", labels={"ray.io/serve": "true"})
    rv = pod["metadata"]["resourceVersion"]
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        1,
        resource_version=rv,
        timeout_seconds=5,
    )
    same = await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "a", "ray", {"metadata": {"labels": {"ray.io/serve": "true"}}}
    )
    assert same.metadata.resource_version == rv
    kube_emulator.modify_pod("ray", "a", labels={"other": "change"})
    events = await task
    # The first event the watch sees is the later, real change: the no-op emitted nothing.
    assert events[0]["raw_object"]["metadata"]["labels"]["other"] == "change"


# ---- watches --------------------------------------------------------------------------------


async def test_watch_from_resource_version_streams_later_changes_in_order(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "before")
    listed = await asyncio.to_thread(core_v1.list_pod_for_all_namespaces)
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        4,
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    )
    kube_emulator.add_pod("ray", "new")
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "new", "ray", {"metadata": {"labels": {"a": "b"}}}
    )
    kube_emulator.modify_pod("ray", "before", pod_ip="127.0.0.9")
    kube_emulator.delete_pod("ray", "new")
    events = await task
    assert _summary(events) == [
        ("ADDED", "new"),
        ("MODIFIED", "new"),
        ("MODIFIED", "before"),
        ("DELETED", "new"),
    ]
    versions = [int(event["object"].metadata.resource_version) for event in events]
    assert versions == sorted(versions)
    assert len(set(versions)) == 4
    assert versions[0] > int(listed.metadata.resource_version)
    assert events[1]["object"].metadata.labels["a"] == "b"
    assert events[2]["object"].status.pod_ip == "127.0.0.9"


async def test_watch_without_resource_version_replays_current_objects_first(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    kube_emulator.add_pod("ray", "b")
    task = await _watching(
        kube_emulator, core_v1.list_namespaced_pod, 3, namespace="ray", timeout_seconds=5
    )
    kube_emulator.add_pod("ray", "c")
    assert _summary(await task) == [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c")]


async def test_watch_with_selectors_sees_objects_enter_and_leave_the_selection(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    """An object that stops matching arrives as DELETED (its previous content, the change's
    resourceVersion); one that starts matching as ADDED; other changes are not sent."""
    kube_emulator.add_pod("ray", "a", labels={"ray.io/node-type": "worker"})
    kube_emulator.add_pod("ray", "x", labels={"app": "x"})
    rv = kube_emulator.resource_version
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        4,
        resource_version=rv,
        label_selector="ray.io/node-type",
        field_selector="spec.nodeName=node-1",
        timeout_seconds=5,
    )
    kube_emulator.modify_pod("ray", "x", labels={"unrelated": "1"})  # never matched: not sent
    kube_emulator.modify_pod("ray", "a", labels={"ray.io/node-type": None})  # leaves
    gone_rv = kube_emulator.resource_version
    kube_emulator.modify_pod("ray", "x", labels={"ray.io/node-type": "worker"})  # enters
    kube_emulator.modify_pod("ray", "x", node_name="node-2")  # leaves through the field
    kube_emulator.modify_pod("ray", "a", labels={"ray.io/node-type": "head"})  # enters again
    events = await task
    assert _summary(events) == [("DELETED", "a"), ("ADDED", "x"), ("DELETED", "x"), ("ADDED", "a")]
    assert events[0]["raw_object"]["metadata"]["labels"] == {"ray.io/node-type": "worker"}
    assert events[0]["raw_object"]["metadata"]["resourceVersion"] == gone_rv


async def test_watch_from_compacted_resource_version_is_410_expired(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    old_rv = kube_emulator.resource_version
    kube_emulator.modify_pod("ray", "a", labels={"x": "1"})
    kube_emulator.compact()

    # On the wire: HTTP 200 and one ERROR event with a Status 410 Expired, then the end.
    response = await asyncio.to_thread(
        core_v1.list_pod_for_all_namespaces,
        watch=True,
        resource_version=old_rv,
        _preload_content=False,
    )
    assert response.status == 200
    lines = (await asyncio.to_thread(response.read)).decode().splitlines()
    response.release_conn()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["type"] == "ERROR"
    assert event["object"]["kind"] == "Status"
    assert event["object"]["code"] == 410
    assert event["object"]["reason"] == "Expired"

    # Through the client's Watch: ApiException(410), which is the cue to re-list.
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(
            _collect,
            core_v1.list_pod_for_all_namespaces,
            1,
            resource_version=old_rv,
            timeout_seconds=5,
        )
    assert raised.value.status == 410

    # The current resourceVersion is still fine to watch from.
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        1,
        resource_version=kube_emulator.resource_version,
        timeout_seconds=5,
    )
    kube_emulator.delete_pod("ray", "a")
    assert _summary(await task) == [("DELETED", "a")]


async def test_history_limit_expires_resource_versions_beyond_the_window(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.history_limit = 2
    kube_emulator.add_pod("ray", "a")
    rv1 = kube_emulator.resource_version
    kube_emulator.add_pod("ray", "b")
    rv2 = kube_emulator.resource_version
    kube_emulator.add_pod("ray", "c")
    kube_emulator.add_pod("ray", "d")  # the window now holds only the changes after rv2

    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(
            _collect,
            core_v1.list_pod_for_all_namespaces,
            1,
            resource_version=rv1,
            timeout_seconds=5,
        )
    assert raised.value.status == 410
    events = await asyncio.to_thread(
        _collect, core_v1.list_pod_for_all_namespaces, 2, resource_version=rv2, timeout_seconds=5
    )
    assert _summary(events) == [("ADDED", "c"), ("ADDED", "d")]


async def test_watch_timeout_seconds_ends_the_stream(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = await asyncio.to_thread(
        _collect,
        core_v1.list_pod_for_all_namespaces,
        1,
        resource_version=kube_emulator.resource_version,
        timeout_seconds=1,
    )
    assert events == []
    assert 0.9 <= loop.time() - started < 30  # not before the timeout; only a hang is later
    assert kube_emulator.watch_count == 0


async def test_dropped_watch_is_resumed_by_the_client_from_the_last_resource_version(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    rv = kube_emulator.resource_version
    # No timeout_seconds: the client's Watch re-watches by itself when the server ends a stream.
    task = await _watching(
        kube_emulator, core_v1.list_pod_for_all_namespaces, 2, resource_version=rv
    )
    kube_emulator.add_pod("ray", "a")
    seen_rv = kube_emulator.resource_version
    assert kube_emulator.watch_requests()[0].params["resourceVersion"] == rv
    assert kube_emulator.drop_watches() == 1
    await kube_emulator.wait_until(  # the client came back by itself
        lambda: len(kube_emulator.requests(verb="watch")) == 2 and kube_emulator.watch_count == 1
    )
    assert kube_emulator.watch_requests()[0].params["resourceVersion"] == seen_rv
    kube_emulator.add_pod("ray", "b")
    assert _summary(await task) == [("ADDED", "a"), ("ADDED", "b")]
    watches = kube_emulator.requests("GET", verb="watch")
    assert [call.params["resourceVersion"] for call in watches] == [rv, seen_rv]


async def test_abruptly_dropped_watch_raises_protocol_error_in_the_client(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    task = await _watching(kube_emulator, core_v1.list_pod_for_all_namespaces, 5, timeout_seconds=5)
    kube_emulator.add_pod("ray", "a")
    assert kube_emulator.drop_watches(abrupt=True) == 1
    with pytest.raises(urllib3.exceptions.ProtocolError):
        await task
    await kube_emulator.wait_for_watches(0, exactly=True)


async def test_bookmarks_go_only_to_watches_that_allow_them(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    rv = kube_emulator.resource_version
    plain = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        1,
        resource_version=rv,
        timeout_seconds=5,
    )
    with_bookmarks = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        1,
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=5,
    )
    assert kube_emulator.bookmark() == 1
    kube_emulator.add_pod("ray", "b")
    bookmarked = await with_bookmarks
    assert bookmarked[0]["type"] == "BOOKMARK"
    assert bookmarked[0]["raw_object"]["metadata"]["resourceVersion"] == rv
    assert _summary(await plain) == [("ADDED", "b")]

    # The watch-list protocol (KEP-3157): initial ADDEDs, then a bookmark marking their end.
    initial = await asyncio.to_thread(
        _collect,
        core_v1.list_pod_for_all_namespaces,
        3,
        send_initial_events=True,
        allow_watch_bookmarks=True,
        resource_version_match="NotOlderThan",
        timeout_seconds=5,
    )
    assert _summary(initial) == [("ADDED", "a"), ("ADDED", "b"), ("BOOKMARK", "")]
    end = initial[2]["raw_object"]["metadata"]
    assert end["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert end["resourceVersion"] == kube_emulator.resource_version


# ---- patches --------------------------------------------------------------------------------


async def test_label_patch_is_a_strategic_merge_by_default_and_reaches_watchers(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    pod = kube_emulator.add_pod("ray", "a", labels={"ray.io/node-type": "worker", "old": "x"})
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        2,
        resource_version=pod["metadata"]["resourceVersion"],
        timeout_seconds=5,
    )
    patched = await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "a", "ray", {"metadata": {"labels": {"ray.io/serve": "true"}}}
    )
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "a", "ray", {"metadata": {"labels": {"old": None}}}
    )
    assert patched.metadata.labels == {
        "ray.io/node-type": "worker",
        "old": "x",
        "ray.io/serve": "true",
    }
    assert kube_emulator.pod_labels("ray", "a") == {
        "ray.io/node-type": "worker",
        "ray.io/serve": "true",
    }
    calls = kube_emulator.requests("PATCH", resource="pods")
    assert [call.content_type for call in calls] == ["application/strategic-merge-patch+json"] * 2
    events = await task
    assert [event["type"] for event in events] == ["MODIFIED", "MODIFIED"]
    assert events[0]["object"].metadata.labels["ray.io/serve"] == "true"
    assert events[0]["object"].metadata.resource_version == patched.metadata.resource_version
    assert "old" not in events[1]["object"].metadata.labels


async def test_json_merge_patch_and_json_patch_of_labels(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", labels={"keep": "1", "drop": "2"})
    body = {"metadata": {"labels": {"ray.io/serve": "false", "drop": None}}}
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod, "a", "ray", body, _content_type=MERGE_PATCH
    )
    assert kube_emulator.pod_labels("ray", "a") == {"keep": "1", "ray.io/serve": "false"}
    ops = [{"op": "replace", "path": "/metadata/labels/ray.io~1serve", "value": "true"}]
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", ops)
    assert kube_emulator.pod_labels("ray", "a") == {"keep": "1", "ray.io/serve": "true"}
    assert kube_emulator.requests("PATCH")[-1].content_type == "application/json-patch+json"

    failing = [{"op": "test", "path": "/metadata/labels/keep", "value": "nope"}, *ops]
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", failing)
    assert raised.value.status == 422


async def test_status_subresource_merges_pod_conditions_by_type(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", readiness_gates=["ray.io/serve-ready"])
    gate = {"type": "ray.io/serve-ready", "status": "True", "reason": "ProxyHealthy"}
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod_status, "a", "ray", {"status": {"conditions": [gate]}}
    )
    conditions = kube_emulator.pod_conditions("ray", "a")
    assert conditions["ray.io/serve-ready"] == gate
    assert conditions["Ready"]["status"] == "True"  # merged by type, not replaced
    assert list(conditions)[-1] == "ray.io/serve-ready"  # new types are appended

    flip = {"type": "ray.io/serve-ready", "status": "False"}
    patched = await asyncio.to_thread(
        core_v1.patch_namespaced_pod_status, "a", "ray", {"status": {"conditions": [flip]}}
    )
    assert kube_emulator.pod_conditions("ray", "a")["ray.io/serve-ready"] == {
        **gate,
        "status": "False",  # fields absent from the patch item are kept
    }
    assert len(patched.status.conditions) == 5

    remove = {"type": "ray.io/serve-ready", "$patch": "delete"}
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod_status, "a", "ray", {"status": {"conditions": [remove]}}
    )
    assert "ray.io/serve-ready" not in kube_emulator.pod_conditions("ray", "a")

    # A JSON merge patch replaces the whole list (RFC 7386), as on a real API server.
    await asyncio.to_thread(
        core_v1.patch_namespaced_pod_status,
        "a",
        "ray",
        {"status": {"conditions": [gate]}},
        _content_type=MERGE_PATCH,
    )
    assert list(kube_emulator.pod_conditions("ray", "a")) == ["ray.io/serve-ready"]


async def test_pod_and_its_status_subresource_change_only_their_own_part(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", node_name="node-1")
    body = {"metadata": {"labels": {"x": "1"}}, "status": {"phase": "Failed"}}
    patched = await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert patched.status.phase == "Running"  # the main resource cannot change status
    assert patched.metadata.labels["x"] == "1"

    body = {"spec": {"nodeName": "node-9"}, "status": {"phase": "Succeeded"}}
    patched = await asyncio.to_thread(core_v1.patch_namespaced_pod_status, "a", "ray", body)
    assert patched.spec.node_name == "node-1"  # the status subresource cannot change spec
    assert patched.status.phase == "Succeeded"

    fetched = await asyncio.to_thread(core_v1.read_namespaced_pod_status, "a", "ray")
    assert fetched.status.phase == "Succeeded"


async def test_patching_a_missing_pod_is_404_with_a_status_body(core_v1: CoreV1) -> None:
    for call in (core_v1.patch_namespaced_pod, core_v1.patch_namespaced_pod_status):
        with pytest.raises(ApiException) as raised:
            await asyncio.to_thread(call, "ghost", "ray", {"metadata": {"labels": {"a": "b"}}})
        assert raised.value.status == 404
        status = _status_of(raised.value)
        assert status["kind"] == "Status"
        assert status["reason"] == "NotFound"
        assert status["message"] == 'pods "ghost" not found'
        assert status["details"] == {"name": "ghost", "kind": "pods"}
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.read_namespaced_pod, "ghost", "ray")
    assert raised.value.status == 404


async def test_stale_resource_version_in_a_patch_is_409_conflict(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    pod = kube_emulator.add_pod("ray", "a")
    stale = pod["metadata"]["resourceVersion"]
    kube_emulator.modify_pod("ray", "a", labels={"someone": "else"})
    current = kube_emulator.resource_version
    body = {"metadata": {"resourceVersion": stale, "labels": {"ray.io/serve": "true"}}}
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert raised.value.status == 409
    assert _status_of(raised.value)["reason"] == "Conflict"
    assert "ray.io/serve" not in kube_emulator.pod_labels("ray", "a")

    body["metadata"]["resourceVersion"] = current
    patched = await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert patched.metadata.labels["ray.io/serve"] == "true"
    assert int(patched.metadata.resource_version) > int(current)


async def test_replace_of_a_pod_is_conditional_only_with_a_resource_version(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    pod = await asyncio.to_thread(core_v1.read_namespaced_pod, "a", "ray")
    kube_emulator.modify_pod("ray", "a", labels={"someone": "else"})
    pod.metadata.labels = {"mine": "1"}
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.replace_namespaced_pod, "a", "ray", pod)
    assert raised.value.status == 409
    pod.metadata.resource_version = None  # no precondition: the last writer wins
    pod.status.phase = "Failed"  # ignored: status changes only through pods/status
    replaced = await asyncio.to_thread(core_v1.replace_namespaced_pod, "a", "ray", pod)
    assert replaced.metadata.labels == {"mine": "1"}
    assert replaced.status.phase == "Running"
    assert kube_emulator.requests("PUT", resource="pods")[-1].body["metadata"]["labels"] == {
        "mine": "1"
    }


async def test_dry_run_patch_answers_but_changes_nothing(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    pod = kube_emulator.add_pod("ray", "a", labels={})
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    answer = await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body, dry_run="All")
    assert answer.metadata.labels == {"ray.io/serve": "true"}
    assert kube_emulator.pod("ray", "a") == pod


@pytest.mark.parametrize(
    ("target", "patch", "expected"),
    [
        pytest.param(
            {"metadata": {"finalizers": ["a"]}},
            {"metadata": {"finalizers": ["b", "a"]}},
            {"metadata": {"finalizers": ["a", "b"]}},
            id="scalar-set-merge",
        ),
        pytest.param(
            {"metadata": {"finalizers": ["a", "b"]}},
            {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}},
            {"metadata": {"finalizers": ["b"]}},
            id="delete-from-primitive-list",
        ),
        pytest.param(
            {"status": {"conditions": [{"type": "A", "status": "True"}]}},
            {"status": {"conditions": [{"$patch": "replace"}, {"type": "B", "status": "True"}]}},
            {"status": {"conditions": [{"type": "B", "status": "True"}]}},
            id="replace-list",
        ),
        pytest.param(
            {"metadata": {"labels": {"a": "1", "b": "2"}}},
            {"metadata": {"labels": {"$patch": "replace", "c": "3"}}},
            {"metadata": {"labels": {"c": "3"}}},
            id="replace-map",
        ),
        pytest.param(
            {"spec": {"containers": [{"name": "c", "ports": [{"containerPort": 1}]}]}},
            {"spec": {"containers": [{"name": "c", "ports": [{"containerPort": 2}]}]}},
            {
                "spec": {
                    "containers": [
                        {"name": "c", "ports": [{"containerPort": 1}, {"containerPort": 2}]}
                    ]
                }
            },
            id="nested-keyed-lists",
        ),
        pytest.param(
            {"spec": {"readinessGates": [{"conditionType": "a"}]}},
            {"spec": {"readinessGates": [{"conditionType": "b"}], "$setElementOrder/x": []}},
            {"spec": {"readinessGates": [{"conditionType": "b"}]}},
            id="unkeyed-list-replaced",
        ),
    ],
)
def test_strategic_merge_patch_directives(target: Any, patch: Any, expected: Any) -> None:
    assert strategic_merge_patch(target, patch, POD_MERGE_KEYS) == expected


def test_json_merge_patch_replaces_non_objects() -> None:
    assert json_merge_patch({"a": "x"}, {"a": {"b": 1}}) == {"a": {"b": 1}}
    assert json_merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert json_merge_patch({"a": {"b": 1}}, {"a": {"b": None, "c": None}}) == {"a": {}}


# ---- events and leases ------------------------------------------------------------------------


async def test_core_v1_events_are_created_with_generate_name(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    body = kubernetes.client.CoreV1Event(
        metadata=kubernetes.client.V1ObjectMeta(generate_name="a."),
        involved_object=kubernetes.client.V1ObjectReference(kind="Pod", name="a", namespace="ray"),
        reason="ServeUnhealthy",
        message="proxy answered 503",
        type="Warning",
    )
    created = await asyncio.to_thread(core_v1.create_namespaced_event, "ray", body)
    assert created.metadata.name.startswith("a.")
    assert created.metadata.namespace == "ray"
    assert created.metadata.resource_version == kube_emulator.resource_version
    assert kube_emulator.requests("POST", resource="events")[0].path == (
        "/api/v1/namespaces/ray/events"
    )
    [stored] = kube_emulator.events("ray")
    assert stored["reason"] == "ServeUnhealthy"
    assert stored["involvedObject"]["name"] == "a"

    selected = await asyncio.to_thread(
        core_v1.list_namespaced_event, "ray", field_selector="involvedObject.name=a,type=Warning"
    )
    assert [event.reason for event in selected.items] == ["ServeUnhealthy"]

    body.metadata.namespace = "elsewhere"
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.create_namespaced_event, "ray", body)
    assert raised.value.status == 400


async def test_events_k8s_io_events_are_created(
    kube_emulator: KubeEmulator, kube_api_client: kubernetes.client.ApiClient
) -> None:
    api = kubernetes.client.EventsV1Api(kube_api_client)
    body = kubernetes.client.EventsV1Event(
        metadata=kubernetes.client.V1ObjectMeta(name="a.1"),
        event_time=datetime.datetime.now(tz=datetime.UTC),
        reporting_controller="ray-serve-health",
        reporting_instance="aggregator-0",
        action="Label",
        reason="ServeHealthy",
        regarding=kubernetes.client.V1ObjectReference(kind="Pod", name="a", namespace="ray"),
        type="Normal",
    )
    created = await asyncio.to_thread(api.create_namespaced_event, "ray", body)
    assert created.metadata.name == "a.1"
    assert kube_emulator.events()[0]["apiVersion"] == "events.k8s.io/v1"
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(api.create_namespaced_event, "ray", body)
    assert raised.value.status == 409
    assert _status_of(raised.value)["reason"] == "AlreadyExists"


async def test_leases_create_read_replace_with_optimistic_concurrency(
    kube_emulator: KubeEmulator, kube_api_client: kubernetes.client.ApiClient
) -> None:
    api = kubernetes.client.CoordinationV1Api(kube_api_client)
    now = datetime.datetime.now(tz=datetime.UTC)
    lease = kubernetes.client.V1Lease(
        metadata=kubernetes.client.V1ObjectMeta(name="serve-health", namespace="ray"),
        spec=kubernetes.client.V1LeaseSpec(
            holder_identity="replica-a", lease_duration_seconds=15, acquire_time=now, renew_time=now
        ),
    )
    created = await asyncio.to_thread(api.create_namespaced_lease, "ray", lease)
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(api.create_namespaced_lease, "ray", lease)
    assert raised.value.status == 409
    assert _status_of(raised.value)["details"] == {
        "name": "serve-health",
        "kind": "leases",
        "group": "coordination.k8s.io",
    }

    # Two candidates read the same version; the first replace wins, the second is 409.
    mine = await asyncio.to_thread(api.read_namespaced_lease, "serve-health", "ray")
    theirs = await asyncio.to_thread(api.read_namespaced_lease, "serve-health", "ray")
    assert mine.metadata.resource_version == created.metadata.resource_version
    assert mine.spec.renew_time == now
    mine.spec.renew_time = now + datetime.timedelta(seconds=5)
    renewed = await asyncio.to_thread(api.replace_namespaced_lease, "serve-health", "ray", mine)
    assert int(renewed.metadata.resource_version) > int(mine.metadata.resource_version)
    theirs.spec.holder_identity = "replica-b"
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(api.replace_namespaced_lease, "serve-health", "ray", theirs)
    assert raised.value.status == 409
    assert _status_of(raised.value)["reason"] == "Conflict"
    assert kube_emulator.lease("ray", "serve-health")["spec"]["holderIdentity"] == "replica-a"
    assert [call.method for call in kube_emulator.requests(resource=LEASES)] == [
        "POST",
        "POST",
        "GET",
        "GET",
        "PUT",
        "PUT",
    ]

    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(api.read_namespaced_lease, "nobody", "ray")
    assert raised.value.status == 404
    theirs.metadata.name = "nobody"
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(api.replace_namespaced_lease, "nobody", "ray", theirs)
    assert raised.value.status == 404


# ---- ServiceAccount tokens and TokenReview ---------------------------------------------------


def _review(api: kubernetes.client.AuthenticationV1Api, token: str, *audiences: str) -> Any:
    body = kubernetes.client.V1TokenReview(
        spec=kubernetes.client.V1TokenReviewSpec(token=token, audiences=list(audiences) or None)
    )
    return api.create_token_review(body, _request_timeout=10)


@pytest.fixture
def authentication(
    kube_api_client: kubernetes.client.ApiClient,
) -> kubernetes.client.AuthenticationV1Api:
    return kubernetes.client.AuthenticationV1Api(kube_api_client)


async def test_token_review_names_the_service_account_pod_and_node_of_a_bound_token(
    kube_emulator: KubeEmulator, authentication: kubernetes.client.AuthenticationV1Api
) -> None:
    pod = kube_emulator.add_pod("ray", "worker-a", node_name="node-7")
    token = kube_emulator.issue_token("ray", "default", pod="worker-a")
    claims = jwt_claims(token)
    assert claims is not None
    assert claims["aud"] == ["ray-serve-health"]
    assert claims["exp"] - claims["iat"] == 3600
    assert claims["sub"] == "system:serviceaccount:ray:default"
    assert claims["kubernetes.io"]["pod"] == {"name": "worker-a", "uid": pod["metadata"]["uid"]}
    assert claims["kubernetes.io"]["node"]["name"] == "node-7"

    review = await asyncio.to_thread(_review, authentication, token, "ray-serve-health", "other")
    assert review.kind == "TokenReview"
    status = review.status
    assert status.authenticated is True
    assert status.error is None
    assert status.audiences == ["ray-serve-health"]  # the requested ones the token has
    assert status.user.username == "system:serviceaccount:ray:default"
    assert status.user.groups == [
        "system:serviceaccounts",
        "system:serviceaccounts:ray",
        "system:authenticated",
    ]
    extra = status.user.extra
    assert extra["authentication.kubernetes.io/pod-name"] == ["worker-a"]
    assert extra["authentication.kubernetes.io/pod-uid"] == [pod["metadata"]["uid"]]
    assert extra["authentication.kubernetes.io/node-name"] == ["node-7"]
    assert extra["authentication.kubernetes.io/node-uid"] == [node_uid("node-7")]
    assert extra["authentication.kubernetes.io/credential-id"] == [f"JTI={claims['jti']}"]
    [call] = kube_emulator.requests(resource=TOKENREVIEWS)
    assert (call.method, call.verb, call.group, call.namespace) == (
        "POST",
        "create",
        "authentication.k8s.io",
        None,
    )
    assert kube_emulator.list_objects(TOKENREVIEWS) == []  # reviews are not stored


async def test_token_bound_to_no_pod_or_to_a_node(
    kube_emulator: KubeEmulator, authentication: kubernetes.client.AuthenticationV1Api
) -> None:
    plain = kube_emulator.issue_token("ops", "viewer")
    on_node = kube_emulator.issue_token("ops", "viewer", node="node-3")
    review = await asyncio.to_thread(_review, authentication, plain, "ray-serve-health")
    assert review.status.authenticated is True
    assert set(review.status.user.extra) == {"authentication.kubernetes.io/credential-id"}
    review = await asyncio.to_thread(_review, authentication, on_node, "ray-serve-health")
    assert review.status.user.extra["authentication.kubernetes.io/node-name"] == ["node-3"]
    assert "authentication.kubernetes.io/pod-name" not in review.status.user.extra


async def test_token_review_refusals_are_answers_not_errors(
    kube_emulator: KubeEmulator, authentication: kubernetes.client.AuthenticationV1Api
) -> None:
    """Unknown, expired, wrong-audience and invalidated tokens: 201 with authenticated unset
    and an error, as the API server answers them."""
    kube_emulator.add_pod("ray", "a")
    kube_emulator.add_pod("ray", "b")
    now = [1_800_000_000.0]
    kube_emulator.wall_clock = lambda: now[0]
    expiring = kube_emulator.issue_token("ray", "default", pod="a", expires_in=60)
    other_audience = kube_emulator.issue_token("ray", "default", pod="a", audiences=["vault"])
    deleted = kube_emulator.issue_token("ray", "default", pod="b")
    replaced = kube_emulator.issue_token("ray", "default", pod="a")
    kube_emulator.delete_pod("ray", "b")

    async def error_of(token: str, *audiences: str) -> str:
        review = await asyncio.to_thread(_review, authentication, token, *audiences)
        assert review.status.authenticated is None
        assert review.status.user.username is None
        return review.status.error

    assert (
        await error_of("x.y.z", "ray-serve-health") == "[invalid bearer token, token lookup failed]"
    )
    assert "is invalid for the target audiences" in await error_of(
        other_audience, "ray-serve-health"
    )
    # Without audiences, the API server's own is meant: a ray-serve-health token is not for it.
    assert "kubernetes.default.svc" in await error_of(expiring)
    assert "invalidated" in await error_of(deleted, "ray-serve-health")
    now[0] += 60
    assert "has expired" in await error_of(expiring, "ray-serve-health")
    kube_emulator.delete_pod("ray", "a")
    kube_emulator.add_pod("ray", "a")  # same name, new uid: the old pod's token is void
    assert "invalidated" in await error_of(replaced, "ray-serve-health")

    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(_review, authentication, "", "ray-serve-health")
    assert raised.value.status == 400
    assert "token is required" in _status_of(raised.value)["message"]


def test_tokens_are_issued_only_for_existing_pods_of_their_service_account(
    kube_emulator: KubeEmulator,
) -> None:
    with pytest.raises(KeyError, match="no such pod"):
        kube_emulator.issue_token("ray", "default", pod="missing")
    kube_emulator.add_pod("ray", "sa-pod")
    kube_emulator.modify_pod("ray", "sa-pod", patch={"spec": {"serviceAccountName": "runner"}})
    with pytest.raises(ValueError, match="running with serviceaccount runner"):
        kube_emulator.issue_token("ray", "default", pod="sa-pod")
    assert kube_emulator.issue_token("ray", "runner", pod="sa-pod")
    with pytest.raises(ValueError, match="not both"):
        kube_emulator.issue_token("ray", "runner", pod="sa-pod", node="n1")


async def test_token_reviews_fail_through_the_dsl_like_any_request(
    kube_emulator: KubeEmulator, authentication: kubernetes.client.AuthenticationV1Api
) -> None:
    token = kube_emulator.issue_token("ops", "viewer")
    fault = kube_emulator.fail_next(1, status=500, resource=TOKENREVIEWS)
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(_review, authentication, token, "ray-serve-health")
    assert raised.value.status == 500
    assert len(fault) == 1
    review = await asyncio.to_thread(_review, authentication, token, "ray-serve-health")
    assert review.status.authenticated is True


# ---- faults ---------------------------------------------------------------------------------


async def test_throttled_patches_answer_429_with_retry_after_and_change_nothing(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", labels={})
    reaction = kube_emulator.throttle_patches(2, retry_after=1)
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    for _ in range(2):
        with pytest.raises(ApiException) as raised:
            await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
        assert raised.value.status == 429
        assert raised.value.headers["Retry-After"] == "1"
        status = _status_of(raised.value)
        assert status["reason"] == "TooManyRequests"
        assert status["details"] == {"retryAfterSeconds": 1}
        assert kube_emulator.pod_labels("ray", "a") == {}  # the write did not happen
    patched = await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert patched.metadata.labels == {"ray.io/serve": "true"}
    assert len(reaction) == 2
    assert len(kube_emulator.requests("PATCH", resource="pods")) == 3


async def test_a_burst_of_500s_then_normal_service(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    kube_emulator.fail_next(3, status=500, verb="list")
    for _ in range(3):
        with pytest.raises(ApiException) as raised:
            await asyncio.to_thread(core_v1.list_pod_for_all_namespaces)
        assert raised.value.status == 500
        assert _status_of(raised.value)["reason"] == "InternalError"
    pod = await asyncio.to_thread(core_v1.read_namespaced_pod, "a", "ray")  # not a list
    assert pod.metadata.name == "a"
    assert _names(await asyncio.to_thread(core_v1.list_pod_for_all_namespaces)) == ["a"]


async def test_new_watches_can_fail_and_urllib3_retries_get_429_by_itself(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.fail_next(1, status=500, verb="watch")
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(_collect, core_v1.list_pod_for_all_namespaces, 1, timeout_seconds=1)
    assert raised.value.status == 500

    # A GET answered 429 with Retry-After is repeated by urllib3's default retry policy before
    # the caller sees anything (Retry-After: 0 here, to keep the test fast).
    kube_emulator.fail_next(2, status=429, retry_after=0, verb="list")
    pods = await asyncio.to_thread(core_v1.list_pod_for_all_namespaces)
    assert pods.items == []
    assert len(kube_emulator.requests(verb="list")) == 3


async def test_pod_not_found_until_the_fault_is_cleared(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    kube_emulator.add_pod("ray", "b")
    kube_emulator.pod_not_found("ray", "a")
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    for call in (core_v1.patch_namespaced_pod, core_v1.patch_namespaced_pod_status):
        with pytest.raises(ApiException) as raised:
            await asyncio.to_thread(call, "a", "ray", body)
        assert raised.value.status == 404
        assert _status_of(raised.value)["details"]["name"] == "a"
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "b", "ray", body)
    assert "ray.io/serve" not in kube_emulator.pod_labels("ray", "a")
    assert kube_emulator.pod_labels("ray", "b")["ray.io/serve"] == "true"

    kube_emulator.clear_faults()
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert kube_emulator.pod_labels("ray", "a")["ray.io/serve"] == "true"


async def test_slow_api_delays_answers_and_trips_client_timeouts(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    kube_emulator.slow(0.3)
    kube_emulator.fail_next(1, status=503, verb="get")  # faults still apply behind the delay
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(core_v1.read_namespaced_pod, "a", "ray")
    assert raised.value.status == 503
    pods = await asyncio.to_thread(core_v1.list_pod_for_all_namespaces)
    assert _names(pods) == ["a"]
    assert loop.time() - started >= 0.6

    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        await asyncio.to_thread(
            core_v1.patch_namespaced_pod,
            "a",
            "ray",
            {"metadata": {"labels": {"x": "y"}}},
            _request_timeout=0.05,
        )


async def test_slow_api_draws_each_requests_delay_and_drops_abandoned_writes(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    """``slow(draw)``: each request waits its own draw, concurrently (a slow one holds no other
    back); a write whose client gave up during its delay (read timeout) is never applied, as a
    request waiting in an API Priority and Fairness queue is dropped when its client goes."""
    kube_emulator.add_pod("ray", "a")
    draws = iter([0.6, 0.0, 0.0, 0.0])
    kube_emulator.slow(lambda: next(draws))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        await asyncio.to_thread(
            core_v1.patch_namespaced_pod,
            "a",
            "ray",
            {"metadata": {"labels": {"late": "yes"}}},
            _request_timeout=0.1,
        )
    fast = [
        asyncio.to_thread(core_v1.read_namespaced_pod, "a", "ray", _request_timeout=0.4)
        for _ in range(3)
    ]
    await asyncio.gather(*fast)  # drawn 0: not queued behind the slow one
    assert loop.time() - started < 0.5
    await asyncio.sleep(1.0)  # well past the slow one's 0.6 s
    assert "late" not in kube_emulator.pod_labels("ray", "a")
    assert len(kube_emulator.requests("PATCH", resource=PODS)) == 1  # it did arrive


async def test_raw_kmock_dsl_faults_work_as_the_helper_docstrings_say(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", labels={})
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    view = kube_emulator["patch pods.v1"]
    k = len(view)  # one PATCH so far: the slice below means "the next two"
    reaction = view[k : k + 2] << 503 << {"Retry-After": "3"} << status_body(503, "X", "down")
    for _ in range(2):
        with pytest.raises(ApiException) as raised:
            await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
        assert raised.value.status == 503
        assert raised.value.headers["Retry-After"] == "3"
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    assert len(reaction) == 2


# ---- request accounting, store helpers, fixtures -----------------------------------------------


async def test_requests_are_counted_by_method_resource_and_subresource(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a")
    await asyncio.to_thread(core_v1.list_pod_for_all_namespaces, label_selector="ray.io/node-type")
    mark = kube_emulator.checkpoint()
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    await asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    status = {"status": {"conditions": [{"type": "ray.io/serve-ready", "status": "True"}]}}
    await asyncio.to_thread(core_v1.patch_namespaced_pod_status, "a", "ray", status)

    patches = kube_emulator.requests("PATCH", resource="pods")
    assert len(patches) == 3
    assert [call.body for call in patches] == [body, body, status]
    assert [call.subresource for call in patches] == [None, None, "status"]
    assert len(kube_emulator.requests("PATCH", resource="pods", subresource=None)) == 2
    assert len(kube_emulator.requests("patch", resource="v1/pods", subresource="status")) == 1
    assert len(kube_emulator.requests("PATCH", name="a", namespace="ray")) == 3
    assert kube_emulator.requests("PATCH", resource=LEASES) == []
    assert [call.at for call in patches] == sorted(call.at for call in patches)
    assert peak_count(patches, window=60) == 3
    [listing] = kube_emulator.requests(verb="list")
    assert listing.params == {"labelSelector": "ray.io/node-type"}
    assert listing.path == "/api/v1/pods"
    assert len(kube_emulator.requests(since=mark)) == 3


async def test_wait_until_wakes_on_requests_and_writes(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    kube_emulator.add_pod("ray", "a", labels={})
    body = {"metadata": {"labels": {"ray.io/serve": "true"}}}
    patching = asyncio.ensure_future(
        asyncio.to_thread(core_v1.patch_namespaced_pod, "a", "ray", body)
    )
    value = await kube_emulator.wait_until(
        lambda: kube_emulator.pod_labels("ray", "a").get("ray.io/serve")
    )
    assert value == "true"
    await patching
    assert len(await kube_emulator.wait_until(lambda: kube_emulator.requests("PATCH"))) == 1
    with pytest.raises(AssertionError, match="not met within"):
        await kube_emulator.wait_until(lambda: kube_emulator.watch_count, within=0.05)


def _call_at(at: float) -> ApiCall:
    return ApiCall("PATCH", "patch", "/", "pods", "", None, None, None, {}, {}, None, at, None)


def test_peak_count_is_the_busiest_window() -> None:
    calls = [_call_at(at) for at in (0.0, 0.1, 0.95, 1.0, 1.05, 3.0)]
    assert peak_count(calls, window=1.0) == 4  # 0.1, 0.95, 1.0, 1.05
    assert peak_count(calls, window=0.1) == 2
    assert peak_count([], window=1.0) == 0


async def test_store_helpers_emit_watch_events(
    kube_emulator: KubeEmulator, core_v1: CoreV1
) -> None:
    rv = kube_emulator.resource_version
    task = await _watching(
        kube_emulator,
        core_v1.list_pod_for_all_namespaces,
        3,
        resource_version=rv,
        timeout_seconds=5,
    )
    pod = kube_emulator.add_pod(
        "ray", "a", pod_ip="10.1.2.3", serve_port=8443, readiness_gates=["gate"]
    )
    assert pod == kube_emulator.pod("ray", "a")
    assert kube_emulator.objects[PODS, "ray", "a"] >= {"status": {"podIP": "10.1.2.3"}}
    kube_emulator.modify_pod("ray", "a", labels={"ray.io/serve": "true"}, phase="Running")
    kube_emulator.modify_pod("ray", "a", labels={"ray.io/serve": "true"})  # no change: no event
    assert kube_emulator.delete_pod("ray", "a") is not None
    assert kube_emulator.delete_pod("ray", "a") is None
    events = await task
    assert _summary(events) == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    added = events[0]["object"]
    assert added.spec.containers[0].ports[0].name == "serve"
    assert added.spec.containers[0].ports[0].container_port == 8443
    assert added.spec.readiness_gates[0].condition_type == "gate"
    assert events[1]["object"].metadata.labels["ray.io/serve"] == "true"
    assert make_pod("x", "y", labels={})["metadata"]["labels"] == {}


async def test_kubeconfig_file_points_the_official_loader_at_the_emulator(
    kube_emulator: KubeEmulator, kubeconfig_path: pathlib.Path
) -> None:
    kube_emulator.add_pod("ray", "a")
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(kubeconfig_path), client_configuration=configuration
    )
    assert configuration.host == str(kube_emulator.url).rstrip("/")
    with kubernetes.client.ApiClient(configuration) as client:
        pods = await asyncio.to_thread(
            kubernetes.client.CoreV1Api(client).list_namespaced_pod, "ray"
        )
        client.rest_client.pool_manager.clear()
    assert _names(pods) == ["a"]


async def test_discovery_and_unknown_resources(kube_api_client: kubernetes.client.ApiClient):
    leases = await asyncio.to_thread(
        kubernetes.client.CoordinationV1Api(kube_api_client).get_api_resources
    )
    assert [(r.name, r.kind, r.namespaced) for r in leases.resources] == [("leases", "Lease", True)]
    core = await asyncio.to_thread(kubernetes.client.CoreV1Api(kube_api_client).get_api_resources)
    assert {"pods", "pods/status", "events"} <= {r.name for r in core.resources}
    with pytest.raises(ApiException) as raised:
        await asyncio.to_thread(
            kubernetes.client.CoreV1Api(kube_api_client).list_namespaced_config_map, "ray"
        )
    assert raised.value.status == 404
