"""Regenerate the flag tables in README.md from the settings dataclasses.

    python scripts/gen_docs.py          # rewrite README.md in place
    python scripts/gen_docs.py --check  # exit 1 if README.md is out of date

The tables sit between ``<!-- flags:NAME -->`` and ``<!-- /flags:NAME -->`` markers;
tests/docs/test_readme.py runs the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from aggregator.settings import Settings as AggregatorSettings
from node_agent.settings import Settings as AgentSettings
from servehealth_common.config import describe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TABLES = {"aggregator": AggregatorSettings, "agent": AgentSettings}


def table(cls: type) -> str:
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for row in describe(cls):
        help_text = row["help"].replace("|", "\\|")
        lines.append(f"| `{row['flag']}` | `{row['env']}` | `{row['default']}` | {help_text} |")
    return "\n".join(lines)


def render(text: str) -> str:
    for name, cls in TABLES.items():
        pattern = re.compile(
            rf"(<!-- flags:{name} -->\n).*?(<!-- /flags:{name} -->)", flags=re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- flags:{name} --> section")
        text = pattern.sub(lambda m, c=cls: m.group(1) + table(c) + "\n" + m.group(2), text)
    return text


def main() -> int:
    current = README.read_text()
    fresh = render(current)
    if "--check" in sys.argv[1:]:
        if fresh != current:
            print("README.md flag tables are out of date: run python scripts/gen_docs.py")
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
