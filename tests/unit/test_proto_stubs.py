"""The committed stubs match the .proto, and the Python enums match the wire enums."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.states import ServeState, Source

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("servehealth_pb2.py", "servehealth_pb2.pyi", "servehealth_pb2_grpc.py")


def test_committed_stubs_are_what_protoc_generates(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)],
        check=True,
        timeout=60,
    )
    committed = ROOT / "proto" / "servehealth" / "v1"
    fresh = tmp_path / "servehealth" / "v1"
    stale = [
        name for name in GENERATED if not filecmp.cmp(committed / name, fresh / name, shallow=False)
    ]
    assert not stale, (
        f"stubs out of date: {stale}; run `python scripts/gen_proto.py` and commit the result"
    )


@pytest.mark.parametrize(
    ("python_enum", "wire_enum", "prefix"),
    [
        pytest.param(ServeState, pb.ServeState, "SERVE_STATE_", id="ServeState"),
        pytest.param(Source, pb.Source, "SOURCE_", id="Source"),
    ],
)
def test_python_enums_match_the_wire(python_enum: type, wire_enum: object, prefix: str) -> None:
    wire = {
        name.removeprefix(prefix): number
        for name, number in wire_enum.items()  # type: ignore[attr-defined]
        if not name.endswith("UNSPECIFIED")
    }
    assert wire == {member.name: int(member) for member in python_enum}  # type: ignore[attr-defined]
