"""Count the lines of the three product packages that hold code (issue 25's measure).

A line counts if a token other than a comment, a newline or an indent is on it and it is not
part of a docstring; blank lines, comments and docstrings do not count, nor do the generated
protobuf modules. Usage: ``python scripts/code_lines.py [ROOT] [-v]`` (``-v``: the 40 largest
files too); ``git archive REV aggregator node_agent servehealth_common | tar -x -C DIR`` and
``python scripts/code_lines.py DIR`` count another commit.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

PACKAGES = ("aggregator", "node_agent", "servehealth_common")
NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}
HAVE_DOCSTRINGS = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, HAVE_DOCSTRINGS) or not node.body:
            continue
        first = node.body[0]
        value = first.value if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstring_lines(ast.parse(source)))


def main(argv: list[str]) -> None:
    args = [arg for arg in argv if arg != "-v"]
    root = Path(args[0] if args else ".")
    counted = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" not in path.name:
                source = path.read_text()
                counted.append((code_lines(source), len(source.splitlines()), path))
    if "-v" in argv:
        for code, every, path in sorted(counted, reverse=True)[:40]:
            print(code, every, path.relative_to(root))
    print("code", sum(c[0] for c in counted), "all", sum(c[1] for c in counted))


if __name__ == "__main__":
    main(sys.argv[1:])
