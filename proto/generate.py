"""Regenerates the checked-in protobuf/gRPC code under client/kvbroker/v1 from proto/kvbroker/v1/*.proto.

Usage: python proto/generate.py [OUTPUT_ROOT]   (default: client/)

The toolchain is pinned in pyproject.toml's `dev` extra (grpcio-tools, mypy-protobuf) so that the output is
reproducible; tests/unit/test_generated_code.py fails when the checked-in files drift from the .proto sources.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DESCRIPTOR_SET = "descriptors.binpb"


def generate(out_root: Path) -> list[Path]:
    (out_root / "kvbroker" / "v1").mkdir(parents=True, exist_ok=True)
    sources = sorted((PROTO_ROOT / "kvbroker" / "v1").glob("*.proto"))
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    plugin_dir = Path(shutil.which("protoc-gen-mypy") or Path(sys.executable).parent / "protoc-gen-mypy").parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        # Descriptors with comments, served by reflection so that `grpcurl describe` shows them.
        f"--descriptor_set_out={out_root / 'kvbroker' / 'v1' / DESCRIPTOR_SET}",
        "--include_source_info",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted([*(out_root / "kvbroker" / "v1").glob("*_pb2*"), out_root / "kvbroker" / "v1" / DESCRIPTOR_SET])


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "client"
    for path in generate(root):
        print(path)
