"""tests/device/cuda_check.py as a test: the whole check where a CUDA device is usable (skipped elsewhere), and, on
machines without one, its clean refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.device.cuda_check import NO_DEVICE_EXIT, no_device_reason

SCRIPT = Path(__file__).with_name("cuda_check.py")
REASON = no_device_reason()


def _run(*args: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)
    return done.returncode, json.loads(done.stdout[done.stdout.index("{"):]), done.stderr


@pytest.mark.skipif(REASON is not None, reason=f"no CUDA device: {REASON}")
def test_the_cuda_check_passes_on_this_gpu() -> None:
    rc, summary, _ = _run("--mib", "128", "--rounds", "3")
    assert rc == 0 and summary["ok"] is True, summary


@pytest.mark.skipif(REASON is None, reason="a CUDA device is usable here")
def test_without_a_cuda_device_the_check_says_so_and_exits_2() -> None:
    rc, summary, stderr = _run()
    assert rc == NO_DEVICE_EXIT and summary["ok"] is False
    assert str(summary["skipped"]).startswith("no CUDA device: ") and "no CUDA device: " in stderr
