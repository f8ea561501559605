"""One version, written once (servehealth_common/version.py), and every place that shows it
agrees: the package metadata (pyproject.toml reads the file), both programs' ``__version__``,
what the agent sends in its hello and the aggregator exports, ``--version`` of the three
commands, the Dockerfile's label, the image tags of deploy/, the image named in the docs, the
newest release in CHANGELOG.md and the release SECURITY.md supports. A release changes the file
and the places the later tests name; these tests say which one was forgotten."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

import aggregator
import node_agent
from servehealth_common.version import __version__

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DISTRIBUTION = "ray-serve-health"
COMMANDS = sorted(PYPROJECT["project"]["scripts"])


def test_the_version_is_a_release_version() -> None:
    assert str(Version(__version__)) == __version__


def test_pyproject_reads_the_version_from_the_one_source() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project, "pyproject.toml writes the version: it must read it"
    assert "version" in project["dynamic"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "servehealth_common.version.__version__"}


def test_the_installed_metadata_has_the_version() -> None:
    installed = importlib.metadata.version(DISTRIBUTION)
    assert installed == __version__, (
        f"installed {installed}, source {__version__}: reinstall (pip install -e .)"
    )


def test_both_programs_and_what_they_send_show_the_version() -> None:
    from aggregator import server, wiring
    from node_agent import agent, daemonset, kube_client

    assert aggregator.__version__ == node_agent.__version__ == __version__
    # The agent's hello (agent_version) in both modes, and the aggregator's start line and
    # serve_health_build_info: each module's own name for it.
    for module in (agent, daemonset, server, wiring):
        assert module.__version__ == __version__, module.__name__
    assert kube_client.USER_AGENT.rpartition("/")[2] == __version__


def test_the_console_scripts_are_the_three_commands() -> None:
    installed = {
        entry.name: entry.value
        for entry in importlib.metadata.distribution(DISTRIBUTION).entry_points
        if entry.group == "console_scripts"
    }
    assert installed == PYPROJECT["project"]["scripts"]
    assert COMMANDS == ["serve-health-agent", "serve-health-aggregator", "serve-health-cleanup"]


@pytest.mark.parametrize("command", COMMANDS)
def test_version_flag_prints_the_command_and_its_version_and_exits_0(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The function the console script runs, with ``--version``: before any setting is
    checked (a bad environment variable does not stop it) and before anything starts."""
    monkeypatch.setenv("SERVE_HEALTH_LOG_LEVEL", "not-a-level")
    (entry,) = [
        e
        for e in importlib.metadata.distribution(DISTRIBUTION).entry_points
        if e.group == "console_scripts" and e.name == command
    ]
    with pytest.raises(SystemExit) as exited:
        entry.load()(["--version"])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out == f"{command} {__version__}\n"
    assert err == ""


def test_the_dockerfile_labels_the_image_with_the_version() -> None:
    labels = re.findall(r'org\.opencontainers\.image\.version="([^"]*)"', _text("Dockerfile"))
    assert labels == [__version__]


def test_deploy_tags_our_image_with_the_version() -> None:
    tags = {}
    for path in sorted((ROOT / "deploy").rglob("kustomization.yaml")):
        for image in yaml.safe_load(path.read_text()).get("images") or []:
            if "ray-serve-health" in image.get("newName", image["name"]) and "newTag" in image:
                tags[path.relative_to(ROOT).as_posix()] = str(image["newTag"])
    assert tags
    assert {where: tag for where, tag in tags.items() if tag != __version__} == {}


@pytest.mark.parametrize("path", ["README.md", "Dockerfile", "docs/install.md", "docs/building.md"])
def test_the_image_the_docs_name_has_the_version(path: str) -> None:
    named = re.findall(r"ray-serve-health:(\d+\.\d+\.\d+\S*?)(?=[`@\s]|$)", _text(path))
    assert all(version == __version__ for version in named), (path, named)


def test_the_changelog_has_this_release_first() -> None:
    releases = re.findall(r"^## \[(\d[^\]]*)\]", _text("CHANGELOG.md"), flags=re.MULTILINE)
    assert releases, "CHANGELOG.md names no release"
    assert releases[0] == __version__


def test_security_md_supports_this_minor_release() -> None:
    release = Version(__version__).release
    minor = f"{release[0]}.{release[1]}"
    text = _text("SECURITY.md")
    assert f"| {minor}.x | yes |" in text
    assert f"(now {minor})" in text


def _text(path: str) -> str:
    return (ROOT / path).read_text()
