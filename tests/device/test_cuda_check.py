"""tests/device/cuda_check.py as a test: the whole check where a CUDA device is usable (skipped elsewhere); on
machines without one, its clean refusal, and the dry run of the device script (tests/device/run.sh: install the
bundle wheel by wheel, then the check), whose connector part (two processes, two daemons, host-staged) runs with CPU
tensors standing in for device tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.device.cuda_check import NO_DEVICE_EXIT, no_device_reason

SCRIPT = Path(__file__).with_name("cuda_check.py")
REASON = no_device_reason()


def _run(*args: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(done.stdout[done.stdout.index("{"):]), done.stderr


@pytest.mark.skipif(REASON is not None, reason=f"no CUDA device: {REASON}")
def test_the_cuda_check_passes_on_this_gpu() -> None:
    rc, summary, _ = _run("--mib", "128", "--connector-mib", "256", "--rounds", "3")
    assert rc == 0 and summary["ok"] is True, summary


@pytest.mark.skipif(REASON is None, reason="a CUDA device is usable here")
def test_without_a_cuda_device_the_check_says_so_and_exits_2() -> None:
    rc, summary, stderr = _run()
    assert rc == NO_DEVICE_EXIT and summary["ok"] is False
    assert str(summary["skipped"]).startswith("no CUDA device: ") and "no CUDA device: " in stderr


def test_the_device_scripts_dry_run_moves_the_connectors_blocks_between_two_processes_on_the_cpu(
        tmp_path: Path) -> None:
    """The device script as the device machine runs it, less the GPU: CPU tensors stand in for device tensors in
    the host-staged data path (register, stage, pull by block ids, copy in, release, close) between a prefill
    process and this one, every byte verified; device-direct is reported as not run, never as passed; the result,
    the install report and the daemons' logs land under $OUT."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "KVB_WHEELS": str(tmp_path / "no-bundle"), "KVB_DEVICE_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(SCRIPT.with_name("run.sh")), "--dry-run", "--rounds", "2"], env=env,
                          capture_output=True, text=True, timeout=300)
    summary = json.loads((tmp_path / "out" / "cuda_check.json").read_text())
    assert done.returncode == 0 and summary["ok"] is True, (summary, done.stderr[-2000:])
    assert "nothing installed" in summary["bundle"]["note"]
    assert summary["logs"] and all((tmp_path / "out" / "logs" / name).exists() for name in summary["logs"])
    assert "skipped" in summary["connector"]["host"]["floor"] and "handle_format" not in summary
    connector = summary["connector"]
    assert isinstance(connector, dict)
    host = connector["host"]
    assert host["ok"] is True and host["scattered_bytes_ok"] and host["untouched_ok"] and host["whole_bytes_ok"]
    assert host["release_received"] and host["caches_left"] == 0 and host["runs"] == 32
    assert "skipped" in connector["device"] and "ok" not in connector["device"]
    versions = summary["versions"]
    assert "dry_run" in summary and isinstance(versions, dict) and {"torch", "grpcio", "nixl-cu13"} <= set(versions)
