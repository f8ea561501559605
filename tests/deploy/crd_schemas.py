"""Offline validation of custom resources against the schemas in their CRDs, for the kinds
kubernetes-validate has no schema for: KubeRay's RayService (deploy/examples), the Prometheus
Operator's ServiceMonitor and PrometheusRule (deploy/components/monitoring), cert-manager's
Issuer and Certificate, from the CRDs vendored in tests/deploy/crds/ (their source and version
are in each file's first lines); the PodMonitor from a schema derived from the ServiceMonitor's
(below).

A CRD's ``openAPIV3Schema`` is turned into a JSON Schema the way the API server reads it, and
strict like kubernetes-validate's strict mode: ``nullable`` allows null, and an object with
``properties`` (and no ``x-kubernetes-preserve-unknown-fields`` or ``additionalProperties``)
takes no other field, so a misspelt field is an error here (the API server would drop it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict(schema: Any) -> Any:
    """The JSON Schema equivalent of a structural OpenAPI v3 schema, unknown fields refused."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    names = ("properties", "patternProperties")  # names of fields, not schemas: map each value
    out = {key: strict(value) for key, value in schema.items() if key not in names}
    for key in names:
        if key in schema:
            out[key] = {name: strict(value) for name, value in schema[key].items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON Schema, for every served version of every vendored CRD."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        # libyaml's loader where PyYAML has it: KubeRay's RayService CRD is 1 MB (10 s in
        # pure Python, well under 1 s in C).
        for crd in yaml.load_all(path.read_text(), Loader=SAFE_LOADER):
            if not crd:
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = strict(version["schema"]["openAPIV3Schema"])
                # The API server checks metadata as ObjectMeta; the CRD says only "object".
                schema["properties"]["metadata"] = {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "namespace": {"type": "string"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                    },
                    "additionalProperties": False,
                }
                found[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = schema
    monitor = found.get(("monitoring.coreos.com/v1", "ServiceMonitor"))
    if monitor is not None:
        found[("monitoring.coreos.com/v1", "PodMonitor")] = podmonitor_schema(monitor)
    return found


# The Prometheus Operator's PodMonitor (deploy/components/monitoring scrapes the agents with
# it) has no CRD vendored here. Its schema is derived from the vendored ServiceMonitor's, whose
# selectors and endpoint fields a PodMonitor shares: the spec fields and endpoint fields below,
# all of which the PodMonitor API (monitoring.coreos.com/v1, spec.podMetricsEndpoints) has too,
# with the ServiceMonitor's types; any other field is refused. Narrower than the real CRD, never
# wider: what validates here validates against it.
PODMONITOR_SPEC_FIELDS = ("selector", "namespaceSelector", "jobLabel", "podTargetLabels")
PODMONITOR_ENDPOINT_FIELDS = (
    "port",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "relabelings",
    "metricRelabelings",
    "params",
)


def podmonitor_schema(servicemonitor: dict[str, Any]) -> dict[str, Any]:
    """A strict JSON Schema for PodMonitor, from ServiceMonitor's (see above)."""
    spec = servicemonitor["properties"]["spec"]
    endpoint = spec["properties"]["endpoints"]["items"]
    endpoint_schema = {
        "type": "object",
        "properties": {k: endpoint["properties"][k] for k in PODMONITOR_ENDPOINT_FIELDS},
        "additionalProperties": False,
    }
    properties = {k: spec["properties"][k] for k in PODMONITOR_SPEC_FIELDS}
    properties["podMetricsEndpoints"] = {"type": "array", "items": endpoint_schema}
    schema = dict(servicemonitor)
    schema["properties"] = {
        **servicemonitor["properties"],
        "spec": {
            "type": "object",
            "properties": properties,
            "required": ["selector"],
            "additionalProperties": False,
        },
    }
    schema["required"] = ["spec"]
    return schema


def groups() -> set[str]:
    """The API groups the vendored CRDs define."""
    return {api_version.split("/")[0] for api_version, _ in schemas()}


def problems(obj: dict[str, Any]) -> list[str]:
    """Validation errors of a custom resource of a vendored CRD's group; empty if valid."""
    schema = schemas().get((obj["apiVersion"], obj["kind"]))
    if schema is None:
        return [f"no vendored CRD defines {obj['apiVersion']} {obj['kind']} (tests/deploy/crds)"]
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{error.message} at {'/'.join(map(str, error.absolute_path))}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: str(list(e.absolute_path)))
    ]
