"""docs/install.md works as written: every kustomization it shows (``# <dir>/kustomization.yaml``)
renders against this checkout and does what the text says (the image pinned by digest, the
settings ConfigMap merged and followed by the agents, the TLS component in another namespace);
the openssl recipe of its TLS section makes a CA and a certificate that the aggregator accepts,
that carry the name the agents dial, that its kubectl commands store where deploy/components/
tls-secret mounts them, and that a real aggregator serves TLS with (a gRPC health check over TLS
verified by the CA, for that name); and the minimum Kubernetes version it gives is the one the
schemas are checked against."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator.flags import AggregatorFlags
from servehealth_common.config import load
from tests.deploy.manifests import ROOT, environment, find, render, render_written
from tests.deploy.test_probes import command, started, stop
from tests.deploy.test_schemas import OLDEST_SUPPORTED

INSTALL = ROOT / "docs" / "install.md"
TEXT = INSTALL.read_text()
AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"


def kustomization_blocks() -> list[tuple[str, str]]:
    """(directory, content) of every ```yaml block that starts ``# <dir>/kustomization.yaml``."""
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", TEXT, flags=re.DOTALL):
        match = re.match(r"# ([\w-]+)/kustomization\.yaml", block)
        if match:
            found.append((match[1], block))
    return found


def rendered(tmp_path: Path, blocks: list[tuple[str, str]], top: str) -> list[dict[str, Any]]:
    """Write ``blocks`` beside a checkout named ray-serve-health (this one), render ``top``."""
    (tmp_path / "ray-serve-health").symlink_to(ROOT)
    for directory, content in blocks:
        (tmp_path / directory).mkdir(exist_ok=True)
        (tmp_path / directory / "kustomization.yaml").write_text(content)
    return render_written(tmp_path / top)


def images(objects: list[dict[str, Any]]) -> set[str]:
    return {
        c["image"]
        for o in objects
        if o["kind"] in {"Deployment", "DaemonSet"}
        for c in o["spec"]["template"]["spec"]["containers"]
    }


def test_the_docs_show_the_overlays_they_describe() -> None:
    assert [d for d, _ in kustomization_blocks()] == [
        "my-overlay",
        "platform",
        "install",
        "my-overlay",
    ]


def test_step_3_pins_the_image_by_digest(tmp_path: Path) -> None:
    step3 = next(b for b in kustomization_blocks() if b[0] == "my-overlay")
    objects = rendered(tmp_path, [step3], "my-overlay")
    digest = "sha256:" + "0" * 64
    assert images(objects) == {f"registry.example.com/ray-serve-health@{digest}"}


def test_your_own_overlay_changes_the_settings_and_the_agents_follow(tmp_path: Path) -> None:
    own = [b for b in kustomization_blocks() if b[0] == "my-overlay"][-1]
    objects = rendered(tmp_path, [own], "my-overlay")
    deployment = find(objects, "Deployment", AGGREGATOR)
    aggregator = environment(deployment["spec"]["template"]["spec"]["containers"][0], objects)
    daemonset = find(objects, "DaemonSet", AGENT)
    agent = environment(daemonset["spec"]["template"]["spec"]["containers"][0], objects)
    assert aggregator["SERVE_HEALTH_POD_SELECTOR"] == agent["SERVE_HEALTH_POD_SELECTOR"]
    assert aggregator["SERVE_HEALTH_POD_SELECTOR"] == "ray.io/node-type"
    assert aggregator["SERVE_HEALTH_MODE"] == "label"  # the rest of the ConfigMap kept
    assert aggregator["SERVE_HEALTH_LOG_LEVEL"] == "debug"
    assert len([o for o in objects if o["kind"] == "ConfigMap"]) == 1


def test_a_component_in_another_namespace(tmp_path: Path) -> None:
    blocks = [b for b in kustomization_blocks() if b[0] in {"platform", "install"}]
    objects = rendered(tmp_path, blocks, "install")
    certificate = find(objects, "Certificate", "ray-serve-health-aggregator-tls")
    assert certificate["metadata"]["namespace"] == "platform"
    assert f"{AGGREGATOR}.platform.svc.cluster.local" in certificate["spec"]["dnsNames"]
    for name in (AGGREGATOR, AGENT):  # the aggregator's admission policy and the agents'
        policy = find(objects, "ValidatingAdmissionPolicy", name)
        (condition,) = policy["spec"]["matchConditions"]
        assert "'platform'" in condition["expression"]  # its accounts are platform's


def test_the_minimum_kubernetes_version_is_the_one_checked() -> None:
    minimum = re.search(r"\*\*Kubernetes (\d+\.\d+) or newer\*\*", TEXT)
    assert minimum, "docs/install.md names no minimum Kubernetes version"
    assert OLDEST_SUPPORTED.startswith(f"{minimum[1]}.")


# -- the openssl recipe -----------------------------------------------------------------


def recipe() -> str:
    (block,) = [
        b for b in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.DOTALL) if "openssl req" in b
    ]
    return block


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    """Run the recipe in a fresh directory, kubectl replaced by a recorder: (directory, the
    kubectl commands it ran)."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (the recipe needs it)", pytrace=False)
    here = tmp_path_factory.mktemp("tls")
    log = here / "kubectl.log"
    script = f'kubectl() {{ printf "%s\\n" "$*" >> {shlex.quote(str(log))}; }}\n' + recipe()
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=here,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return here, [shlex.split(line) for line in log.read_text().splitlines()]


def test_the_recipe_makes_what_the_aggregator_accepts(made: tuple[Path, list[list[str]]]) -> None:
    here, _ = made
    cert, key = str(here / "aggregator.crt"), str(here / "aggregator.key")
    environ = {"SERVE_HEALTH_TLS_CERT": cert, "SERVE_HEALTH_TLS_KEY": key}
    settings = load(AggregatorFlags, [], environ, "serve-health-aggregator", "")
    assert settings.tls_cert == cert
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", "ca.crt", "aggregator.crt"],
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_recipe_stores_what_tls_secret_mounts(made: tuple[Path, list[list[str]]]) -> None:
    _, commands = made
    objects = render("deploy/examples/tls-secret")
    namespace = find(objects, "Deployment", AGGREGATOR)["metadata"]["namespace"]
    mounted: dict[str, set[str]] = {}
    for kind, name in (("Deployment", AGGREGATOR), ("DaemonSet", AGENT)):
        for volume in find(objects, kind, name)["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                secret = volume["secret"]
                mounted.setdefault(secret["secretName"], set()).update(
                    item["key"] for item in secret["items"]
                )
    created: dict[str, set[str]] = {}
    for args in commands:
        assert args[:3] == ["-n", namespace, "create"], args
        if args[3:5] == ["secret", "tls"]:
            created[args[5]] = {"tls.crt", "tls.key"}
        else:
            assert args[3:5] == ["secret", "generic"], args
            created[args[5]] = {
                a.split("=", 1)[1].split("=")[0] for a in args if "--from-file=" in a
            }
    assert created == mounted


@pytest.fixture(scope="module")
def tls_aggregator(made: tuple[Path, list[list[str]]]) -> Iterator[str]:
    here, _ = made
    process, address = started(
        [
            *command("serve-health-aggregator", "aggregator"),
            "--kube-backend=memory",
            "--auth=none",
            "--listen=127.0.0.1:0",
            "--metrics-listen=127.0.0.1:0",
            f"--tls-cert={here / 'aggregator.crt'}",
            f"--tls-key={here / 'aggregator.key'}",
        ],
        rb"listening on (\S+?:\d+) \(TLS",
        {},
    )
    try:
        yield address
    finally:
        stop(process)


def test_an_agent_verifies_the_aggregator_by_the_name_it_dials(
    made: tuple[Path, list[list[str]]], tls_aggregator: str
) -> None:
    here, _ = made
    objects = render("deploy/examples/tls-secret")
    daemonset = find(objects, "DaemonSet", AGENT)
    agent = environment(daemonset["spec"]["template"]["spec"]["containers"][0], objects)
    name = (
        agent["SERVE_HEALTH_AGGREGATOR"]
        .rpartition(":")[0]
        .replace("downward-pod_namespace", daemonset["metadata"]["namespace"])
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=(here / "ca.crt").read_bytes())
    for target_name, works in ((name, True), ("elsewhere.example.com", False)):
        with grpc.secure_channel(
            tls_aggregator, credentials, options=[("grpc.ssl_target_name_override", target_name)]
        ) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            if works:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            else:
                with pytest.raises(grpc.RpcError):
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
