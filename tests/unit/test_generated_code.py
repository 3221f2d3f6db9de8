"""The checked-in generated code must be exactly what proto/generate.py produces from the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = {p.name: p.read_bytes() for p in module.generate(tmp_path)}
    v1 = ROOT / "client" / "kvbroker" / "v1"
    checked_in = {p.name: p.read_bytes() for p in [*v1.glob("*_pb2*"), v1 / module.DESCRIPTOR_SET] if p.exists()}
    assert fresh, "generation produced nothing"
    assert sorted(fresh) == sorted(checked_in), "generated file set differs: run `python proto/generate.py`"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated files {stale}: run `{sys.executable} proto/generate.py`"
