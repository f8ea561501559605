"""Regenerate the Python stubs of the wire contract.

    python scripts/gen_proto.py            # writes next to the .proto files in proto/
    python scripts/gen_proto.py OUT_DIR    # writes to OUT_DIR (the freshness test uses this)

The stubs are committed; tests/test_proto_stubs.py fails when they differ from what this
script produces with the pinned grpcio-tools.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    # protoc resolves the file names against -I; run from the proto root.
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
