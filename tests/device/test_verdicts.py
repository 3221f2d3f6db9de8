"""tests/device/verdicts.py on recorded numbers and recorded UCX_PROTO_INFO tables (no GPU needed), and
tests/device/install_bundle.py on two small wheels made here (one any Python takes, one no Python here takes)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.device.install_bundle import install
from tests.device.verdicts import floor_verdict, ucx_protocols, ucx_summary

# Recorded the way UCX 1.19/1.20 prints UCX_PROTO_INFO=y (openucx/ucx#7950's table; ai-dynamo/nixl#1195's prefix).
P = "[1767930429.284906] [gpu-host:13245:0]   "
CUDA_IPC_TABLES = "\n".join([
    "INFO kvbrokerd: nixl backend: cuda memory: yes",
    P + "+--------------------------------+-------------------------------------------------------------+",
    P + "| ucp_context_0 intra-node cfg#2 | remote memory read by ucp_get* from cuda/GPU0 to cuda/GPU0  |",
    P + "+--------------------------------+------------------------------------+------------------------+",
    P + "|                          0..inf | zero-copy                          | cuda_ipc/cuda          |",
    P + "+--------------------------------+------------------------------------+------------------------+",
    P + "| ucp_context_0 intra-node cfg#3 | remote memory write by ucp_put*(fast-completion) from cuda/GPU0 "
        "to cuda/GPU0 |",
    P + "|                           0..2K | short                              | cuda_ipc/cuda          |",
    P + "|                        2049..inf | zero-copy                          | cuda_ipc/cuda          |",
    P + "| ucp_context_0 intra-node cfg#1 | remote memory write by ucp_put* from host memory to host memory |",
    P + "|                         0..8246 | copy-in                            | posix/memory           |",
    P + "|                        8247..inf | zero-copy                          | cma/memory             |",
])
TCP_FALLBACK = "\n".join([
    "[1700000000.1] [h:1:0]     proto_debug.c:406  UCX  INFO  | ucp_context_0 intra-node cfg#1 | remote memory "
    "read by ucp_get* from cuda/GPU0 to cuda/GPU0 |",
    "[1700000000.1] [h:1:0]     proto_debug.c:406  UCX  INFO  |      0..inf | software emulation | tcp/lo |",
])


def test_device_direct_passes_at_or_over_the_floor_and_fails_under_it() -> None:
    assert floor_verdict("device", 180.0, 1300.0) == {
        "fraction": 0.05, "baseline": "device-to-device memcpy", "baseline_GBps": 1300.0, "pull_GBps": 180.0,
        "ok": True, "floor_GBps": 65.0}
    assert floor_verdict("device", 65.0, 1300.0)["ok"] is True
    slow = floor_verdict("device", 0.31, 1300.0)
    assert slow["ok"] is False and "under the floor 65.0 GB/s (5% of the device-to-device memcpy" in slow["why"]


def test_host_staged_is_judged_against_the_pinned_device_to_host_copy() -> None:
    assert floor_verdict("host", 3.0, 50.0)["floor_GBps"] == 2.5 and floor_verdict("host", 3.0, 50.0)["ok"]
    assert floor_verdict("host", 2.0, 50.0, fraction=0.1)["floor_GBps"] == 5.0
    assert floor_verdict("host", 2.0, 50.0, fraction=0.1)["ok"] is False


def test_without_a_memcpy_figure_the_floor_fails_rather_than_passing_blind() -> None:
    for baseline in (None, 0.0):
        verdict = floor_verdict("device", 500.0, baseline)
        assert verdict["ok"] is False and "cannot be applied" in verdict["why"]


def test_ucx_tables_are_read_with_their_lanes() -> None:
    tables = ucx_protocols(CUDA_IPC_TABLES)
    assert [t["context"] for t in tables] == [f"ucp_context_0 intra-node cfg#{i}" for i in (2, 3, 1)]
    assert tables[1]["rows"] == [
        {"range": "0..2K", "protocol": "short", "lanes": ["cuda_ipc/cuda"]},
        {"range": "2049..inf", "protocol": "zero-copy", "lanes": ["cuda_ipc/cuda"]}]


def test_the_summary_names_the_transport_of_large_device_to_device_transfers() -> None:
    summary = ucx_summary(CUDA_IPC_TABLES)
    assert summary["device_to_device_transports"] == ["cuda_ipc"] and summary["cuda_ipc"] is True
    assert summary["large_transfers"]["remote memory write by ucp_put* from host memory to host memory"] == ["cma"]
    fallback = ucx_summary(TCP_FALLBACK)
    assert fallback["device_to_device_transports"] == ["tcp"] and fallback["cuda_ipc"] is False
    assert ucx_summary("no tables at all\n") == {"large_transfers": {}, "device_to_device_transports": [],
                                                 "cuda_ipc": False, "tables": []}


def _wheel(directory: Path, name: str, tag: str) -> Path:
    """A minimal valid wheel: one module, its dist-info."""
    dist = f"{name}-1.0"
    path = directory / f"{name}-1.0-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 1\n")
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{dist}.dist-info/RECORD", f"{name}.py,,\n{dist}.dist-info/METADATA,,\n{dist}.dist-info/WHEEL,,\n"
                                               f"{dist}.dist-info/RECORD,,\n")
    return path


def test_the_bundle_installs_what_this_python_takes_and_skips_the_rest_with_why(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "kvb_pure", "py3-none-any")
    _wheel(wheels, "kvb_native", "cp27-cp27mu-manylinux1_x86_64")  # a CPython no one runs here
    report = install(wheels, tmp_path / "site")
    by_name = {w["wheel"].split("-")[0]: w for w in report["wheels"]}
    assert by_name["kvb_pure"]["installed"] is True and (tmp_path / "site" / "kvb_pure.py").exists()
    assert by_name["kvb_native"]["installed"] is False and "built for cp27" in by_name["kvb_native"]["why_not"]
    assert report["skipped"] == ["kvb_native-1.0-cp27-cp27mu-manylinux1_x86_64.whl"]


def test_no_bundle_is_reported_not_failed(tmp_path: Path) -> None:
    out = tmp_path / "bundle.json"
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("install_bundle.py")), str(tmp_path / "none"),
                           str(tmp_path / "site"), "--report", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "nothing installed" in json.loads(out.read_text())["note"]


@pytest.mark.parametrize("mode", ["device", "host"])
def test_every_mode_has_a_floor_and_says_what_it_is_measured_against(mode: str) -> None:
    assert floor_verdict(mode, 1.0, 10.0)["baseline"]
