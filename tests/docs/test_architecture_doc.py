"""The design is inside the repository and matches the code: the README links
docs/architecture.md and nothing outside the repository, its layout table names every package,
and docs/architecture.md names every module of the two programs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)")


def packages() -> list[str]:
    """Every Python package of the product and the wire contract, as a path."""
    found = []
    for top in ("aggregator", "node_agent", "servehealth_common", "proto/servehealth/v1"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(str(init.parent.relative_to(ROOT)))
    return [path for path in found if path != "proto/servehealth"]


def test_the_readme_links_the_architecture() -> None:
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("document", MARKDOWN, ids=lambda path: path.name)
def test_no_link_leaves_the_repository(document: Path) -> None:
    for target in LINK.findall(document.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (document.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{document.name} links {target}, outside the repo"
        assert resolved.exists(), f"{document.name} links {target}, which does not exist"


def test_the_layout_table_lists_every_package() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    rows = {match.group(1).rstrip("/") for match in re.finditer(r"^\| `([^`]+)` \|", layout, re.M)}
    missing = [package for package in packages() if package not in rows]
    assert not missing, f"README's layout table does not list {missing}"


def test_the_architecture_names_every_module_of_both_programs() -> None:
    modules = [
        path.relative_to(ROOT / top).as_posix()
        for top in ("aggregator", "node_agent")
        for path in sorted((ROOT / top).rglob("*.py"))
        if not path.name.startswith("__")
    ]
    missing = [module for module in modules if module not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md does not say what these are: {missing}"


#: A module and the names cited of it: `aggregator/decision/core.py` (`_judged`, `Tracker._gate`).
CITED_IN = re.compile(r"`((?:aggregator|node_agent|servehealth_common)/[\w/]+\.py)` \(([^)]*)\)")
#: A name cited as module.name: `core._desire`, `override.wanted`.
DOTTED = re.compile(r"`(\w+)\.(\w+)`")


def defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name``: a function, a class, or an assignment."""
    pattern = rf"^\s*(async def|def|class) {re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]"
    return re.search(pattern, path.read_text(), re.M) is not None


def cited() -> list[tuple[tuple[str, ...], str]]:
    """Each cited name, with the modules it may be in: a module cited by its bare name
    (`wire.pods_from_hello`) is any module of that name (`aggregator/ingest/wire.py`,
    `node_agent/fallback/wire.py`)."""
    found: list[tuple[tuple[str, ...], str]] = []
    for module, names in CITED_IN.findall(ARCHITECTURE):
        for name in re.findall(r"`([\w.]+)`", names):
            found.append(((module,), name.rsplit(".", 1)[-1]))
    modules: dict[str, list[str]] = {}
    for top in ("aggregator", "node_agent", "servehealth_common"):
        for path in sorted((ROOT / top).rglob("*.py")):
            modules.setdefault(path.stem, []).append(path.relative_to(ROOT).as_posix())
    for module, name in DOTTED.findall(ARCHITECTURE):
        if module in modules and name not in ("py", "md"):  # a file name, not a citation
            found.append((tuple(modules[module]), name))
    return found


def test_every_name_the_architecture_cites_exists() -> None:
    """Not only the modules: the functions and classes it cites in them (it cited
    ``core._desire`` and the settle wait long after they were gone)."""
    missing = [
        f"{' or '.join(where)}: {name}"
        for where, name in cited()
        if not any(defines(ROOT / module, name) for module in where)
    ]
    assert not missing, f"docs/architecture.md cites names that do not exist: {missing}"
