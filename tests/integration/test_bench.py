"""The benchmark harness runs end to end (its numbers are meaningless at this size; this only guards that it
works and that its JSON is complete). Timing lives in BENCHMARKS.md, never in assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_runs_and_reports_every_item() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kvbench.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    for subject in ("memcpy-1t", "socket-1c", "kvbroker-shm", "kvbroker-tcp"):
        assert all(v > 0 for v in report["throughput"][subject].values()), subject
    assert report["latency"]["kvbroker-shm-pull"]["samples"] > 0
    assert set(report["concurrency"]) == {"kvbroker-shm", "kvbroker-tcp"}
    assert not report["errors"]
