"""The shape of the product code: function size, and one name for one thing.

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
#: A function's lines at most, from its ``def`` to its end, signature, docstring and comments
#: included; only declarations are left out (an assignment of a constructed object,
#: ``self.x = Counter(...)``: a metrics registry declares dozens, and splitting them would say
#: nothing).
MAX_FUNCTION_LINES = 60


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def _declaration(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Assign | ast.AnnAssign) and isinstance(
        statement.value, ast.Call
    )


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of ``function`` that count toward its length (see MAX_FUNCTION_LINES)."""
    skipped = {
        line
        for statement in function.body
        if _declaration(statement)
        for line in range(statement.lineno, (statement.end_lineno or statement.lineno) + 1)
    }
    end = function.end_lineno or function.lineno
    return sum(1 for line in range(function.lineno, end + 1) if line not in skipped)


def test_no_product_function_is_over_60_lines() -> None:
    """What the old 400-line module cap was for (issue 25): small functions. Module size is
    left to the sub-packages and their import contracts (pyproject.toml)."""
    long = {}
    for path in product_modules():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if (lines := code_lines(node)) > MAX_FUNCTION_LINES:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"split these functions: {long}"


def test_the_function_length_rule_counts_all_but_declarations() -> None:
    """The rule bites: a signature and 60 statements are too many; a docstring and comments
    count; declarations do not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    too_long = ast.parse(f"def f():\n{body}\n").body[0]
    assert isinstance(too_long, ast.FunctionDef)
    assert code_lines(too_long) == 61
    declared = "\n".join(f"    self.m{i} = Counter('m{i}')" for i in range(100))
    text = f'def g(self):\n    """Doc."""\n    # a comment\n{declared}\n    return 1\n'
    declarations = ast.parse(text).body[0]
    assert isinstance(declarations, ast.FunctionDef)
    assert code_lines(declarations) == 4


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
