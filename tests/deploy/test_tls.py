"""TLS in deploy/: deploy/components/tls-secret mounts a serving certificate into the aggregator
and the CA into the DaemonSet agents, at the paths their flags name; deploy/components/tls-cert-
manager makes both with cert-manager (self-signed Issuer, CA Certificate, CA Issuer, serving
Certificate), valid against cert-manager's CRDs (vendored in tests/deploy/crds/), for the DNS
names the agents dial, in whatever namespace the aggregator is installed; the probes stay
plaintext."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.manifests import ROOT, environment, find, render, render_written

CERT_MANAGER = "deploy/examples/production"  # readiness-gate mode + tls-cert-manager
SECRETS = "deploy/examples/tls-secret"  # label mode + tls-secret
AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"
SERVING_SECRET = "ray-serve-health-aggregator-tls"
CA_SECRET = "ray-serve-health-ca"


def container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return find(objects, kind, name)["spec"]["template"]["spec"]["containers"][0]


def mounted(objects: list[dict[str, Any]], kind: str, name: str, path: str) -> tuple[str, str]:
    """(Secret, key) whose file is at ``path`` in the first container of workload ``name``."""
    spec = find(objects, kind, name)["spec"]["template"]["spec"]
    file = PurePosixPath(path)
    for mount in spec["containers"][0]["volumeMounts"]:
        if file.parent == PurePosixPath(mount["mountPath"]):
            assert mount.get("readOnly") is True, mount
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            secret = volume["secret"]
            (item,) = [i for i in secret["items"] if i["path"] == file.name]
            return secret["secretName"], item["key"]
    raise AssertionError(f"nothing mounted at {path} in {kind} {name}")


def dialled(objects: list[dict[str, Any]]) -> str:
    """The host name the DaemonSet agents dial (and check the certificate against)."""
    env = environment(container(objects, "DaemonSet", AGENT), objects)
    host = env["SERVE_HEALTH_AGGREGATOR"].rpartition(":")[0]
    namespace = find(objects, "DaemonSet", AGENT)["metadata"]["namespace"]
    return host.replace("downward-pod_namespace", namespace)


@pytest.mark.parametrize("directory", [CERT_MANAGER, SECRETS])
def test_the_aggregator_serves_tls_and_the_agents_trust_its_ca(directory: str) -> None:
    objects = render(directory)
    aggregator = environment(container(objects, "Deployment", AGGREGATOR), objects)
    assert mounted(objects, "Deployment", AGGREGATOR, aggregator["SERVE_HEALTH_TLS_CERT"]) == (
        SERVING_SECRET,
        "tls.crt",
    )
    assert mounted(objects, "Deployment", AGGREGATOR, aggregator["SERVE_HEALTH_TLS_KEY"]) == (
        SERVING_SECRET,
        "tls.key",
    )
    agent = environment(container(objects, "DaemonSet", AGENT), objects)
    # Only ca.crt: cert-manager's CA Secret also holds the CA's key.
    assert mounted(objects, "DaemonSet", AGENT, agent["SERVE_HEALTH_TLS_CA"]) == (
        CA_SECRET,
        "ca.crt",
    )
    spec = find(objects, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    for volume in spec["volumes"]:
        if volume.get("secret", {}).get("secretName") == CA_SECRET:
            assert [i["key"] for i in volume["secret"]["items"]] == ["ca.crt"]
    # The probes stay plaintext HTTP on the metrics port, never on the TLS port.
    for kind, name in (("Deployment", AGGREGATOR), ("DaemonSet", AGENT)):
        probed = container(objects, kind, name)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in probed:
                assert probed[probe]["httpGet"]["port"] == "metrics", (name, probe)
                assert probed[probe]["httpGet"].get("scheme", "HTTP") == "HTTP"
    # The gRPC port no longer claims HTTP/2 in cleartext.
    ports = {p["name"]: p for p in find(objects, "Service", AGGREGATOR)["spec"]["ports"]}
    assert "appProtocol" not in ports["grpc"]
    assert ports["metrics"]["appProtocol"] == "http"


def test_cert_manager_makes_a_ca_and_the_serving_certificate() -> None:
    objects = render(CERT_MANAGER)
    issuers = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Issuer"}
    certificates = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Certificate"}
    ca = certificates[CA_SECRET]["spec"]
    assert ca["isCA"] is True
    assert ca["secretName"] == CA_SECRET
    assert ca["privateKey"]["rotationPolicy"] == "Never"  # a renewed CA still verifies
    assert "selfSigned" in issuers[ca["issuerRef"]["name"]]["spec"]
    serving = certificates[SERVING_SECRET]["spec"]
    assert serving["secretName"] == SERVING_SECRET
    assert issuers[serving["issuerRef"]["name"]]["spec"] == {"ca": {"secretName": CA_SECRET}}
    assert "server auth" in serving["usages"]
    for spec in (ca, serving):
        assert spec["issuerRef"]["kind"] == "Issuer"
    # The name the agents dial is in the certificate.
    assert dialled(objects) in serving["dnsNames"]
    namespace = find(objects, "Service", AGGREGATOR)["metadata"]["namespace"]
    for obj in [*issuers.values(), *certificates.values()]:
        assert obj["metadata"]["namespace"] == namespace


def test_the_sidecars_dial_a_name_of_the_certificate() -> None:
    serving = find(render(CERT_MANAGER), "Certificate", SERVING_SECRET)["spec"]
    service = find(render("deploy/examples/rayservice-sidecar"), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    sidecars = [
        c
        for spec in [cluster["headGroupSpec"]["template"]["spec"]]
        + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
        for c in spec["containers"]
        if c.get("command") == ["serve-health-agent"]
    ]
    assert sidecars
    for sidecar in sidecars:
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert env["SERVE_HEALTH_AGGREGATOR"].rpartition(":")[0] in serving["dnsNames"]


def test_cert_manager_objects_validate_against_its_crds() -> None:
    found = [
        f"{obj['kind']} {obj['metadata']['name']}: {problem}"
        for obj in render(CERT_MANAGER)
        if obj["apiVersion"].startswith("cert-manager.io/")
        for problem in crd_schemas.problems(obj)
    ]
    assert not found, "\n".join(found)


def test_cert_manager_validation_is_not_vacuous() -> None:
    certificate = find(render(CERT_MANAGER), "Certificate", SERVING_SECRET)
    certificate["spec"]["dnsName"] = ["typo"]
    assert crd_schemas.problems(certificate)
    certificate = find(render(CERT_MANAGER), "Certificate", SERVING_SECRET)
    del certificate["spec"]["issuerRef"]
    assert crd_schemas.problems(certificate)
    issuer = find(render(CERT_MANAGER), "Issuer", "ray-serve-health-ca")
    issuer["spec"]["ca"] = {"secret": CA_SECRET}
    assert crd_schemas.problems(issuer)


def layered(tmp_path: Path, namespace: str, component: str) -> list[dict[str, Any]]:
    """What renders when ``namespace`` is set in one kustomization (over the label-mode
    overlay) and ``component`` added in the next, as docs/install.md says to."""
    first, second = tmp_path / "namespace", tmp_path / "install"
    for directory, document in (
        (
            first,
            {
                "namespace": namespace,
                "resources": [os.path.relpath(ROOT / "deploy/overlays/label-mode", first)],
            },
        ),
        (
            second,
            {
                "resources": [os.path.relpath(first, second)],
                "components": [os.path.relpath(ROOT / component, second)],
            },
        ),
    ):
        directory.mkdir()
        document = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            **document,
        }
        (directory / "kustomization.yaml").write_text(yaml.safe_dump(document))
    return render_written(second)


def test_dns_names_and_namespace_follow_the_installation(tmp_path: Path) -> None:
    objects = layered(tmp_path, "platform", "deploy/components/tls-cert-manager")
    serving = find(objects, "Certificate", SERVING_SECRET)
    assert serving["spec"]["dnsNames"] == [
        AGGREGATOR,
        f"{AGGREGATOR}.platform",
        f"{AGGREGATOR}.platform.svc",
        f"{AGGREGATOR}.platform.svc.cluster.local",
    ]
    assert dialled(objects) in serving["spec"]["dnsNames"]
    for obj in objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            assert obj["metadata"]["namespace"] == "platform", obj["metadata"]
