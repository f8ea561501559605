"""Every object the kustomizations in deploy/ render, and every manifest shown in docs/, is valid
against the Kubernetes OpenAPI schemas, offline (``kubernetes-validate``, strict: unknown fields
are errors), for the oldest Kubernetes the docs support and the newest the package knows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.manifests import ROOT, render, renderable

# docs/install.md: ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) is GA from 1.30,
# as is the node of a DaemonSet agent's token.
OLDEST_SUPPORTED = "1.30.0"
# The operator's docs (issue 6); other pages in docs/ have tests of their own.
DOCS = [ROOT / "docs" / name for name in ("install.md", "configuration.md", "operations.md")]


@pytest.fixture(scope="module")
def validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(
            "kubernetes-validate is not installed: pip install -e '.[test]' "
            "(or pip install kubernetes-validate)",
            pytrace=False,
        )
    return kubernetes_validate


def versions(validator: Any) -> list[str]:
    return sorted({OLDEST_SUPPORTED, validator.latest_version()})


def problems(validator: Any, obj: dict[str, Any]) -> list[str]:
    """Validation errors of ``obj`` for each version; empty if valid."""
    # KubeRay's RayService (deploy/examples), the Prometheus Operator's kinds
    # (deploy/components/monitoring) and cert-manager's (deploy/components/tls-cert-manager):
    # against the schemas of their CRDs, vendored in tests/deploy/crds/ (the same for every
    # Kubernetes version).
    if obj["apiVersion"].split("/")[0] in crd_schemas.groups():
        return [
            f"{obj['kind']} {obj['metadata'].get('name')}: {p}" for p in crd_schemas.problems(obj)
        ]
    found = []
    for version in versions(validator):
        try:
            validator.validate(obj, version, strict=True)
        except validator.ValidationError as error:
            found.append(f"{version}: {error.message} at {'/'.join(map(str, error.path))}")
        except (validator.SchemaNotFoundError, validator.InvalidSchemaError) as error:
            found.append(f"{version}: {error}")
    return [f"{obj['kind']} {obj['metadata'].get('name')}: {p}" for p in found]


@pytest.mark.parametrize("directory", [pytest.param(d, id=d.as_posix()) for d in renderable()])
def test_rendered_objects_validate(validator: Any, directory: Path) -> None:
    found = [p for obj in render(directory) for p in problems(validator, obj)]
    assert not found, "\n".join(found)


def test_validation_is_not_vacuous(validator: Any) -> None:
    """A misspelt field and a wrong type are caught, so a pass above means something; and the
    oldest version checked is old enough to matter (1.29 has no admission policy v1)."""
    deployment = next(o for o in render("deploy/base/aggregator") if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["pth"] = "/readyz"
    assert problems(validator, deployment)
    del container["readinessProbe"]["httpGet"]["pth"]
    container["readinessProbe"]["httpGet"]["port"] = ["metrics"]
    assert problems(validator, deployment)
    policy = next(
        o for o in render("deploy/overlays/label-mode") if o["kind"] == "ValidatingAdmissionPolicy"
    )
    assert not problems(validator, policy)
    with pytest.raises(validator.SchemaNotFoundError):
        validator.validate(policy, "1.29.0", strict=True)


def kubernetes_yaml_blocks() -> list[Any]:
    params = []
    for path in DOCS:
        blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.DOTALL)
        for index, block in enumerate(blocks):
            document = yaml.safe_load(block)
            if not (isinstance(document, dict) and "kind" in document and "apiVersion" in document):
                continue  # a fragment (a pod template part, a kustomize field)
            if document["apiVersion"].startswith("kustomize.config.k8s.io/"):
                continue  # a kustomization, not an API object
            params.append(pytest.param(document, id=f"{path.name}-{index}"))
    return params


@pytest.mark.parametrize("document", kubernetes_yaml_blocks())
def test_manifests_in_the_docs_validate(validator: Any, document: dict[str, Any]) -> None:
    found = problems(validator, document)
    assert not found, "\n".join(found)
