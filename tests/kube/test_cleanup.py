"""``serve-health-cleanup``, the real console script in a process of its own, on the API
emulator over real HTTP (a kubeconfig pointing at it).

The pods are what an aggregator leaves behind: a RayService (head tagged ``kuberay_crd=
RayService`` by KubeRay, workers at ``ray.io/serve=false``), a plain RayCluster labelled by the
aggregator, a pod the selector does not match; for the condition mode, gated and ungated pods
with the aggregator's condition. Covered: label mode with KubeRay's key (RayService workers back
to ``true``, the RayService head left to KubeRay, the plain RayCluster's label removed), a key of
our own (removed everywhere), condition mode (gated pods True with reason
``RayServeHealthUninstalled``, the condition removed from ungated pods with ``$patch: delete``),
``--dry-run`` (not one write request), the refusal while the aggregator's Lease is held and
renewed by a real elector (exit 2) and ``--force``, a stale or released Lease, the refusal
while agents in fallback wrote pods after the aggregator went away (their marks newer than the
Lease's release: exit 2, nothing written, the pods named; ``--dry-run`` and ``--force`` go on)
and the removal of those marks, 500s retried,
a pod deleted meanwhile (404: counted as gone, exit 0), a refused write or one failing beyond
``--max-attempts`` (exit 1, the other pods done), an API that does not answer (exit 1, no
refusal).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aggregator.cleanup.rules import EXTRA_TAGS_ENV, RAY_SERVICE_ENV, UNINSTALLED_REASON
from aggregator.leader.elector import ElectionSettings, LeaderElector, micro_time
from aggregator.leader.lease import KubeLeaseStore, lease_api
from servehealth_common import fallback_marks as marks
from tests.conftest import eventually
from testsupport.kube.emulator import LEASES, PODS, KubeEmulator, make_pod

COMMAND = str(Path(sys.executable).parent / "serve-health-cleanup")
NS = "ray"
LEASE_NS = "ray-serve-health"
LEASE = "ray-serve-health-aggregator"
SERVE = "ray.io/serve"
OWN = "example.com/serving"
GATE = "ray.io/serve-proxy-healthy"
WRITES = ("POST", "PUT", "PATCH", "DELETE")
TIMINGS = ElectionSettings(lease_duration=2, renew_deadline=1.2, retry_period=0.3)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def summary(self) -> str:
        return self.stdout.strip().splitlines()[-1]


@pytest.fixture
def cleanup(kubeconfig_path: Path, tmp_path: Path) -> Any:
    """``await cleanup(*flags)``: run the command to its end (60 s at most; killed if not)."""
    environ = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("SERVE_HEALTH_")
        and name not in ("KUBECONFIG", "POD_NAMESPACE", "KUBERNETES_SERVICE_HOST")
    }
    environ["HOME"] = str(tmp_path)  # no ~/.kube/config of the machine's

    async def run(*flags: str) -> Result:
        process = await asyncio.create_subprocess_exec(
            COMMAND,
            f"--kubeconfig={kubeconfig_path}",
            f"--lease-namespace={LEASE_NS}",
            "--verify-for=0",  # no second look, unless a test asks for one
            *flags,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=environ,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(60):
                stdout, stderr = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode is not None
        return Result(process.returncode, stdout.decode(), stderr.decode())

    return run


def add(
    kube: KubeEmulator,
    name: str,
    *,
    cluster: str = "svc-x7k2p",
    head: bool = False,
    serve: str | None = None,
    extra: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    gated: bool = False,
    condition: tuple[str, str] | None = None,
) -> None:
    """A KubeRay pod in NS (``env`` on its Ray container; ``condition``: status, reason)."""
    labels = {"ray.io/node-type": "head" if head else "worker", "ray.io/cluster": cluster}
    if serve is not None:
        labels[SERVE] = serve
    conditions: list[dict[str, Any]] = [{"type": "Ready", "status": "True"}]
    if condition is not None:
        conditions.append(
            {
                "type": GATE,
                "status": condition[0],
                "reason": condition[1],
                "message": "by the aggregator",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        )
    pod = make_pod(
        NS,
        name,
        labels=labels | dict(extra or {}),
        readiness_gates=[GATE] if gated else [],
        conditions=conditions,
    )
    pod["spec"]["containers"][0]["env"] = [{"name": k, "value": v} for k, v in (env or {}).items()]
    kube.put_object(PODS, pod)


def rayservice_and_raycluster(kube: KubeEmulator) -> None:
    """What a label-mode aggregator with ray.io/serve leaves behind."""
    tags = "kuberay_version=v1.5.0;kuberay_crd="
    rayservice = {RAY_SERVICE_ENV: "0"}
    add(kube, "svc-head", head=True, serve="true", env={EXTRA_TAGS_ENV: tags + "RayService"})
    add(kube, "svc-worker-0", serve="false", env=rayservice)
    add(kube, "svc-worker-1", serve="false", env=rayservice)
    add(kube, "svc-worker-2", serve="true", env=rayservice)
    add(
        kube,
        "plain-head",
        cluster="plain",
        head=True,
        serve="true",
        env={EXTRA_TAGS_ENV: tags + "RayCluster"},
    )
    add(kube, "plain-worker", cluster="plain", serve="false")
    kube.put_object(PODS, make_pod(NS, "not-ray", labels={SERVE: "false"}))


def serve_labels(kube: KubeEmulator, key: str = SERVE) -> dict[str, str | None]:
    pods = kube.list_objects(PODS)
    return {pod["metadata"]["name"]: pod["metadata"]["labels"].get(key) for pod in pods}


def writes(kube: KubeEmulator, resource: Any = PODS) -> list[str]:
    """Write requests to pods (``resource=None``: to anything), as "PATCH name[/status]"."""
    return [
        f"{call.method} {call.name}{'/' + call.subresource if call.subresource else ''}"
        for call in kube.requests(resource=resource)
        if call.method in WRITES
    ]


@contextlib.asynccontextmanager
async def aggregator_leading(kube: KubeEmulator) -> AsyncIterator[LeaderElector]:
    """A real elector holding the aggregator's Lease and renewing it, released on exit."""
    store = KubeLeaseStore(lease_api(kube.client_configuration(), TIMINGS), LEASE_NS, LEASE)
    elector = LeaderElector(store, "ray-serve-health-aggregator-5d9c_1a2b3c4d", TIMINGS)
    await elector.acquire()
    holding = asyncio.create_task(elector.hold())
    try:
        yield elector
    finally:
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        await elector.release()
        store.close()


# -- label mode ---------------------------------------------------------------------------


async def test_label_mode_gives_kuberays_label_back(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    rayservice_and_raycluster(kube_emulator)
    result = await cleanup("--mode=label")
    assert result.code == 0, result.stderr
    assert serve_labels(kube_emulator) == {
        "not-ray": "false",  # not selected (no ray.io/node-type): untouched
        "plain-head": None,  # KubeRay never sets it on a plain RayCluster's pods
        "plain-worker": None,
        "svc-head": "true",  # left to KubeRay's updateHeadPodServeLabel
        "svc-worker-0": "true",  # BuildPod's value
        "svc-worker-1": "true",
        "svc-worker-2": "true",
    }
    assert sorted(writes(kube_emulator)) == [
        "PATCH plain-head",
        "PATCH plain-worker",
        "PATCH svc-worker-0",
        "PATCH svc-worker-1",
    ]
    assert "ray/svc-head: left alone: label ray.io/serve: KubeRay writes it" in result.stdout
    assert "ray/svc-worker-0: set label ray.io/serve=true" in result.stdout
    assert "ray/plain-worker: remove label ray.io/serve" in result.stdout
    assert result.summary == (
        "summary: 6 pods: 4 changed, 2 already right, 0 failed, 0 gone (deleted meanwhile)"
    )
    # Run again: nothing left to do.
    again = await cleanup()
    assert again.code == 0
    assert again.summary.startswith("summary: 6 pods: 0 changed, 6 already right, 0 failed")


async def test_a_label_key_of_our_own_is_removed_from_every_pod(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    rayservice_and_raycluster(kube_emulator)
    for name in ("svc-head", "svc-worker-0", "plain-worker"):
        kube_emulator.modify_pod(NS, name, labels={OWN: "false"})
    kuberays = serve_labels(kube_emulator)
    result = await cleanup(f"--label-key={OWN}", "--mode=both")
    assert result.code == 0, result.stderr
    assert set(serve_labels(kube_emulator, OWN).values()) == {None}
    assert serve_labels(kube_emulator) == kuberays  # ray.io/serve: not ours here, untouched
    assert sorted(writes(kube_emulator)) == [
        "PATCH plain-worker",
        "PATCH svc-head",
        "PATCH svc-worker-0",
    ]
    assert result.summary.startswith("summary: 6 pods: 3 changed, 3 already right, 0 failed")


# -- condition mode -----------------------------------------------------------------------


async def test_condition_mode_readies_gated_pods_and_removes_the_others_conditions(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    kube = kube_emulator
    add(kube, "gated-false", gated=True, serve="false", condition=("False", "ServeProxyNotServing"))
    add(kube, "gated-true", gated=True, condition=("True", "ServeProxyServing"))
    add(kube, "gated-none", gated=True)
    add(kube, "ungated-false", condition=("False", "ServeProxyNotServing"))
    add(kube, "ungated-none")
    result = await cleanup("--mode=condition")
    assert result.code == 0, result.stderr

    for name in ("gated-false", "gated-true", "gated-none"):
        condition = kube.pod_conditions(NS, name)[GATE]
        assert condition["status"] == "True", name
        assert condition["reason"] == UNINSTALLED_REASON
        assert "aggregator was uninstalled" in condition["message"]
    # A new status: a new transition time; the same status: the old one kept.
    transitions = {
        name: kube.pod_conditions(NS, name)[GATE]["lastTransitionTime"]
        for name in ("gated-false", "gated-true")
    }
    assert transitions["gated-false"] != "2026-01-01T00:00:00Z"
    assert transitions["gated-true"] == "2026-01-01T00:00:00Z"
    assert set(kube.pod_conditions(NS, "ungated-false")) == {"Ready"}  # removed, Ready kept
    assert set(kube.pod_conditions(NS, "ungated-none")) == {"Ready"}
    assert kube.pod_labels(NS, "gated-false")[SERVE] == "false"  # labels: not this mode's
    assert sorted(writes(kube)) == [
        "PATCH gated-false/status",
        "PATCH gated-none/status",
        "PATCH gated-true/status",
        "PATCH ungated-false/status",
    ]
    removal = next(c for c in kube.requests("PATCH") if c.name == "ungated-false")
    assert removal.content_type == "application/strategic-merge-patch+json"
    assert result.summary.startswith("summary: 5 pods: 4 changed, 1 already right, 0 failed")


# -- dry run ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["label", "both"])
async def test_dry_run_prints_and_writes_nothing(
    kube_emulator: KubeEmulator, cleanup: Any, mode: str
) -> None:
    rayservice_and_raycluster(kube_emulator)
    add(kube_emulator, "gated", cluster="plain", gated=True, condition=("False", "NotServing"))
    before = kube_emulator.list_objects(PODS)
    result = await cleanup(f"--mode={mode}", "--dry-run=true")
    assert result.code == 0, result.stderr
    assert writes(kube_emulator, resource=None) == []
    assert kube_emulator.list_objects(PODS) == before
    assert "ray/svc-worker-0: would set label ray.io/serve=true" in result.stdout
    assert "ray/plain-worker: would remove label ray.io/serve" in result.stdout
    assert ("ray/gated: would set condition" in result.stdout) is (mode == "both")
    assert result.summary.endswith("(dry run: nothing was changed)")
    changes = 5 if mode == "both" else 4  # and the gated pod's condition
    assert result.summary.startswith(f"summary: 7 pods: {changes} would change")


# -- the aggregator's Lease ---------------------------------------------------------------


async def test_refuses_while_the_aggregator_holds_its_lease_unless_forced(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    rayservice_and_raycluster(kube_emulator)
    async with aggregator_leading(kube_emulator):
        refused = await cleanup()
        assert refused.code == 2, refused.stderr
        assert "refusing to clean up" in refused.stderr
        assert "ray-serve-health/ray-serve-health-aggregator is held by" in refused.stderr
        assert "--replicas=0" in refused.stderr
        assert writes(kube_emulator) == []

        dry = await cleanup("--dry-run=true")
        assert dry.code == 0
        assert "without --dry-run this would refuse" in dry.stderr

        forced = await cleanup("--force=true")
        assert forced.code == 0, forced.stderr
        assert "--force: cleaning up anyway" in forced.stderr
        assert serve_labels(kube_emulator)["svc-worker-0"] == "true"


@pytest.mark.parametrize("holder", ["", "crashed-aggregator_0f0f"], ids=["released", "stale"])
async def test_a_released_or_stale_lease_does_not_hold_it_back(
    kube_emulator: KubeEmulator, cleanup: Any, holder: str
) -> None:
    rayservice_and_raycluster(kube_emulator)
    renewed = "2026-01-01T00:00:00.000000Z"
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 1, "renewTime": renewed}
    kube_emulator.put_object(
        LEASES, {"metadata": {"namespace": LEASE_NS, "name": LEASE}, "spec": spec}
    )
    result = await cleanup()
    assert result.code == 0, result.stderr
    assert serve_labels(kube_emulator)["svc-worker-0"] == "true"
    if holder:  # watched for its duration, nobody renewed it
        assert "was not renewed for its 1s: expired" in result.stderr


# -- agents in fallback (issue 28, point 4) --------------------------------------------------

NOW = datetime.datetime.now(datetime.UTC)


def ago(seconds: float) -> datetime.datetime:
    return NOW - datetime.timedelta(seconds=seconds)


def released_lease(kube: KubeEmulator, when: datetime.datetime) -> None:
    """The aggregator's Lease as a stopped aggregator leaves it: released at ``when``."""
    spec = {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time(when)}
    kube.put_object(LEASES, {"metadata": {"namespace": LEASE_NS, "name": LEASE}, "spec": spec})


def agent_condition(kube: KubeEmulator, name: str, status: str, when: datetime.datetime) -> None:
    """The condition of pod ``name`` as a DaemonSet agent in fallback writes it, at ``when``."""
    pod = kube.pod(NS, name)
    assert pod is not None
    others = [c for c in pod["status"]["conditions"] if c["type"] != GATE]
    pod["status"]["conditions"] = [
        *others,
        {
            "type": GATE,
            "status": status,
            "reason": marks.CONDITION_REASON,
            "message": (
                "no aggregator: written by the agent node node-1 (DaemonSet) (NOT_READY: 503)"
            ),
            "lastTransitionTime": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    ]
    kube.put_object(PODS, pod)


def agents_wrote(kube: KubeEmulator, when: datetime.datetime) -> None:
    """What agents in fallback leave, written at ``when``: a gated pod set False (reason
    NoAggregator), a RayService worker's label with the annotation beside it."""
    add(kube, "gated-w", gated=True)
    agent_condition(kube, "gated-w", "False", when)
    add(kube, "marked-w", serve="true", env={RAY_SERVICE_ENV: "0"})
    mark = marks.annotation_value(micro_time(when), "ray/marked-w (sidecar)")
    pod = kube.pod(NS, "marked-w")
    assert pod is not None
    pod["metadata"]["annotations"] = {marks.ANNOTATION: mark}
    kube.put_object(PODS, pod)


async def test_refuses_while_agents_wrote_after_the_aggregator_went_away(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    kube = kube_emulator
    released_lease(kube, ago(30))
    agents_wrote(kube, ago(10))
    before = kube.list_objects(PODS)

    refused = await cleanup("--mode=both")
    assert refused.code == 2, refused.stderr
    assert writes(kube, resource=None) == []
    assert kube.list_objects(PODS) == before
    assert "refusing to clean up: agents in fallback" in refused.stderr
    assert "wrote 2 pods after" in refused.stderr
    assert (
        "ray/gated-w (condition ray.io/serve-proxy-healthy=False, reason NoAggregator, by the "
        "agent node node-1 (DaemonSet), at"
    ) in refused.stderr
    assert (
        "ray/marked-w (annotation ray-serve-health/fallback-write (a label), by the agent "
        "ray/marked-w (sidecar), at"
    ) in refused.stderr
    assert f"kubectl -n {LEASE_NS} delete daemonset/ray-serve-health-agent" in refused.stderr
    assert "--force=true" in refused.stderr
    assert "summary:" not in refused.stdout

    dry = await cleanup("--mode=both", "--dry-run=true")
    assert dry.code == 0, dry.stderr
    assert "without --dry-run this would refuse: refusing to clean up" in dry.stderr
    assert writes(kube, resource=None) == []

    forced = await cleanup("--mode=both", "--force=true")
    assert forced.code == 0, forced.stderr
    assert "--force: cleaning up anyway" in forced.stderr
    assert_no_marks_left(kube)


def assert_no_marks_left(kube: KubeEmulator) -> None:
    """No pod carries an agent's annotation, a NoAggregator condition, or our condition
    False."""
    for pod in kube.list_objects(PODS):
        name = pod["metadata"]["name"]
        assert marks.ANNOTATION not in (pod["metadata"].get("annotations") or {}), name
        for condition in pod.get("status", {}).get("conditions") or []:
            assert condition.get("reason") != marks.CONDITION_REASON, (name, condition)
            assert condition["type"] != GATE or condition["status"] == "True", (name, condition)


@pytest.mark.parametrize(
    ("lease", "flags"),
    [
        pytest.param(True, (), id="marks before the release: an earlier outage"),
        pytest.param(False, ("--fallback-window=5s",), id="no Lease: marks older than the window"),
    ],
)
async def test_old_marks_hold_nothing_back_and_are_removed(
    kube_emulator: KubeEmulator, cleanup: Any, lease: bool, flags: tuple[str, ...]
) -> None:
    kube = kube_emulator
    agents_wrote(kube, ago(60))
    if lease:
        released_lease(kube, ago(30))
    result = await cleanup("--mode=both", *flags)
    assert result.code == 0, result.stderr
    assert "refusing" not in result.stderr
    assert_no_marks_left(kube)
    assert kube.pod_conditions(NS, "gated-w")[GATE]["reason"] == UNINSTALLED_REASON
    assert "ray/marked-w: remove annotation ray-serve-health/fallback-write" in result.stdout
    assert sorted(writes(kube)) == ["PATCH gated-w/status", "PATCH marked-w"]
    again = await cleanup("--mode=both", *flags)
    assert again.summary.startswith("summary: 2 pods: 0 changed, 2 already right, 0 failed")


async def test_without_a_lease_recent_marks_refuse(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    agents_wrote(kube_emulator, ago(5))
    refused = await cleanup("--mode=both", "--fallback-window=10m")
    assert refused.code == 2, refused.stderr
    assert "(--fallback-window before this run)" in refused.stderr
    assert writes(kube_emulator, resource=None) == []


async def test_an_agent_writing_back_fails_the_run_and_the_next_one_refuses(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    """An agent in fallback that had nothing to write before the cleanup (no mark to find)
    writes back what it changed: the second look (--verify-for) finds it."""
    kube = kube_emulator
    released_lease(kube, ago(30))
    add(kube, "gated-w", gated=True, condition=("False", "ServeProxyNotServing"))
    add(kube, "other-w", gated=True, condition=("True", "ServeProxyServing"))

    async def agent() -> None:
        await eventually(lambda: kube.pod_conditions(NS, "gated-w")[GATE]["status"] == "True")
        agent_condition(kube, "gated-w", "False", datetime.datetime.now(datetime.UTC))

    writing_back = asyncio.create_task(agent())
    result = await cleanup("--mode=condition", "--verify-for=3s")
    await writing_back
    assert result.code == 1, result.stderr
    assert result.summary == "ray/gated-w: written back by an agent in fallback"
    assert "summary: 2 pods: 2 changed, 0 already right, 0 failed" in result.stdout
    assert "not cleaned up for good: agents in fallback" in result.stderr
    assert "wrote 1 pod after" in result.stderr
    assert "delete daemonset/ray-serve-health-agent" in result.stderr
    assert kube.pod_conditions(NS, "other-w")[GATE]["reason"] == UNINSTALLED_REASON

    again = await cleanup("--mode=condition")
    assert again.code == 2, again.stderr
    assert "refusing to clean up: agents in fallback" in again.stderr
    assert "ray/gated-w (condition ray.io/serve-proxy-healthy=False" in again.stderr


async def test_the_second_look_passes_when_nothing_writes_back(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    add(kube_emulator, "gated-w", gated=True, condition=("False", "ServeProxyNotServing"))
    result = await cleanup("--mode=condition", "--verify-for=1s")
    assert result.code == 0, result.stderr
    assert "watching for 1s that no agent in fallback writes back" in result.stderr
    dry = await cleanup("--mode=condition", "--verify-for=1h", "--dry-run=true")
    assert dry.code == 0  # a dry run changes nothing: no second look (or it would take 1 h)


# -- API trouble ----------------------------------------------------------------------------


async def test_500s_are_retried(kube_emulator: KubeEmulator, cleanup: Any) -> None:
    rayservice_and_raycluster(kube_emulator)
    fault = kube_emulator.fail_next(2, status=500, method="PATCH", name="svc-worker-0")
    result = await cleanup()
    assert result.code == 0, result.stderr
    assert len(fault) == 2
    assert serve_labels(kube_emulator)["svc-worker-0"] == "true"
    assert writes(kube_emulator).count("PATCH svc-worker-0") == 3
    assert "HTTP 500" in result.stderr
    assert "(attempt 1/10, retrying in" in result.stderr
    assert "(attempt 2/10, retrying in" in result.stderr
    assert result.summary.startswith("summary: 6 pods: 4 changed, 2 already right, 0 failed")


async def test_a_pod_deleted_meanwhile_is_counted_and_not_fatal(
    kube_emulator: KubeEmulator, cleanup: Any
) -> None:
    rayservice_and_raycluster(kube_emulator)
    kube_emulator.pod_not_found(NS, "svc-worker-1")  # listed, then 404 on every request
    result = await cleanup()
    assert result.code == 0, result.stderr
    assert "ray/svc-worker-1: gone (deleted meanwhile)" in result.stdout
    assert writes(kube_emulator).count("PATCH svc-worker-1") == 1  # not retried
    assert serve_labels(kube_emulator)["svc-worker-0"] == "true"
    assert result.summary == (
        "summary: 6 pods: 3 changed, 2 already right, 0 failed, 1 gone (deleted meanwhile)"
    )


@pytest.mark.parametrize(
    ("status", "count", "flags"),
    [
        pytest.param(403, 1, (), id="403 refused"),
        pytest.param(500, 5, ("--max-attempts=3",), id="500 beyond max attempts"),
    ],
)
async def test_a_write_that_fails_fails_the_run_not_the_others(
    kube_emulator: KubeEmulator, cleanup: Any, status: int, count: int, flags: tuple[str, ...]
) -> None:
    rayservice_and_raycluster(kube_emulator)
    kube_emulator.fail_next(count, status=status, method="PATCH", name="plain-worker")
    result = await cleanup(*flags)
    assert result.code == 1
    assert "ray/plain-worker: FAILED to remove label ray.io/serve" in result.stdout
    assert serve_labels(kube_emulator)["plain-worker"] == "false"
    assert serve_labels(kube_emulator)["svc-worker-0"] == "true"
    assert result.summary.startswith("summary: 6 pods: 3 changed, 2 already right, 1 failed")


@pytest.fixture
def dead_kubeconfig(kube_emulator: KubeEmulator, kubeconfig_path: Path, tmp_path: Path) -> Path:
    """The emulator's kubeconfig, pointing at a port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = tmp_path / "dead-kubeconfig"
    server = str(kube_emulator.url).rstrip("/")
    dead.write_text(kubeconfig_path.read_text().replace(server, f"http://127.0.0.1:{port}"))
    return dead


async def test_an_api_that_does_not_answer_fails_the_run_without_a_refusal(
    cleanup: Any, dead_kubeconfig: Path
) -> None:
    result = await cleanup(
        f"--kubeconfig={dead_kubeconfig}", "--max-attempts=2", "--kube-timeout=2s"
    )
    assert result.code == 1
    assert "(attempt 1/2, retrying in" in result.stderr
    assert "the Kubernetes API does not answer" in result.stderr
    assert "refusing" not in result.stderr
