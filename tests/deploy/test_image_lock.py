"""requirements/image.txt, the image's locked dependencies: it pins every runtime dependency of
pyproject.toml to a version its specifier allows, with hashes and nothing else (no index, no
local path); the Dockerfile installs it with hash checking and the project without
dependencies; scripts/lock-image makes the same file again (from PyPI: this part needs the
network, and fails in CI without it); and the image's two platforms, linux x86_64 and aarch64
with the base image's CPython, install it from wheels whose hashes match."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.manifests import ROOT
from tests.deploy.test_dockerfile import stages

LOCK = ROOT / "requirements" / "image.txt"
SCRIPT = ROOT / "scripts" / "lock-image"
PYPI = "https://pypi.org/simple"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPENDENCIES = [Requirement(line) for line in PYPROJECT["project"]["dependencies"]]
# The base image's Python, from its tag (python:3.11.14-slim-trixie@sha256:...).
BASE = stages()[0][0][1].split()[0]
PYTHON_FULL = re.match(r"python:(\d+\.\d+\.\d+)", BASE)[1]  # type: ignore[index]
PYTHON = PYTHON_FULL.rpartition(".")[0]
# The image's platforms: uv's names for them (trixie has glibc 2.41, so manylinux_2_40 wheels
# and older run) and the marker values pip sees there.
PLATFORMS = {"x86_64": "x86_64-manylinux_2_40", "aarch64": "aarch64-manylinux_2_40"}
ENVIRONMENTS = {
    machine: {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "python_version": PYTHON,
        "python_full_version": PYTHON_FULL,
    }
    for machine in PLATFORMS
}


@dataclass(frozen=True)
class Pin:
    requirement: Requirement
    hashes: tuple[str, ...]

    def applies(self, machine: str) -> bool:
        marker = self.requirement.marker
        return marker is None or marker.evaluate(ENVIRONMENTS[machine])


def lock_entries(text: str) -> list[str]:
    """The file's entries, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = (line.strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def pins() -> list[Pin]:
    result = []
    for entry in lock_entries(LOCK.read_text()):
        spec, *hashes = entry.split(" --hash=")
        result.append(Pin(Requirement(spec.strip()), tuple(h.strip() for h in hashes)))
    return result


def header_command() -> list[str]:
    """The uv command line that the lock's header records (scripts/lock-image writes it)."""
    for line in LOCK.read_text().splitlines():
        if line.startswith("#    uv pip compile "):
            return shlex.split(line.removeprefix("#    "))
        if not line.startswith("#"):
            break
    pytest.fail(f"{LOCK.relative_to(ROOT)} records no uv command in its header", pytrace=False)


def option(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {shlex.join(command)}"
    return command[command.index(name) + 1]


def uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.fail("uv is not installed: pip install -e '.[test]'", pytrace=False)
    return find_uv_bin()


def uv_environment() -> dict[str, str]:
    """This environment without uv's settings (other indexes, find-links...), as the script
    runs it; the cache, TLS and timeouts stay."""
    keep = {"UV_CACHE_DIR", "UV_HTTP_TIMEOUT", "UV_NATIVE_TLS", "UV_SYSTEM_CERTS"}
    return {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k in keep}


def require_pypi() -> None:
    """PyPI answers, or the test is skipped saying why; in CI (``CI`` set) it fails."""
    try:
        with urllib.request.urlopen(f"{PYPI}/h11/", timeout=15) as response:
            response.read(1)
    except OSError as error:  # urllib.error.URLError and timeouts among them
        message = f"PyPI ({PYPI}) cannot be reached: {error}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


# Offline: the file itself and the Dockerfile.


@pytest.mark.parametrize("machine", list(PLATFORMS))
@pytest.mark.parametrize("dependency", [pytest.param(d, id=d.name) for d in DEPENDENCIES])
def test_every_runtime_dependency_is_pinned_within_its_specifier(
    dependency: Requirement, machine: str
) -> None:
    if dependency.marker is not None and not dependency.marker.evaluate(ENVIRONMENTS[machine]):
        pytest.skip(f"{dependency} is not for linux {machine}")
    found = [
        pin
        for pin in pins()
        if canonicalize_name(pin.requirement.name) == canonicalize_name(dependency.name)
        and pin.applies(machine)
    ]
    assert len(found) == 1, f"{dependency.name}: {len(found)} pins for linux {machine}"
    (version,) = [spec.version for spec in found[0].requirement.specifier]
    assert dependency.specifier.contains(version, prereleases=True), (
        f"{dependency.name}=={version} is outside pyproject.toml's {dependency}: "
        "run scripts/lock-image"
    )


def test_every_pin_is_exact_with_hashes_and_names_no_index_or_path() -> None:
    text = LOCK.read_text()
    options = [entry for entry in lock_entries(text) if entry.startswith("-")]
    assert not options, f"options in the lock: {options}"
    assert not re.search(r"file:|/opt/|/home/|/tmp/|/work/", text), "a local path in the lock"
    found = pins()
    assert len(found) >= len(DEPENDENCIES)
    for pin in found:
        specifiers = list(pin.requirement.specifier)
        assert len(specifiers) == 1, pin.requirement
        assert specifiers[0].operator == "==", pin.requirement
        assert not pin.requirement.url, pin.requirement
        assert not pin.requirement.extras, pin.requirement
        assert pin.hashes, f"{pin.requirement.name} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in pin.hashes), pin.hashes
    names = [canonicalize_name(pin.requirement.name) for pin in found if pin.applies("x86_64")]
    assert len(names) == len(set(names)), "a package pinned twice for the same platform"


def test_the_header_records_a_reproducible_command_for_the_base_images_python() -> None:
    command = header_command()
    assert command[:4] == ["uv", "pip", "compile", "pyproject.toml"], command
    # Runtime dependencies only: no extra, no group.
    assert not {"--extra", "--all-extras", "--group"} & set(command), command
    assert option(command, "--python-version") == PYTHON, f"the base image has Python {PYTHON}"
    assert "--universal" in command, "one resolution for both platforms"
    assert "--generate-hashes" in command
    assert option(command, "--default-index") == PYPI
    assert "--no-config" in command
    assert re.fullmatch(r"\d{4}-\d\d-\d\d(T[\d:]+Z)?", option(command, "--exclude-newer"))
    assert f'EXCLUDE_NEWER="{option(command, "--exclude-newer")}"' in SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK), "scripts/lock-image is not executable"


def pip_installs() -> list[str]:
    """Each `pip ... install ...` command of the builder stage's RUN instructions."""
    commands = []
    for keyword, rest in stages()[0]:
        if keyword == "RUN":
            commands += [
                c.strip() for c in rest.split("&&") if re.search(r"\bpip\b.*\binstall\b", c)
            ]
    return commands


def test_dockerfile_installs_the_lock_with_hash_checking_and_the_project_without_deps() -> None:
    copies = [rest.split() for keyword, rest in stages()[0] if keyword == "COPY"]
    assert ["requirements/image.txt", "requirements/image.txt"] in copies
    installs = pip_installs()
    locked = [c for c in installs if "-r requirements/image.txt" in c]
    assert len(locked) == 1, installs
    for flag in ("--require-hashes", "--no-deps", "--only-binary :all:"):
        assert flag in locked[0], f"{flag} missing from: {locked[0]}"
    # Everything else is the project, and brings nothing the lock does not pin.
    others = [c for c in installs if c not in locked]
    assert others, "the project is not installed"
    for command in others:
        assert "--no-deps" in command, f"installs dependencies past the lock: {command}"
        assert " -r " not in command, command
    # Its wheel is built with the base image's setuptools, not one downloaded unpinned.
    run = " ".join(rest for keyword, rest in stages()[0] if keyword == "RUN")
    assert "--no-build-isolation" in run


# Online: PyPI.


def test_the_script_makes_the_same_lock(tmp_path: Path) -> None:
    require_pypi()
    out = tmp_path / "image.txt"
    result = subprocess.run(
        [str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "UV": uv()},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    made, committed = out.read_text(), LOCK.read_text()
    uv_version = subprocess.run(
        [uv(), "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    diff = "".join(
        list(
            difflib.unified_diff(
                committed.splitlines(keepends=True),
                made.splitlines(keepends=True),
                "requirements/image.txt",
                "scripts/lock-image",
            )
        )[:60]
    )
    assert made == committed, (
        f"requirements/image.txt is not what scripts/lock-image makes ({uv_version.strip()}); "
        f"run it and commit the result:\n{diff}"
    )


@pytest.mark.parametrize("machine", list(PLATFORMS))
def test_the_lock_installs_on_each_image_platform(machine: str, tmp_path: Path) -> None:
    """A real install (into a directory, not an environment): uv downloads the wheel this
    platform takes for every pin and checks its hash, and, without --no-deps, that every
    dependency of every pin is itself pinned with a hash."""
    require_pypi()
    command = [
        uv(),
        "pip",
        "install",
        "--quiet",
        "--no-config",
        "--default-index",
        PYPI,
        "--require-hashes",
        "--only-binary",
        ":all:",
        "--python-platform",
        PLATFORMS[machine],
        "--python-version",
        PYTHON,
        "--target",
        str(tmp_path / "target"),
        "-r",
        str(LOCK),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=uv_environment(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    installed = {
        canonicalize_name(p.name.split("-")[0]) for p in (tmp_path / "target").glob("*.dist-info")
    }
    wanted = {canonicalize_name(pin.requirement.name) for pin in pins() if pin.applies(machine)}
    assert wanted <= installed, wanted - installed
