"""The shape of the product code: module size, and one name for one thing.

The import contracts themselves (layers, the pure core, who reads the flags) are import-linter's
(``[tool.importlinter]`` in pyproject.toml, run by scripts/test); these are the rules it cannot
express.
"""

from __future__ import annotations

import ast
import collections
import tomllib
from pathlib import Path

from servehealth.v1 import servehealth_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("aggregator", "node_agent", "servehealth_common")
MAX_LINES = 400


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def test_no_product_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in product_modules()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (one concern each): {long}"


def test_no_two_product_classes_share_a_name() -> None:
    """Also not with a message of the wire contract (pb.AgentSettings and an agent's settings
    class would read the same in a traceback)."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in product_modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(ROOT)))
    for name in pb.DESCRIPTOR.message_types_by_name:
        where[name].append("proto/servehealth/v1/servehealth.proto")
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"one name, several things: {shared}"


def test_the_cleanup_contract_names_every_other_part_of_the_aggregator() -> None:
    """import-linter cannot say "every module but these": the contract that keeps the cleanup
    program out of the aggregator lists its sources, and a new module or sub-package must join
    that list."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        contract
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract.get("forbidden_modules") == ["aggregator.cleanup"]
    ]
    parts = {
        f"aggregator.{path.stem if path.is_file() else path.name}"
        for path in (ROOT / "aggregator").iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert set(contract["source_modules"]) == parts - {"aggregator.cleanup"}
