"""Settings that roll (issue 28, point 3): the aggregator's settings ConfigMap carries kustomize's
content hash in its name, and everything that names it follows, so that a changed setting
reaches the aggregator, the DaemonSet agents, the cleanup's Job template and both admission
policies in one `kubectl apply -k`: a new ConfigMap, new pod templates (a rollout), new policy
constants. With a fixed name the policies changed at once and the programs only at their next
restart (the aggregator then refused by its own policy, the agents with a stale selector).

tests/deploy/fixtures/settings-change is a user's overlay that changes one setting (the
condition type) of the readiness-gate overlay."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    ROOT,
    SETTINGS,
    find,
    is_settings_name,
    kustomize,
    render,
    render_text,
    renderable,
    settings_configmap,
)

BASE = "deploy/overlays/readiness-gate-mode"
FIXTURE = Path(__file__).parent / "fixtures" / "settings-change"
OLD, NEW = "ray.io/serve-proxy-healthy", "example.com/serve-ready"
NAMES = re.compile(re.escape(SETTINGS) + r"[-a-z0-9]*")
INSTALLS = [
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/overlays/namespaced",
    "deploy/examples/production",
    "deploy/examples/tls-secret",
    "deploy/examples/monitoring",
    "deploy/examples/label-mode-fallback",
    "deploy/examples/both-mode",
]
# What reads the settings: each must name the ConfigMap in its pod template, so that a new name
# is a new template (a rollout).
READERS = [
    ("Deployment", "ray-serve-health-aggregator"),
    ("DaemonSet", "ray-serve-health-agent"),
    ("CronJob", "ray-serve-health-cleanup"),
]
POLICIES = ["ray-serve-health-aggregator", "ray-serve-health-agent"]


def names_in(text: str) -> set[str]:
    return set(NAMES.findall(text))


@pytest.mark.parametrize("directory", INSTALLS)
def test_the_settings_configmap_has_a_content_hash_in_its_name(directory: str) -> None:
    name = settings_configmap(render(directory))["metadata"]["name"]
    assert name != SETTINGS
    assert is_settings_name(name)


def test_a_changed_setting_renames_the_configmap_and_every_reference_follows() -> None:
    before_text, after_text = render_text(Path(BASE)), kustomize(FIXTURE)
    before = [doc for doc in yaml.safe_load_all(before_text) if doc]
    after = [doc for doc in yaml.safe_load_all(after_text) if doc]
    old_name = settings_configmap(before)["metadata"]["name"]
    new_name = settings_configmap(after)["metadata"]["name"]
    assert settings_configmap(after)["data"]["SERVE_HEALTH_CONDITION_TYPE"] == NEW
    assert new_name != old_name
    # No reference to the unsuffixed or the stale name anywhere in the output.
    assert names_in(after_text) == {new_name}
    assert names_in(before_text) == {old_name}
    for kind, name in READERS:
        template = yaml.safe_dump(find(after, kind, name)["spec"])
        assert new_name in template, f"{kind} {name} does not name the new settings"
    # The admission policies take the setting as a constant: they change in the same apply.
    for name in POLICIES:
        old_spec = yaml.safe_dump(find(before, "ValidatingAdmissionPolicy", name)["spec"])
        new_spec = yaml.safe_dump(find(after, "ValidatingAdmissionPolicy", name)["spec"])
        assert f"'{OLD}'" in old_spec, name
        assert f"'{NEW}'" not in old_spec, name
        assert f"'{NEW}'" in new_spec, name
        assert f"'{OLD}'" not in new_spec, name


def applied(directory: Path) -> bool:
    """Kustomizations one applies (overlays, examples, the uninstall): not the bases, which
    name the settings for an overlay to render."""
    return not str(directory).startswith("deploy/base/")


@pytest.mark.parametrize(
    "directory", [pytest.param(d, id=str(d)) for d in renderable() if applied(d)]
)
def test_whatever_names_the_settings_renders_them(directory: Path) -> None:
    """A kustomization that is applied names only the settings ConfigMap it renders itself
    (by its hashed name): a reference to another name would point at nothing after a change."""
    text = render_text(directory)
    named = names_in(text)
    if not named:
        return
    objects: list[dict[str, Any]] = [doc for doc in yaml.safe_load_all(text) if doc]
    configmap = settings_configmap(objects)
    assert named == {configmap["metadata"]["name"]}


def test_the_docs_never_tell_to_edit_the_settings_in_place() -> None:
    """`kubectl edit` of the ConfigMap would change what a new pod reads and nothing else: the
    overlay is where settings change."""
    offending = []
    for path in [*ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"kubectl\b.*\b(edit|patch|replace)\b.*\b(configmaps?|cm)\b", line):
                offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
            if re.search(r"kubectl\b.*" + re.escape(SETTINGS), line):
                offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offending == []


@pytest.mark.parametrize("directory", INSTALLS)
def test_the_cleanup_template_never_runs_on_its_own(directory: str) -> None:
    """The cleanup Job lives with the installation as a suspended CronJob (so that kustomize
    renames its reference to the settings too): it runs only as the Job created from it by hand
    (docs/install.md, "Uninstalling"), as the aggregator's ServiceAccount, on our image, under a
    restricted security context; exit 2 (refused) fails the Job at once."""
    objects = render(directory)
    cronjob = find(objects, "CronJob", "ray-serve-health-cleanup")
    assert cronjob["spec"]["suspend"] is True
    job = cronjob["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["serve-health-cleanup"]
    image = find(objects, "Deployment", "ray-serve-health-aggregator")["spec"]["template"]
    assert container["image"] == image["spec"]["containers"][0]["image"]
    assert pod["serviceAccountName"] == "ray-serve-health-aggregator"
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["envFrom"] == [
        {"configMapRef": {"name": settings_configmap(objects)["metadata"]["name"]}}
    ]
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"]["values"] == [2]
