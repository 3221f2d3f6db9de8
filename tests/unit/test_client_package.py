"""The client package stays light: importing it pulls in none of the daemon's dependencies."""

from __future__ import annotations

import subprocess
import sys


def test_client_imports_no_server_dependencies() -> None:
    code = (
        "import sys, kvbroker\n"
        "kv = kvbroker.Client('unix:///nonexistent.sock')\n"  # no I/O in the constructor
        # grpc itself imports grpc_health/grpc_reflection when they are installed, so only ours are checked.
        "bad = [m for m in ('kvbrokerd', 'uvloop') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_client_sources_import_only_light_dependencies() -> None:
    import ast
    from pathlib import Path

    import kvbroker

    allowed = {"grpc", "google", "numpy", "kvbroker", "__future__"}
    for path in Path(kvbroker.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    top = name.split(".")[0]
                    assert top in allowed or top in sys.stdlib_module_names, f"{path.name} imports {name}"



def test_the_daemon_imports_only_public_client_modules() -> None:
    """The daemon shares the client's types and statuses through public modules, so that the client may reshape its
    private ones freely."""
    import ast
    from pathlib import Path

    import kvbrokerd

    for path in Path(kvbrokerd.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.module == "kvbroker":
                    names = [f"kvbroker.{a.name}" for a in node.names]
                for name in names:
                    parts = name.split(".")
                    private = [p for p in parts[1:] if p.startswith("_")]
                    assert parts[0] != "kvbroker" or not private, f"{path} imports {name}"


def test_public_names() -> None:
    import kvbroker

    for name in ("Client", "AsyncClient", "CacheDesc", "CacheIndex", "ClusterInfo", "KvCacheExtParam", "DataType",
                 "LlmStatus", "LlmError", "ParamInvalidError", "NotYetLinkError", "KvCacheNotExistError",
                 "LlmTimeoutError"):
        assert hasattr(kvbroker, name), name


def test_non_positive_timeouts_are_refused_without_a_call() -> None:
    import pytest

    import kvbroker

    with kvbroker.Client("unix:///nonexistent/kvbroker.sock") as kv:
        for bad in (0, -1.0):
            with pytest.raises(kvbroker.ParamInvalidError, match="timeout"):
                kv.ping(timeout=bad)
